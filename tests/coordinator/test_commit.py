"""Committed offsets: the contiguous finished prefix, persisted once per call, durable apart."""

from zbroker.actors.group_coordinator.core import GroupConfig
from zbroker.protocol.errors import StaleLease
from tests.coordinator import Driver


def leased(d, records=20, **kw):
    d.log_range("t", 0, 0, records)
    member = d.join(**kw)
    reply = d.poll(member, max_records=records)
    return member, reply.deliveries[0][2]


def test_named_example_11_and_13_acked_12_not():
    d = Driver()
    member, lease = leased(d)
    d.settle("ack", member, [["t", 0, lease, 0, 11]])
    assert d.committed() == 11
    d.settle("ack", member, [["t", 0, lease, 11, 12], ["t", 0, lease, 13, 14]])
    assert d.committed() == 12  # 12 is unfinished: the commit must not pass it
    assert d.persisted()[-1].committed == 12 and d.persisted()[-1].holes == [[13, 14]]
    d.settle("ack", member, [["t", 0, lease, 12, 13]])
    assert d.committed() == 14
    assert d.persisted()[-1].committed == 14 and d.persisted()[-1].holes == []


def test_acks_in_reverse_order_commit_only_at_the_end():
    d = Driver()
    member, lease = leased(d, 10)
    for offset in reversed(range(1, 10)):
        d.settle("ack", member, [["t", 0, lease, offset, offset + 1]])
        assert d.committed() == 0
    d.settle("ack", member, [["t", 0, lease, 0, 1]])
    assert d.committed() == 10
    assert d.partition()["holes"] == 0


def test_one_persist_per_partition_per_call_however_many_ranges():
    d = Driver()
    member, lease = leased(d, 100)
    mark = d.mark()
    reply = d.settle("ack", member, [["t", 0, lease, o, o + 1] for o in range(0, 100, 2)] +
                     [["t", 0, lease, o, o + 1] for o in range(1, 100, 2)])
    assert reply.applied == 100
    persisted = d.persisted(mark)
    assert len(persisted) == 1 and persisted[0].committed == 100


def test_persist_carries_generation_and_reset_epoch():
    d = Driver()
    member, lease = leased(d)
    mark = d.mark()
    d.settle("ack", member, [["t", 0, lease, 0, 5]])
    (p,) = d.persisted(mark)
    assert (p.group, p.topic, p.partition, p.committed, p.generation, p.reset_epoch) == ("g", "t", 0, 5, 1, 0)


def test_a_hole_change_above_an_unchanged_committed_offset_is_persisted():
    d = Driver()
    member, lease = leased(d)
    mark = d.mark()
    d.settle("ack", member, [["t", 0, lease, 5, 6]])
    d.settle("ack", member, [["t", 0, lease, 7, 9]])
    assert [(p.committed, p.holes) for p in d.persisted(mark)] == [(0, [[5, 6]]), (0, [[5, 6], [7, 9]])]


def test_repeated_ack_under_the_same_lease_is_idempotent():
    d = Driver()
    member, lease = leased(d)
    assert d.settle("ack", member, [["t", 0, lease, 0, 10]]).applied == 10
    mark = d.mark()
    assert d.settle("ack", member, [["t", 0, lease, 0, 10]]).applied == 10
    assert d.persisted(mark) == []  # nothing changed
    assert d.committed() == 10


def test_ack_beyond_the_lease_is_stale_for_that_part_only():
    d = Driver()
    member, lease = leased(d, 10)
    d.log_range("t", 0, 0, 30)
    err = d.settle("ack", member, [["t", 0, lease, 5, 15]])
    assert isinstance(err, StaleLease)
    assert err.data["stale"] == [["t", 0, lease, 10, 15]] and err.data["applied"] == 5
    assert d.partition()["holes"] == 1


def test_holes_are_persisted_up_to_the_bound_and_truncation_is_counted():
    d = Driver(max_persisted_holes=3)
    member, lease = leased(d, 20)
    mark = d.mark()
    d.settle("ack", member, [["t", 0, lease, o, o + 1] for o in (2, 4, 6)])
    assert d.persisted(mark)[-1].holes == [[2, 3], [4, 5], [6, 7]]
    assert d.core.statistics()["holes_truncated"] == 0
    d.settle("ack", member, [["t", 0, lease, 10, 11], ["t", 0, lease, 8, 9]])
    assert d.persisted(mark)[-1].holes == [[2, 3], [4, 5], [6, 7]]  # the lowest three
    assert d.core.statistics()["holes_truncated"] == 1
    assert len(d.logs("holes_truncated", mark)) == 1
    d.settle("ack", member, [["t", 0, lease, 12, 13]])
    assert d.core.statistics()["holes_truncated"] == 2
    assert len(d.logs("holes_truncated", mark)) == 1  # logged when it starts, counted every time


def test_durable_and_pending_committed_are_reported_apart():
    d = Driver()
    member, lease = leased(d, 20)
    d.settle("ack", member, [["t", 0, lease, 0, 8]])
    part = d.partition()
    assert part["committed_pending"] == 8
    d.feed(d.core.on_durable([("g", "t", 0, 5, 0)], d.now))
    part = d.partition()
    assert (part["committed"], part["committed_pending"], part["lag"]) == (5, 8, 15)
    d.feed(d.core.on_durable([("g", "t", 0, 3, 0)], d.now))  # late and older: ignored
    assert d.partition()["committed"] == 5
    d.feed(d.core.on_durable([("g", "t", 0, 8, 0), ("nope", "t", 0, 1, 0)], d.now))
    assert d.partition()["committed"] == 8


def test_lag_fields_and_blocker():
    d = Driver(config=GroupConfig(ack_timeout_ms=5_000))
    d.log_range("t", 0, 0, 10)
    d.advance(2_000)
    member = d.join()
    reply = d.poll(member, max_records=4)
    lease = reply.deliveries[0][2]
    d.advance(1_000)
    part = d.partition()
    assert part["in_flight"] == 4 and part["log_end"] == 10
    assert part["oldest_unfinished_age_ms"] == 3_000  # since offset 0 was first seen
    assert part["blocker"] == {"offset": 0, "state": "leased", "member": member.member_id, "since_ms": 1_000,
                               "attempt": 1, "deadline_in_ms": 4_000}
    d.settle("ack", member, [["t", 0, lease, 0, 4]])
    assert d.partition()["blocker"]["state"] == "not_delivered"
    d.poll(member, max_records=1)
    d.advance(5_000)  # lease expired
    blocker = d.partition()["blocker"]
    assert (blocker["offset"], blocker["state"], blocker["attempt"], blocker["reason"]) == (4, "ready", 1, "timeout")
    d.poll(member, max_records=10)
    d.settle("ack", member, [["t", 0, lease, 0, 4]])
    assert d.partition()["redeliveries"] == 1
