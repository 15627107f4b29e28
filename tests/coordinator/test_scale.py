"""A million records in flight cost a handful of range entries, not a million; timers and
delayed nacks cost work in proportion to what is due, not to everything held.

Work is counted (entries, compactions, pieces visited), never timed.
"""

from zbroker.actors.group_coordinator.core import GroupConfig
from zbroker.actors.group_coordinator.ranges import RangeMap
from zbroker.protocol import messages as m
from tests.coordinator import Driver, ranges_of

MILLION = 1_000_000
BIG = GroupConfig(max_in_flight=MILLION, ack_timeout_ms=60_000)


def test_a_million_records_in_flight_across_polls_cost_a_handful_of_entries():
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


def count_calls(monkeypatch, obj, name: str) -> dict:
    calls = {"n": 0}
    real = getattr(obj, name)

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)
    monkeypatch.setattr(obj, name, counting)
    return calls


def test_members_that_left_leave_no_session_timers_and_compaction_stays_rare(monkeypatch):
    d = Driver()
    compactions = count_calls(monkeypatch, d.core, "_compact_timers")
    for _ in range(3000):
        joined = d.join(session_timeout_ms=3_600_000)
        d.ok("leave", m.Leave(group="g", member_id=joined.member_id, generation=joined.generation))
    stats = d.core.statistics()
    assert stats["members"] == 0
    assert stats["timers"] <= 1_000, f"{stats['timers']} timers for no member"
    assert compactions["n"] <= 30, "the heap was compacted on (nearly) every push"


def test_many_members_alive_do_not_make_every_push_compact(monkeypatch):
    d = Driver()
    compactions = count_calls(monkeypatch, d.core, "_compact_timers")
    for i in range(5000):
        d.join(group=f"g{i}", session_timeout_ms=3_600_000)
    assert d.core.statistics()["members"] == 5000
    assert compactions["n"] <= 20


def test_releasing_delayed_nacks_visits_what_is_due_not_every_delayed_range(monkeypatch):
    n = 6000
    d = Driver()
    d.log_range("t", 0, 0, n)
    a = d.join(session_timeout_ms=3_600_000)
    compactions = count_calls(monkeypatch, d.core, "_compact_timers")
    nacked = 0
    while nacked < n:  # one record at a time, each with its own time to come back
        for t, p, lease, start, end, _attempt, _reason in d.poll(a, max_records=1000).deliveries:
            for offset in range(start, end):
                d.settle("nack", a, [[t, p, lease, offset, offset + 1]], delay_ms=60_000)
                d.now += 1
                nacked += 1
    assert compactions["n"] <= n // 100
    visited = {"n": 0}
    real_pieces, real_iter = RangeMap.pieces, RangeMap.__iter__

    def pieces(self, start, end):
        found = real_pieces(self, start, end)
        visited["n"] += len(found)
        return found

    def iterate(self):
        for entry in real_iter(self):
            visited["n"] += 1
            yield entry
    monkeypatch.setattr(RangeMap, "pieces", pieces)
    monkeypatch.setattr(RangeMap, "__iter__", iterate)
    d.now += 60_000 - n
    for _ in range(n):
        d.now += 1
        d.core.tick(d.now)
    monkeypatch.undo()
    released = visited["n"]
    assert d.partition()["ready"] == n, "every nacked record is deliverable again"
    assert released <= 20 * n, f"{released} range entries visited to release {n} nacks"
