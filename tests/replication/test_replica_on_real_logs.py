"""The replica core on real partition logs: what a follower fetches is stored byte for byte,
a divergent tail is cut by epoch on disk, and a lost disk is rebuilt from the leader."""

from zbroker.actors.partition_log.replica import Acknowledge, Replica, ReplicaState
from tests.log.support import make_payload, open_log

CONFIG = {"segment_bytes": 500, "index_interval_bytes": 100}
NAMES = ("a", "b")


def state(epoch, leader, isr=NAMES):
    return ReplicaState(epoch, leader, leader, NAMES, isr, 2, {n: n for n in NAMES})


def produce(replica, log, tag, count=2, seq=None):
    assert replica.check_produce() is None
    base = log.append(make_payload(tag, count), count, append_time_ms=tag, producer_id=9,
                      producer_seq=tag if seq is None else seq)
    effects = replica.hold(tag, base + count, 0)
    return effects + replica.on_local_end(log.log_end, 0)


def catch_up(follower, leader, now=0):
    effects = []
    while True:
        _endpoint, request = follower.next_fetch(now)
        reply, data, more = leader.on_replica_fetch(request, now)
        effects += more
        follower.on_fetch_reply(reply, data, now)
        if not data and reply.diverging is None and request.fetch_offset == reply.log_end:
            return effects


def files(directory):
    return {p.name: p.read_bytes() for p in directory.glob("*.log")}


def test_a_follower_on_disk_copies_the_leader_byte_for_byte_and_acks_follow(tmp_path):
    la, lb = open_log(tmp_path / "a", **CONFIG), open_log(tmp_path / "b", **CONFIG)
    a, b = Replica("t", 0, "a", la, state(0, "a"), 0), Replica("t", 0, "b", lb, state(0, "a"), 0)
    held = []
    for tag in range(20):
        held += produce(a, la, tag)
    assert held == []
    acks = catch_up(b, a)
    assert [e.token for e in acks if isinstance(e, Acknowledge)] == list(range(20))
    assert files(tmp_path / "a") == files(tmp_path / "b")
    assert lb.producer_snapshot() == la.producer_snapshot()
    assert lb.epochs.entries() == la.epochs.entries() == [(0, 0)]
    la.close(), lb.close()


def test_failover_then_the_old_leader_cuts_its_divergent_tail_on_disk_and_keeps_dedupe(tmp_path):
    la, lb = open_log(tmp_path / "a", **CONFIG), open_log(tmp_path / "b", **CONFIG)
    a, b = Replica("t", 0, "a", la, state(0, "a"), 0), Replica("t", 0, "b", lb, state(0, "a"), 0)
    for tag in range(5):
        produce(a, la, tag)
    catch_up(b, a)
    produce(a, la, 5)                    # never replicated
    b.assign(state(1, "b"), 0)           # a is cut off; b leads epoch 1
    assert lb.check_sequence(9, 4) is not None  # the new leader knows the old one's batches
    produce(b, lb, 6, seq=5)             # the producer's retry of sequence 5 lands on b
    a.assign(state(1, "b"), 0)
    catch_up(a, b)
    assert files(tmp_path / "a") == files(tmp_path / "b")
    assert la.epochs.entries() == lb.epochs.entries() == [(0, 0), (1, 10)]
    assert la.check_sequence(9, 5) == lb.check_sequence(9, 5) == (10, 2)
    la.close(), lb.close()


def test_a_replica_on_an_empty_disk_rebuilds_from_a_leader_whose_log_starts_later(tmp_path):
    la = open_log(tmp_path / "a", **{**CONFIG, "retention_bytes": 0})
    a = Replica("t", 0, "a", la, state(0, "a", ("a",)), 0)
    for tag in range(20):
        la.append(make_payload(tag, 2), 2, append_time_ms=tag)
    la.enforce_retention(now_ms=0)
    assert la.log_start > 0
    lb = open_log(tmp_path / "b", **CONFIG)
    b = Replica("t", 0, "b", lb, state(0, "a", ("a",)), 0)
    catch_up(b, a)
    assert (lb.log_start, lb.log_end) == (la.log_start, la.log_end)
    assert files(tmp_path / "a") == files(tmp_path / "b")
    la.close(), lb.close()


def test_an_unreplicated_log_that_becomes_replicated_is_copied_from_its_log_start_and_the_new_replica_joins(
        tmp_path):
    """R = 1 -> 2: the old owner's log holds records written before any leader epoch (and
    retention moved its start); the new replica copies it from the log start, byte for byte,
    and the leader proposes it into the ISR once it has caught up."""
    from zbroker.actors.partition_log.replica import ProposeIsr
    la = open_log(tmp_path / "a", **{**CONFIG, "retention_bytes": 600})
    for tag in range(20):
        la.append(make_payload(tag, 2), 2, append_time_ms=tag, producer_id=9, producer_seq=tag)
    la.enforce_retention(now_ms=0)
    assert la.log_start > 0 and len(la.epochs) == 0  # unreplicated until now: no epoch cache
    a = Replica("t", 0, "a", la, state(1, "a", ("a",)), 0)
    assert la.epochs.entries() == [(1, la.log_end)]  # epoch 1 writes from here on
    lb = open_log(tmp_path / "b", **CONFIG)
    b = Replica("t", 0, "b", lb, state(1, "a", ("a",)), 0)
    effects = catch_up(b, a)
    assert [tuple(e.request.isr) for e in effects if isinstance(e, ProposeIsr)] == [("a", "b")]
    assert (lb.log_start, lb.log_end) == (la.log_start, la.log_end)
    assert files(tmp_path / "a") == files(tmp_path / "b")
    assert lb.check_sequence(9, 19) == la.check_sequence(9, 19)  # the dedupe state came along
    la.close(), lb.close()
