"""A partition actor follows the leading coordinator: the pure link, then its shell
against a fake standby that answers NOT_COORDINATOR and a fake leader."""

import pytest
import zmq

from zbroker.actors.partition_log import shell
from zbroker.actors.partition_log.coordinator_link import (BACKOFF_MAX_MS, CoordinatorLink, Move,
                                                           coordinator_endpoints, internal_endpoint_of)
from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.errors import NotCoordinator
from tests.support.actor_thread import start_actor_loop

A, B, C = "tcp://127.0.0.1:7401", "tcp://127.0.0.2:7401", "tcp://127.0.0.3:7401"


def leader(endpoint, **extra):
    return {"leader": {"endpoint": endpoint, "node_id": "n", "epoch": 3, **extra}}


def test_the_endpoint_list_is_split_on_commas_without_duplicates():
    assert coordinator_endpoints(f" {A}, {B},,{A} ") == [A, B]
    with pytest.raises(ValueError, match="no coordinator endpoint"):
        coordinator_endpoints(" , ")


def test_the_leaders_internal_endpoint_is_named_or_its_client_port_plus_one():
    assert internal_endpoint_of({"endpoint": "tcp://127.0.0.2:7400"}) == "tcp://127.0.0.2:7401"
    assert internal_endpoint_of({"endpoint": "tcp://h:7400", "internal_endpoint": "tcp://h:9000"}) == "tcp://h:9000"
    assert internal_endpoint_of({"endpoint": "ipc:///x"}) is None
    assert internal_endpoint_of({"endpoint": "tcp://h:65535"}) is None
    assert internal_endpoint_of({}) is None


def test_a_standby_sends_the_actor_to_the_leader_after_a_backoff():
    link = CoordinatorLink(A)
    link.registration_sent(0)
    move = link.not_coordinator(leader("tcp://127.0.0.2:7400"), now_ms=10)
    assert move == Move(old=A, new=B, reason="not_coordinator", leader=leader("tcp://127.0.0.2:7400")["leader"])
    assert link.current == B
    assert not link.register_due(10 + 49) and link.register_due(10 + 50)
    assert link.next_deadline() == 60
    link.registration_sent(60)
    assert not link.register_due(61)  # back to the once-a-second pace
    link.answered()
    assert link.tick(60 + 10_000) is None and link.current == B


def test_redirects_in_a_row_back_off_doubling_up_to_the_cap_and_an_answer_resets_it():
    link = CoordinatorLink([A, B])
    waits = []
    for i in range(8):
        link.not_coordinator({"leader": None}, now_ms=0)  # mid-failover: nobody holds the lease
        waits.append(link.backoff_ms())
    assert waits == [50, 100, 200, 400, 800, 1600, BACKOFF_MAX_MS, BACKOFF_MAX_MS]
    link.answered()
    assert link.backoff_ms() == 50


def test_no_leader_named_or_the_current_one_named_moves_to_the_next_endpoint():
    link = CoordinatorLink([A, B, C])
    assert link.not_coordinator({"leader": None}, 0).new == B
    assert link.not_coordinator(leader("tcp://127.0.0.2:7400"), 0).new == C  # B names itself: stale
    assert link.not_coordinator("not a map", 0).new == A


def test_unanswered_registrations_rotate_and_a_followed_leader_that_dies_sends_it_back_to_the_list():
    link = CoordinatorLink(A, timeout_ms=2500)
    link.not_coordinator(leader("tcp://127.0.0.3:7400"), 0)
    assert link.current == C
    link.registration_sent(100)
    link.registration_sent(1100)  # the first unanswered one counts
    assert link.tick(2599) is None
    assert link.next_deadline() == 2600
    move = link.tick(2600)
    assert move == Move(old=C, new=A, reason="timeout", leader=link.leader)
    assert link.register_due(2600 + link.backoff_ms())


def test_a_leader_that_stopped_answering_is_not_followed_back_until_a_newer_epoch_names_it():
    link = CoordinatorLink([A, B], timeout_ms=2500)
    link.not_coordinator(leader("tcp://127.0.0.3:7400"), 0)  # epoch 3
    link.registration_sent(0)
    assert link.tick(2500).new == A  # C died
    assert link.not_coordinator(leader("tcp://127.0.0.3:7400"), 2600).new == B  # A still names it: on
    assert link.not_coordinator({"leader": {"endpoint": "tcp://127.0.0.3:7400", "epoch": 4}}, 2700).new == C
    link.answered()
    link.registration_sent(3000)
    link.tick(5500)  # C died again, at epoch 4
    link.answered()  # A answered: forgotten
    assert link.not_coordinator({"leader": {"endpoint": "tcp://127.0.0.3:7400", "epoch": 4}}, 6000).new == C


def test_rotation_goes_past_the_endpoint_that_stopped_answering():
    link = CoordinatorLink([A, B, C], timeout_ms=2500)
    link.not_coordinator({"leader": None}, 0)
    link.not_coordinator({"leader": None}, 0)
    assert link.current == C
    link.registration_sent(0)
    assert link.tick(2500).new == A
    stale = {"leader": {"endpoint": "tcp://127.0.0.3:7400", "epoch": 1}}  # C's internal endpoint is :7401
    assert [link.not_coordinator(stale, 2600 + i).new for i in range(3)] == [B, A, B]


def test_one_endpoint_and_no_redirect_never_moves():
    link = CoordinatorLink(A)
    for now in range(0, 60_000, 1000):
        link.registration_sent(now)
        assert link.tick(now) is None
    assert link.current == A


def test_an_answer_stops_the_timeout():
    link = CoordinatorLink([A, B])
    link.registration_sent(0)
    link.answered()
    assert link.tick(100_000) is None and link.next_deadline() is None


class FakeCoordinator:
    """A ROUTER that records registrations and answers them: as a standby naming `leader`, or as the leader."""

    def __init__(self, ctx, endpoint, standby_for=None):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.standby_for = standby_for
        self.registrations = 0

    def serve(self, poll_ms):
        if not self.sock.poll(poll_ms):
            return
        identity, *frames = self.sock.recv_multipart()
        env = codec.decode_request(frames)
        if env.op != "register":
            return
        self.registrations += 1
        if self.standby_for is not None:
            error = NotCoordinator("this node stands by", leader={"endpoint": "tcp://x:1", "node_id": "n1",
                                                                   "epoch": 2, "internal_endpoint": self.standby_for})
            self.sock.send_multipart([identity, *codec.encode_error("register", env.corr_id, error)])
        else:
            self.sock.send_multipart([identity, *codec.encode_reply(m.RegisterReply(assignment=[]), env.corr_id)])


def test_the_actor_registers_with_the_leader_a_standby_names(tmp_path):
    from zbroker.actors.partition_log.core import PartitionActorCore

    ctx = zmq.Context()
    standby = FakeCoordinator(ctx, "inproc://standby", standby_for="inproc://leader")
    leading = FakeCoordinator(ctx, "inproc://leader")
    core = PartitionActorCore("p0", open_log=shell.LockedLogOpener(tmp_path))
    thread, stop, failed = start_actor_loop(ctx, core, "inproc://standby", link="inproc://standby")
    try:
        for _ in range(400):  # up to 20 s of polling; done as soon as the leader has two
            standby.serve(25)
            leading.serve(25)
            if leading.registrations >= 2:
                break
    finally:
        stop.stopping = True
        thread.join(10)
        standby.sock.close(linger=0)
        leading.sock.close(linger=0)
        ctx.term()
    assert not thread.is_alive() and failed == []
    assert standby.registrations >= 1 and leading.registrations >= 2
    assert core.registered  # the leader's answers count; the standby's did not
    core.close()


def test_built_in_actors_of_cluster_nodes_have_ids_of_their_own():
    # The leading coordinator's ROUTER refuses a second connection under one id: three
    # nodes' "p0" left two of them unregistered (seen in the failover benchmark).
    from zbroker.supervisor import BrokerConfig

    alone = BrokerConfig(data_dir="/d", port=7400)
    assert [alone.builtin_actor_id(i) for i in range(2)] == ["p0", "p1"]
    nodes = [BrokerConfig(data_dir="/d", host=h, advertise_host=h, port=7400, offsets_url="postgresql://db/x")
             for h in ("127.0.0.1", "127.0.0.2")]
    assert [n.builtin_actor_id(0) for n in nodes] == ["p0@127.0.0.1:7400", "p0@127.0.0.2:7400"]
