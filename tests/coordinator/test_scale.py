"""A million records in flight cost a handful of range entries, not a million."""

import time

from actors.group_coordinator.core import GroupConfig
from tests.coordinator import Driver, ranges_of

MILLION = 1_000_000
BIG = GroupConfig(max_in_flight=MILLION, ack_timeout_ms=60_000)


def test_a_million_records_in_flight_across_polls_cost_a_handful_of_entries():
    started = time.perf_counter()
    d = Driver(config=BIG, logs={("t", 0): (0, MILLION)})
    a = d.join()
    polls = [d.poll(a, max_records=100_000) for _ in range(10)]
    stats = d.core.statistics()
    assert stats["records_in_flight"] == MILLION
    assert stats["leased_ranges"] == 10 and stats["lease_records"] == 10
    assert stats["range_entries"] <= 12 and stats["timers"] <= 12
    # One ack frame settles them all (one range per lease) and commits to the end.
    reply = d.settle("ack", a, [r for p in polls for r in ranges_of(p)])
    assert reply.applied == MILLION
    assert d.committed() == MILLION
    assert d.persisted()[-1].committed == MILLION and d.persisted()[-1].holes == []
    assert d.core.statistics()["range_entries"] == 0
    assert time.perf_counter() - started < 5  # ranges, not records: this is milliseconds


def test_one_lease_of_a_million_expires_redelivers_and_is_acked_in_one_range():
    d = Driver(config=BIG, logs={("t", 0): (0, MILLION)})
    a = d.join(session_timeout_ms=600_000)
    first = d.poll(a, max_records=MILLION)
    assert len(first.deliveries) == 1
    d.advance(60_000)  # expiry: one range moves to "ready"
    stats = d.core.statistics()
    assert stats["records_in_flight"] == 0 and stats["ready_ranges"] == 1
    again = d.poll(a, max_records=MILLION)
    assert [(s, e, att, r) for *_x, s, e, att, r in again.deliveries] == [(0, MILLION, 2, "timeout")]
    # Ack every other thousand first: holes are ranges too.
    lease = again.deliveries[0][2]
    d.settle("ack", a, [["t", 0, lease, s, s + 1000] for s in range(1000, MILLION, 2000)])
    assert d.core.statistics()["finished_ranges"] == 500
    assert d.committed() == 0
    assert d.settle("ack", a, [["t", 0, lease, 0, MILLION]]).applied == MILLION
    assert d.committed() == MILLION
    assert d.core.statistics()["range_entries"] == 0
