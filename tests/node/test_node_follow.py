"""The Node.js client follows the leading coordinator of a cluster (issue 26): the pure
`Coordinators` decisions, then a client given a fake standby's URL (alone, or behind a
URL nobody answers) that finds the leader (the fake broker of test_cross_language.py).

Skips without Node.js unless ZBROKER_REQUIRE_NODE=1 (see conftest.py).
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import zmq

from tests.node.test_cross_language import FakeBroker, selfcheck
from zbroker.protocol import codec
from zbroker.protocol.errors import NotCoordinator

pytestmark = [pytest.mark.node, pytest.mark.processes]  # each test runs node

A, B, L = "tcp://127.0.0.1:1", "tcp://127.0.0.2:1", "tcp://127.0.0.3:1"


def test_coordinators_follow_the_named_leader_rotate_otherwise_and_back_off(run_node):
    out = selfcheck(run_node, "coordinators", {"urls": f"{A}, {B}", "errors": [
        {"code": "NOT_COORDINATOR", "leader": {"endpoint": L, "node_id": "n3", "epoch": 4}},
        {"code": "TIMEOUT", "local": True},           # the leader followed died: back to the list
        {"code": "NOT_COORDINATOR", "leader": None},  # mid-failover: nobody holds the lease
        {"code": "NOT_COORDINATOR", "leader": {"endpoint": B}},  # B names itself: stale, next URL
        {"code": "NOT_COORDINATOR", "leader": {"endpoint": L}, "from": B},  # a concurrent request moved it
        {"code": "UNKNOWN_TOPIC"},
        {"code": "TIMEOUT", "local": False},          # an actor's own TIMEOUT answer is not ours
    ]})
    assert [(s["again"], s["current"]) for s in out["steps"]] == [
        (True, L), (True, A), (True, B), (True, A), (True, A), (False, A), (False, A)]
    assert [s["backoffMs"] for s in out["steps"][:4]] == [50, 100, 200, 400]
    assert out["afterAnswer"] == 50 and out["attempts"] == 12


def test_a_single_url_rotates_nowhere_on_a_timeout_but_leaves_a_leader_it_was_sent_to(run_node):
    out = selfcheck(run_node, "coordinators", {"urls": [A], "errors": [{"code": "TIMEOUT", "local": True}]})
    assert out["steps"] == [{"again": False, "current": A, "backoffMs": 50}]
    out = selfcheck(run_node, "coordinators", {"urls": [A], "errors": [
        {"code": "NOT_COORDINATOR", "leader": {"endpoint": L, "epoch": 2}},
        {"code": "TIMEOUT", "local": True}]})
    assert [(s["again"], s["current"]) for s in out["steps"]] == [(True, L), (True, A)]


def test_a_leader_that_stopped_answering_is_not_followed_back_until_a_newer_epoch_names_it(run_node):
    out = selfcheck(run_node, "coordinators", {"urls": [A, B], "errors": [
        {"code": "NOT_COORDINATOR", "leader": {"endpoint": L, "epoch": 4}},
        {"code": "TIMEOUT", "local": True},
        {"code": "NOT_COORDINATOR", "leader": {"endpoint": L, "epoch": 4}},  # a standby still names it
        {"code": "NOT_COORDINATOR", "leader": {"endpoint": L, "epoch": 5}},  # it leads again
    ]})
    assert [s["current"] for s in out["steps"]] == [L, A, B, L]
    out = selfcheck(run_node, "coordinators", {"urls": [A, B, L], "errors": [
        {"code": "NOT_COORDINATOR", "leader": None}, {"code": "NOT_COORDINATOR", "leader": None},  # to L
        {"code": "TIMEOUT", "local": True},                                   # L died
        {"code": "NOT_COORDINATOR", "leader": {"endpoint": L, "epoch": 1}},
        {"code": "NOT_COORDINATOR", "leader": {"endpoint": L, "epoch": 1}},
    ]})
    assert [s["current"] for s in out["steps"]] == [B, L, A, B, A]  # round the list past L


class FakeStandby:
    """A coordinator that stands by: every request gets NOT_COORDINATOR naming `leader`."""

    def __init__(self, leader: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.url = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.leader = leader
        self.answered: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            identity, *frames = self.sock.recv_multipart()
            env = codec.decode_request(frames)
            self.answered.append(env.op)
            err = NotCoordinator("this node stands by", leader={"endpoint": self.leader, "node_id": "n1", "epoch": 7})
            self.sock.send_multipart([identity, *codec.encode_error(env.op, env.corr_id, err)])

    def __enter__(self) -> "FakeStandby":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def leader():
    with FakeBroker() as broker:
        original = broker.c_hello
        broker.c_hello = lambda identity, env: dataclasses.replace(original(identity, env),
                                                                   features=["cluster", "replication", "later"])
        yield broker


def test_a_client_given_only_a_standby_finds_the_leader_and_reads_its_features(run_node, leader):
    with FakeStandby(leader.url) as standby:
        out = selfcheck(run_node, "follow", {}, standby.url, timeout=60)
    assert "failure" not in out, out["failure"]
    assert standby.answered[:1] == ["hello"]  # then every request went to the leader
    assert out["url"] == leader.url and out["actor"] == "group-coordinator"
    assert out["features"] == ["cluster", "replication", "later"]
    assert out["fetched"] == ["a", "b"] and out["topics"] == ["follow"]


def test_a_url_that_does_not_answer_times_out_to_the_next_of_the_list(run_node, leader):
    # Nothing listens at the first URL (bound, then closed): its requests time out.
    probe = zmq.Context.instance().socket(zmq.ROUTER)
    probe.bind("tcp://127.0.0.1:*")
    silent = probe.getsockopt_string(zmq.LAST_ENDPOINT)
    probe.close(linger=0)
    with FakeStandby(leader.url) as standby:
        out = selfcheck(run_node, "follow", {"requestTimeoutMs": 500}, f"{silent},{standby.url}", timeout=60)
    assert "failure" not in out, out["failure"]
    assert out["url"] == leader.url and out["fetched"] == ["a", "b"]
    assert standby.answered[:1] == ["hello"]
