"""Replication wired into the partition-log actor core: two cores on real logs exchange
replica_fetch through `handle`, as their shells would, with a hand-made assignment."""

import pytest

from zbroker.actors.partition_log import replica as replica_module

from zbroker.actors.partition_log.core import (FsyncPolicy, PartitionActorCore, Reply, ReplyError, SendToCoordinator,
                                               SendToLeader)
from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.batch import decode_fetched
from zbroker.protocol.errors import ErrorCode
from tests.unit.test_partition_actor_core import Opener, env, payload

ENDPOINTS = {"a": "tcp://127.0.0.1:1", "b": "tcp://127.0.0.1:2"}


def state(epoch=0, leader="a", isr=("a", "b"), min_insync=2, high_watermark=None):
    out = {"leader_epoch": epoch, "leader": leader, "leader_endpoint": ENDPOINTS.get(leader),
           "replicas": ["a", "b"], "isr": list(isr), "min_insync": min_insync, "replica_endpoints": ENDPOINTS}
    if high_watermark is not None:
        out["high_watermark"] = high_watermark
    return out


def assign(core, now=0, coordinator_epoch=1, **kw):
    msg = m.Assign(assignment=[["t", 0, None], ["plain", 0, None]], coordinator_epoch=coordinator_epoch,
                   replicas=[["t", 0, state(**kw)]])
    return core.handle("coord", env(msg), now, from_coordinator=True)


@pytest.fixture(params=["interval:1000", "always"])
def pair(tmp_path, request):
    fsync = FsyncPolicy.parse(request.param)
    a = PartitionActorCore("a", open_log=Opener(tmp_path / "a"), fsync=fsync)
    b = PartitionActorCore("b", open_log=Opener(tmp_path / "b"), fsync=fsync)
    assign(a)
    assign(b)
    yield a, b
    a.close()
    b.close()


def produce(core, value, topic="t", now=1, pid=0, seq=-1):
    effects = core.handle(("client", value), env(m.Produce(topic=topic, partition=0, producer_id=pid, sequence=seq),
                                                 [payload(value)]), now)
    return effects + core.end_turn(now)


def pump(follower, leader, now=2, rounds=6, queue=None):
    """Carry the follower's fetches (`queue`: the ones it just asked to send, else the ones
    due now) to the leader and back, as the shells do, until the leader parks one (the
    follower is caught up)."""
    released = []
    queue = follower.replica_fetches(now) if queue is None else queue
    for _ in range(rounds):
        if not queue:
            break
        [send] = queue
        assert isinstance(send, SendToLeader) and send.endpoint == ENDPOINTS["a"]
        request = codec.decode_request(codec.encode_request(send.msg, 7))
        effects = leader.handle("follower", request, now) + leader.end_turn(now)
        answer = [e for e in effects if getattr(e, "token", None) == "follower"]
        released += [e for e in effects if getattr(e, "token", None) != "follower"]
        if not answer:
            break  # parked at the log end
        [reply] = answer
        if isinstance(reply, ReplyError):
            follower.on_replica_fetch_reply(("t", 0), None, [], reply.error, now)
            break
        wire = codec.decode_reply(codec.encode_reply(reply.msg, 7, reply.frames))
        queue = follower.on_replica_fetch_reply(("t", 0), wire.msg, wire.frames, None, now)
    return released


def test_produce_is_acknowledged_once_the_follower_has_the_batch(pair):
    a, b = pair
    assert produce(a, b"one") == []  # held: only on the leader
    [fetched] = a.handle("c", env(m.Fetch(topic="t", partition=0, offset=0)), 1)
    assert fetched.msg.log_end == 0 and fetched.frames == (b"",)  # consumers see nothing yet
    released = pump(b, a)
    assert [e.msg.base_offset for e in released if isinstance(e, Reply)] == [0]
    [fetched] = a.handle("c", env(m.Fetch(topic="t", partition=0, offset=0)), 3)
    assert fetched.msg.log_end == 1
    assert [r.value for r in decode_fetched(fetched.frames[0], "t", 0)] == [b"one"]
    assert b.logs[("t", 0)].read(0, 1 << 20) == a.logs[("t", 0)].read(0, 1 << 20)
    # The leader reports its HW; the follower leaves the partition out and says where it is.
    assert [row[:4] for row in a.registration(endpoint="x", storage_id="s", pid=1).partitions] == [
        ["plain", 0, 0, 0], ["t", 0, 0, 1]]
    registration = b.registration(endpoint="x", storage_id="s", pid=1)
    assert [row[0] for row in registration.partitions] == ["plain"]
    # The fetch that moved the HW waits at the log end: the follower learns the HW with the
    # next answer (the next append, or here the end of the long poll), as in Kafka.
    assert registration.replica_states == [["t", 0, 0, 1, 0, None]]  # keeping_up: a leader's only
    assert a.registration(endpoint="x", storage_id="s", pid=1).replica_states == [["t", 0, 0, 1, 1, 2]]
    [answer] = [e for e in a.tick(2 + 500) if getattr(e, "token", None) == "follower"]
    wire = codec.decode_reply(codec.encode_reply(answer.msg, 7, answer.frames))
    b.on_replica_fetch_reply(("t", 0), wire.msg, wire.frames, None, 2 + 500)
    assert b.registration(endpoint="x", storage_id="s", pid=1).replica_states == [["t", 0, 0, 1, 1, None]]


@pytest.mark.parametrize("carried", [None, 1])
def test_a_follower_elected_leader_reads_from_the_high_watermark_its_assignment_carries(pair, carried):
    """The follower's own HW is an answer old (above); elected, it serves consumers the records
    acknowledged before the change at once when the assignment carries the last published HW,
    and only once its followers have fetched in its epoch when it does not (an older coordinator)."""
    a, b = pair
    produce(a, b"one")
    assert [e.msg.base_offset for e in pump(b, a) if isinstance(e, Reply)] == [0]  # acknowledged
    assert b.replicas[("t", 0)].high_watermark == 0
    assign(b, now=3, coordinator_epoch=2, epoch=1, leader="b", high_watermark=carried)
    [fetched] = b.handle("c", env(m.Fetch(topic="t", partition=0, offset=0)), 3)
    assert [r.value for r in decode_fetched(fetched.frames[0], "t", 0)] == ([b"one"] if carried else [])
    # Either way nothing is published before the HW is computed from the ISR in epoch 1.
    assert [row[0] for row in b.registration(endpoint="x", storage_id="s", pid=1).partitions] == ["plain"]


def test_a_follower_refuses_produce_and_fetch_with_the_leader(pair):
    a, b = pair
    [err] = produce(b, b"x")
    assert err.error.code is ErrorCode.NOT_LEADER and err.error.data["leader"]["actor_id"] == "a"
    [err] = b.handle("c", env(m.Fetch(topic="t", partition=0, offset=0)), 1)
    assert err.error.code is ErrorCode.NOT_LEADER
    [ok] = produce(b, b"x", topic="plain")  # unreplicated partitions beside it: today's path
    assert isinstance(ok, Reply)


def test_a_lagging_follower_stays_in_the_isr_at_min_insync_and_produce_is_refused_meanwhile(pair):
    """The ISR floor (docs/SEMANTICS.md): at R = M = 2 the laggard is not proposed out, so an
    election still finds every acknowledged record on an ISR member; the leader refuses produce
    and fails what it held until the laggard keeps up again."""
    a, b = pair
    assert produce(a, b"before") == []  # held for b
    effects = a.tick(20_000)
    assert not [e for e in effects if isinstance(e, SendToCoordinator)]  # no ISR below M proposed
    assert [e.error.code for e in effects if hasattr(e, "error")] == [ErrorCode.NOT_ENOUGH_REPLICAS]
    end = a.logs[("t", 0)].log_end
    [err] = produce(a, b"after", now=20_001)
    assert err.error.code is ErrorCode.NOT_ENOUGH_REPLICAS and a.logs[("t", 0)].log_end == end
    assert err.error.data["lagging"] == ["b"]
    assert a.registration(endpoint="x", storage_id="s", pid=1).replica_states[0][5] == 1  # keeping up
    # b fetches again and keeps up: produce goes on, and the retried batch is acknowledged.
    pump(b, a, now=20_002)
    assert a.replicas[("t", 0)].keeping_up == 2
    [woken] = produce(a, b"after", now=20_003)  # held; b's parked fetch is answered with it
    wire = codec.decode_reply(codec.encode_reply(woken.msg, 7, woken.frames))
    queue = b.on_replica_fetch_reply(("t", 0), wire.msg, wire.frames, None, 20_003)
    assert [e.msg.base_offset for e in pump(b, a, now=20_004, queue=queue) if isinstance(e, Reply)] == [1]


def test_below_min_insync_in_the_recorded_isr_nothing_is_appended_and_the_held_fail(pair):
    """The controller may still record an ISR below M (a dead or restarted member removed)."""
    a, b = pair
    assert produce(a, b"before") == []
    effects = a.on_alter_isr_reply(("t", 0), m.AlterIsrReply("t", 0, 0, ["a"]), None, 2)
    assert [e.error.code for e in effects] == [ErrorCode.NOT_ENOUGH_REPLICAS]  # the held one fails
    end = a.logs[("t", 0)].log_end
    [err] = produce(a, b"after")
    assert err.error.code is ErrorCode.NOT_ENOUGH_REPLICAS and a.logs[("t", 0)].log_end == end
    # The HW stays below what is on a alone: consumers neither see nor commit past it.
    a.tick(3)
    [fetched] = a.handle("c", env(m.Fetch(topic="t", partition=0, offset=0)), 3)
    assert fetched.msg.log_end == 0 and a.replicas[("t", 0)].high_watermark == 0


def test_an_older_coordinator_or_leader_epoch_is_refused(pair):
    a, b = pair
    assign(a, coordinator_epoch=3)
    [*_, err] = assign(a, coordinator_epoch=2)
    assert isinstance(err, ReplyError) and err.error.code is ErrorCode.STALE_EPOCH
    stale = m.ReplicaFetch("t", 0, "b", 0, 0, -1)
    assign(a, coordinator_epoch=3, epoch=1)
    [err] = a.handle("f", env(stale), 1)
    assert err.error.code is ErrorCode.STALE_EPOCH


def test_a_leader_deposed_by_a_newer_epoch_fails_its_held_produces(pair):
    a, b = pair
    assert produce(a, b"x") == []
    effects = a.handle("f", env(m.ReplicaFetch("t", 0, "b", 5, 0, -1)), 2)
    codes = sorted(e.error.code.value for e in effects)
    assert codes == ["NOT_LEADER", "NOT_LEADER"]  # the held produce, and the fetch itself
    [err] = produce(a, b"y")
    assert err.error.code is ErrorCode.NOT_LEADER


def reported_end(core):
    rows = {(r[0], r[1]): r[3] for r in core.registration(endpoint="x", storage_id="s", pid=1).partitions}
    return rows.get(("t", 0))


@pytest.mark.parametrize("fsync", ["interval:1000", "always"])
def test_the_log_end_a_leader_reports_never_dips_across_its_restart(tmp_path, fsync):
    policy = FsyncPolicy.parse(fsync)
    a = PartitionActorCore("a", open_log=Opener(tmp_path / "a"), fsync=policy)
    b = PartitionActorCore("b", open_log=Opener(tmp_path / "b"), fsync=policy)
    assign(a)
    assign(b)
    for value in (b"one", b"two", b"three"):
        produce(a, value)
    pump(b, a)
    assert reported_end(a) == 3
    a.close()
    # Restarted on its own directory and elected again at a new epoch: its high watermark
    # starts at its log start, which it must not publish as the log end.
    a = PartitionActorCore("a", open_log=Opener(tmp_path / "a"), fsync=policy)
    seen = []
    assign(a, now=10, coordinator_epoch=2, epoch=1)
    seen.append(reported_end(a))
    assign(b, now=10, coordinator_epoch=2, epoch=1)
    seen.append(reported_end(a))
    pump(b, a, now=11)
    seen.append(reported_end(a))
    assert all(end is None or end >= 3 for end in seen), seen  # None: left out, the last one stands
    assert seen[-1] == 3
    a.close()
    b.close()


def test_a_dead_letter_from_an_older_coordinator_is_refused(pair):
    # A paused former leader's dead-letter append must not land once a newer coordinator
    # has assigned the partition; a client's produce (no coordinator epoch) still does.
    a, _b = pair
    assign(a, coordinator_epoch=5)

    def send(msg, value):
        effects = a.handle(("c", value), env(msg, [payload(value)]), 1) + a.end_turn(1)
        return [e for e in effects if isinstance(e, (Reply, ReplyError))]

    end = a.logs[("plain", 0)].log_end
    [err] = send(m.Produce(topic="plain", partition=0, producer_id=9, sequence=0, coordinator_epoch=4), b"dlq")
    assert isinstance(err, ReplyError) and err.error.code is ErrorCode.STALE_EPOCH
    assert a.logs[("plain", 0)].log_end == end
    [ok] = send(m.Produce(topic="plain", partition=0, producer_id=9, sequence=0, coordinator_epoch=5), b"dlq")
    assert isinstance(ok, Reply)
    [ok] = send(m.Produce(topic="plain", partition=0), b"client")
    assert isinstance(ok, Reply) and a.logs[("plain", 0)].log_end == end + 2


def test_the_produces_of_one_turn_reach_a_waiting_follower_in_one_answer(pair):
    a, b = pair
    pump(b, a)  # b's fetch waits at the (empty) log end
    effects = []
    for value in (b"one", b"two"):
        effects += a.handle(("client", value), env(m.Produce(topic="t", partition=0), [payload(value)]), 1)
    assert not [e for e in effects if getattr(e, "token", None) == "follower"]  # not once per produce
    [answer] = [e for e in a.end_turn(1) if getattr(e, "token", None) == "follower"]
    assert [r.value for r in decode_fetched(b"".join(answer.frames), "t", 0)] == [b"one", b"two"]


def test_under_a_stream_a_waiting_fetch_is_held_for_one_linger_at_most(pair):
    """Replica.answer_at decides (tests/replication/test_waiting_fetch.py); the core holds the
    fetch, and answers it from tick when the linger ends."""
    a, b = pair
    pump(b, a, now=0)
    value = b"v" * 40_000
    for now in (1, 2, 3):  # a stream too thin yet to fill 64 KiB within the linger: answered at once
        effects = produce(a, value, now=now)
        [answer] = [e for e in effects if getattr(e, "token", None) == "follower"]
        [send] = pump_answer(b, answer, now)
        request = codec.decode_request(codec.encode_request(send.msg, 7))
        assert not [e for e in a.handle("follower", request, now) + a.end_turn(now)
                    if getattr(e, "token", None) == "follower"]  # at the log end again: waits
    assert not [e for e in produce(a, value, now=4) if getattr(e, "token", None) == "follower"]  # held
    assert a.next_deadline() <= 4 + replica_module.FETCH_LINGER_MS
    assert not [e for e in a.tick(5) if getattr(e, "token", None) == "follower"]
    [answer] = [e for e in a.tick(4 + replica_module.FETCH_LINGER_MS) if getattr(e, "token", None) == "follower"]
    assert len(b"".join(answer.frames)) > len(value)


def pump_answer(follower, answer, now):
    wire = codec.decode_reply(codec.encode_reply(answer.msg, 7, answer.frames))
    return follower.on_replica_fetch_reply(("t", 0), wire.msg, wire.frames, None, now)
