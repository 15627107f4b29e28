"""Leases: polling, expiry, nack, extend, reject, dead letters, limits and waiting polls."""

import pytest

from zbroker.actors.group_coordinator.core import CLOCK_GRAIN_MS, DEAD_LETTER_RETRY_MS, MIN_SHARE, GroupConfig
from zbroker.actors.group_coordinator.effects import DeadLetter
from zbroker.protocol import messages as m
from zbroker.protocol.errors import StaleLease, TooLarge, Unauthorized, Unavailable
from tests.coordinator import PARKED, Driver, deliveries_of


def spans(reply):
    return [(s, e, attempt, reason) for _t, _p, _l, s, e, attempt, reason in reply.deliveries]


def test_poll_leases_new_records_up_to_the_known_log_end():
    d = Driver(config=GroupConfig(ack_timeout_ms=7_000))
    a = d.join()
    assert d.poll(a).deliveries == []  # log end not known yet
    d.log_range("t", 0, 0, 5)
    reply = d.poll(a)
    assert spans(reply) == [(0, 5, 1, "new")] and reply.ack_timeout_ms == 7_000
    assert d.poll(a).deliveries == []
    d.log_range("t", 0, 0, 8)
    assert spans(d.poll(a, max_records=2)) == [(5, 7, 1, "new")]


def test_expired_lease_is_redelivered_as_timeout_and_its_late_ack_is_stale():
    d = Driver(config=GroupConfig(ack_timeout_ms=1_000), logs={("t", 0): (0, 10)})
    a = d.join()
    lease = d.poll(a, max_records=10).deliveries[0][2]
    d.advance(999)
    assert d.poll(a).deliveries == []
    d.advance(1)  # the deadline itself: expired
    got = d.poll(a, max_records=4)
    assert spans(got) == [(0, 4, 2, "timeout")]
    err = d.settle("ack", a, [["t", 0, lease, 0, 10]])
    assert isinstance(err, StaleLease)
    assert err.data["stale"] == [["t", 0, lease, 0, 10]] and err.data["applied"] == 0
    assert d.committed() == 0  # never silently applied
    assert d.settle("ack", a, [["t", 0, got.deliveries[0][2], 0, 4]]).applied == 4
    assert d.committed() == 4


def test_a_lease_past_its_deadline_is_expired_even_if_the_shell_did_not_tick():
    d = Driver(config=GroupConfig(ack_timeout_ms=1_000), logs={("t", 0): (0, 3)})
    a = d.join()
    lease = d.poll(a).deliveries[0][2]
    d.now += 5_000  # no tick
    assert isinstance(d.settle("ack", a, [["t", 0, lease, 0, 3]]), StaleLease)


def test_redeliveries_come_first_in_offset_order():
    d = Driver(logs={("t", 0): (0, 20)})
    a = d.join()
    first = d.poll(a, max_records=10).deliveries[0][2]
    d.settle("nack", a, [["t", 0, first, 6, 8]])
    d.settle("nack", a, [["t", 0, first, 2, 4]], reason="bad")
    assert spans(d.poll(a, max_records=20)) == [(2, 4, 2, "nack:bad"), (6, 8, 2, "nack"), (10, 20, 1, "new")]


def test_nack_with_delay_and_a_waiting_poll_woken_by_it():
    d = Driver(logs={("t", 0): (0, 2)})
    a = d.join()
    lease = d.poll(a).deliveries[0][2]
    assert d.settle("nack", a, [["t", 0, lease, 0, 2]], delay_ms=500).applied == 2
    assert d.call("poll", m.Poll(group="g", member_id=a.member_id, generation=1, max_wait_ms=10_000),
                  token="w") is PARKED
    # The nack was read at `now`, in whole ms: it was sent before `now + 1`, so the
    # records come back no earlier than 500 ms after that (PROTOCOL.md s.14, Timers).
    assert d.core.next_deadline() == d.now + 500 + CLOCK_GRAIN_MS
    d.advance(500)
    assert "w" not in d.answers
    d.advance(CLOCK_GRAIN_MS)
    assert spans(d.answers["w"]) == [(0, 2, 2, "nack")]


def test_extend_pushes_the_deadline():
    d = Driver(config=GroupConfig(ack_timeout_ms=1_000), logs={("t", 0): (0, 4)})
    a = d.join()
    lease = d.poll(a).deliveries[0][2]
    d.advance(800)
    reply = d.settle("extend", a, [["t", 0, lease, 0, 2]], extend_ms=5_000)
    assert reply == m.ExtendReply(applied=2, deadline_in_ms=5_000)
    d.advance(500)  # 1300: [2, 4) expired, [0, 2) did not
    assert spans(d.poll(a)) == [(2, 4, 2, "timeout")]
    assert d.settle("ack", a, [["t", 0, lease, 0, 2]]).applied == 2
    assert d.settle("extend", a, [["t", 0, lease, 0, 2]]).data["stale"] == [["t", 0, lease, 0, 2]]


def test_max_deliveries_then_dead_letter_and_commit_after_confirmation():
    d = Driver(config=GroupConfig(ack_timeout_ms=100, max_deliveries=2), logs={("t", 0): (0, 2)})
    a = d.join()
    assert spans(d.poll(a)) == [(0, 2, 1, "new")]
    d.advance(100)
    assert spans(d.poll(a)) == [(0, 2, 2, "timeout")]
    mark = d.mark()
    d.advance(100)
    assert [(x.group, x.topic, x.partition, x.offset, x.dlq_topic, x.attempts, x.last_reason)
            for x in d.dead_letters(mark)] == [("g", "t", 0, o, "t.dlq", 2, "timeout") for o in (0, 1)]
    assert d.poll(a).deliveries == []
    assert d.partition()["blocker"]["state"] == "dead_lettering"
    assert d.committed() == 0
    d.feed(d.core.on_dead_letter_done(d.dead_letter(1), d.now))
    assert d.committed() == 0
    d.feed(d.core.on_dead_letter_done(d.dead_letter(0), d.now))
    assert d.committed() == 2
    assert d.partition()["dead_letters"] == 2


def test_nack_at_max_deliveries_dead_letters_with_the_nack_reason_and_configured_dlq():
    d = Driver(config=GroupConfig(max_deliveries=1, dlq="parking"), logs={("t", 0): (0, 1)})
    a = d.join()
    lease = d.poll(a).deliveries[0][2]
    mark = d.mark()
    d.settle("nack", a, [["t", 0, lease, 0, 1]], reason="boom")
    assert [(x.offset, x.dlq_topic, x.attempts, x.last_reason) for x in d.dead_letters(mark)] == \
        [(0, "parking", 1, "nack:boom")]


def test_reject_dead_letters_immediately():
    d = Driver(logs={("t", 0): (0, 5)})
    a = d.join()
    lease = d.poll(a).deliveries[0][2]
    mark = d.mark()
    assert d.settle("reject", a, [["t", 0, lease, 1, 3]], reason="poison") == m.RejectReply(applied=2)
    assert [(x.offset, x.attempts, x.last_reason) for x in d.dead_letters(mark)] == \
        [(1, 1, "reject:poison"), (2, 1, "reject:poison")]
    d.settle("ack", a, [["t", 0, lease, 0, 1], ["t", 0, lease, 3, 5]])
    d.feed(d.core.on_dead_letter_done(d.dead_letter(2), d.now))
    assert d.committed() == 1
    d.feed(d.core.on_dead_letter_done(d.dead_letter(1), d.now))
    assert d.committed() == 5


@pytest.mark.parametrize("error", [None, Unauthorized("no produce right")], ids=["no-answer", "not-retriable"])
def test_a_failed_dead_letter_is_retried(error):
    # A non-retriable error is retried too (an operator may fix it); the Log says it is not retriable.
    d = Driver(logs={("t", 0): (0, 1)})
    a = d.join()
    d.settle("reject", a, [["t", 0, d.poll(a).deliveries[0][2], 0, 1]])
    mark = d.mark()
    d.feed(d.core.on_dead_letter_failed(d.dead_letter(0), d.now, error))
    [log] = d.logs("dead_letter_failed", mark)
    assert (log.fields["error"], log.fields["retriable"]) == (("UNAUTHORIZED", False) if error else (None, True))
    d.advance(DEAD_LETTER_RETRY_MS - 1)
    assert d.dead_letters(mark) == []
    d.advance(1)
    assert [(x.offset, x.drop_value) for x in d.dead_letters(mark)] == [(0, False)]
    # A confirmation for something that is not being dead-lettered is ignored.
    d.feed(d.core.on_dead_letter_done(DeadLetter("g", "t", 0, 7, "t.dlq", 1, "reject", 1), d.now))
    assert d.logs("dead_letter_confirmation_ignored")


def test_a_copy_refused_too_large_is_made_again_at_once_without_its_value():
    # Found by a reviewer: a record near max_batch_bytes plus the zb-dlq-* headers was
    # refused TOO_LARGE, retried every second for ever, and the commit never passed it.
    d = Driver(logs={("t", 0): (0, 2)})
    a = d.join()
    lease = d.poll(a, max_records=2).deliveries[0][2]
    d.settle("reject", a, [["t", 0, lease, 0, 1]])
    full = d.dead_letter(0)
    assert not full.drop_value
    mark = d.mark()
    d.feed(d.core.on_dead_letter_failed(full, d.now, TooLarge("batch exceeds max_batch_bytes", limit=10)))
    [stripped] = d.dead_letters(mark)  # at once, no retry delay
    assert stripped.drop_value and stripped.dead_lettering_id == full.dead_lettering_id
    assert d.logs("dead_letter_value_dropped", mark) and d.core.statistics()["dead_letters_value_dropped"] == 1
    # A retriable failure of the copy without value is retried, still without the value.
    d.feed(d.core.on_dead_letter_failed(stripped, d.now, Unavailable("restarting")))
    mark = d.mark()
    d.advance(DEAD_LETTER_RETRY_MS)
    [retry] = d.dead_letters(mark)
    assert retry.drop_value
    d.feed(d.core.on_dead_letter_done(retry, d.now))
    assert d.partition()["dead_letters"] == 1 and d.partition()["dead_lettering"] == 0
    d.settle("ack", a, [["t", 0, lease, 1, 2]])
    assert d.committed() == 2


def test_a_retry_from_before_a_reset_does_not_copy_a_later_dead_letter_twice():
    # Found by the model test: reject, copy fails (retry scheduled), reset, the record is
    # rejected again; the old retry must not emit a second DeadLetter for the new episode.
    d = Driver(logs={("t", 0): (0, 1)})
    a = d.join()
    d.settle("reject", a, [["t", 0, d.poll(a).deliveries[0][2], 0, 1]])
    d.feed(d.core.on_dead_letter_failed(d.dead_letter(0), d.now))
    d.ok("reset_group", m.ResetGroup(group="g", topic="t", to="earliest"))
    mark = d.mark()
    d.settle("reject", a, [["t", 0, d.poll(a).deliveries[0][2], 0, 1]])
    d.advance(DEAD_LETTER_RETRY_MS * 3)
    assert [x.offset for x in d.dead_letters(mark)] == [0]


def test_an_outcome_of_a_copy_from_before_a_reset_does_not_decide_the_record_rejected_again():
    # Found by a reviewer: copy #1 (rejected before the reset) reported its failure while
    # copy #2 (rejected again after it) was still on its way; the failure was taken as
    # copy #2's and a third copy was made, so the dead-letter topic held the record twice.
    d = Driver(logs={("t", 0): (0, 10)})
    a = d.join()
    d.settle("reject", a, [["t", 0, d.poll(a, max_records=10).deliveries[0][2], 5, 6]])
    first_copy = d.dead_letter(5)
    d.ok("reset_group", m.ResetGroup(group="g", topic="t", to="earliest"))
    d.settle("reject", a, [["t", 0, d.poll(a, max_records=10).deliveries[0][2], 5, 6]])
    second_copy = d.dead_letter(5)
    assert second_copy.dead_lettering_id != first_copy.dead_lettering_id
    mark = d.mark()
    d.feed(d.core.on_dead_letter_failed(first_copy, d.now))
    d.advance(DEAD_LETTER_RETRY_MS * 2)
    assert d.dead_letters(mark) == [] and d.logs("dead_letter_confirmation_ignored", mark)
    d.feed(d.core.on_dead_letter_done(first_copy, d.now))  # nor does its success finish the second
    assert d.partition()["dead_letters"] == 0
    d.feed(d.core.on_dead_letter_done(second_copy, d.now))
    assert d.partition()["dead_letters"] == 1


def test_in_flight_limit_per_member():
    d = Driver({"t": 2}, config=GroupConfig(max_in_flight=5), logs={("t", 0): (0, 10), ("t", 1): (0, 10)})
    a = d.join()
    got = d.poll(a, max_records=100)
    assert sum(e - s for s, e, _a, _r in spans(got)) == 5
    assert d.poll(a).deliveries == []
    d.settle("ack", a, [got.deliveries[0][:5]])
    freed = got.deliveries[0][4] - got.deliveries[0][3]
    assert sum(e - s for s, e, _a, _r in spans(d.poll(a))) == freed


def test_in_flight_limit_per_partition_in_shared_mode_and_a_poll_woken_by_freed_capacity():
    d = Driver(config=GroupConfig(mode="shared", max_in_flight=4), logs={("t", 0): (0, 100)})
    a = d.join()
    b = d.join()
    a = d.resync(a)
    got = d.poll(a, max_records=3)
    assert spans(got) == [(0, 3, 1, "new")]
    assert spans(d.poll(b, max_records=3)) == [(3, 4, 1, "new")]  # the partition holds 4 at most
    assert d.call("poll", m.Poll(group="g", member_id=b.member_id, generation=b.generation, max_wait_ms=1_000),
                  token="w") is PARKED
    d.settle("ack", a, [got.deliveries[0][:5]])
    assert spans(d.answers["w"]) == [(4, 7, 1, "new")]


def test_fairness_spreads_a_poll_over_partitions_round_robin():
    d = Driver({"t": 3}, logs={("t", p): (0, 100) for p in range(3)})
    a = d.join()
    got = d.poll(a, max_records=3 * MIN_SHARE)
    assert sorted((p, e - s) for _t, p, _l, s, e, _a, _r in got.deliveries) == [(p, MIN_SHARE) for p in range(3)]
    first = [p for _t, p, *_ in d.poll(a, max_records=2).deliveries]
    second = [p for _t, p, *_ in d.poll(a, max_records=2).deliveries]
    assert first != second  # the starting partition rotates
    # When the others run dry the rest comes from the partition that has more.
    d2 = Driver({"t": 2}, logs={("t", 0): (0, 100), ("t", 1): (0, 3)})
    b = d2.join()
    assert sorted((p, e - s) for _t, p, _l, s, e, _a, _r in d2.poll(b, max_records=MIN_SHARE + 8).deliveries) == \
        [(0, MIN_SHARE + 5), (1, 3)]


def test_a_poll_over_many_partitions_takes_shares_of_at_least_min_share_and_the_next_poll_goes_on():
    """Spread like water down to one record each, a poll of 1,000 over 1,024 partitions was
    1,000 one-record leases. In shares of MIN_SHARE a poll serves fewer partitions, and the
    next poll starts after the last one served, so every partition is served in turn."""
    partitions = 64
    d = Driver({"t": partitions}, logs={("t", p): (0, 100) for p in range(partitions)},
               config=GroupConfig(max_in_flight=100_000))
    a = d.join()
    served: list[int] = []
    for _ in range(8):
        got = d.poll(a, max_records=4 * MIN_SHARE)
        shares = [(p, e - s) for _t, p, _l, s, e, _a, _r in got.deliveries]
        assert [n for _p, n in shares] == [MIN_SHARE] * 4
        served += [p for p, _n in shares]
    assert sorted(served[:partitions // 2]) == sorted(set(served[:partitions // 2]))  # none twice in a row
    assert served == sorted(served) and served[0] == 0 and served[-1] == 31  # in turn, from the first
    rest = d.poll(a, max_records=10_000)
    assert {p for _t, p, *_ in rest.deliveries} == set(range(partitions))  # nobody starved
    assert sum(e - s for _t, _p, _l, s, e, _a, _r in rest.deliveries) == partitions * 100 - 32 * MIN_SHARE


def test_waiting_poll_answered_by_new_records_or_by_its_deadline():
    d = Driver(logs={("t", 0): (0, 0)})
    a = d.join()
    poll = m.Poll(group="g", member_id=a.member_id, generation=1, max_wait_ms=1_000)
    assert d.call("poll", poll, token="p1") is PARKED
    d.log_range("t", 0, 0, 3)
    assert spans(d.answers["p1"]) == [(0, 3, 1, "new")]
    assert d.call("poll", poll, token="p2") is PARKED
    assert d.core.next_deadline() == d.now + 1_000
    d.advance(1_000)
    assert d.answers["p2"] == m.PollReply(generation=1, deliveries=[], ack_timeout_ms=30_000)
    assert d.call("poll", poll, token="p3") is PARKED
    d.core.cancel_parked("p3")
    d.log_range("t", 0, 0, 5)
    d.advance(5_000)
    assert "p3" not in d.answers and d.core.statistics()["parked_polls"] == 0


def test_a_member_with_a_waiting_poll_is_not_expired():
    d = Driver()
    a = d.join(session_timeout_ms=1_000)
    assert d.call("poll", m.Poll(group="g", member_id=a.member_id, generation=1, max_wait_ms=60_000),
                  token="w") is PARKED
    d.advance(30_000)
    assert len(d.describe()["members"]) == 1
    d.advance(30_000)
    assert d.answers["w"].deliveries == []
    d.advance(1_000)
    assert d.describe()["members"] == []


def test_stale_lease_ids_of_all_kinds():
    d = Driver({"t": 2}, logs={("t", 0): (0, 10), ("t", 1): (0, 10)})
    a = d.join()
    b = d.join(topics=["t"])
    a = d.resync(a)
    la = d.poll(a).deliveries[0]
    lb = d.poll(b).deliveries[0]
    tests = [
        ["t", la[1], 999_999, 0, 1],        # unknown lease id
        ["t", 1 - la[1], la[2], 0, 1],      # right id, wrong partition
        ["t", lb[1], lb[2], lb[3], lb[4]],  # someone else's lease
        ["u", 0, la[2], 0, 1],              # unknown topic
    ]
    err = d.settle("ack", a, tests)
    assert isinstance(err, StaleLease) and err.data["stale"] == tests and err.data["applied"] == 0
    assert d.settle("ack", b, [list(lb[:5])]).applied == 10


def test_statistics_report_range_entries_not_records():
    d = Driver(logs={("t", 0): (0, 10)})
    a = d.join()
    d.poll(a)
    stats = d.core.statistics()
    assert stats["records_in_flight"] == 10 and stats["leased_ranges"] == 1 and stats["lease_records"] == 1
    assert deliveries_of(d.poll(a)) == []


def test_a_member_parks_a_bounded_number_of_polls_and_the_oldest_gives_way():
    from zbroker.actors.group_coordinator.core import MAX_PARKED_PER_MEMBER
    d = Driver(logs={("t", 0): (0, 0)})
    a = d.join()
    for _ in range(MAX_PARKED_PER_MEMBER + 5):
        d.poll(a, max_wait_ms=60_000)
    assert d.core.statistics()["parked_polls"] == MAX_PARKED_PER_MEMBER
    # the five oldest were answered, empty, as newer ones arrived
    empties = [msg for msg in d.answers.values() if isinstance(msg, m.PollReply) and not msg.deliveries]
    assert len(empties) == 5


def test_extending_one_lease_many_times_keeps_the_timer_heap_bounded():
    d = Driver(logs={("t", 0): (0, 10)})
    a = d.join()
    [delivery] = d.poll(a).deliveries
    for i in range(5_000):
        d.now += 1
        d.settle("extend", a, [delivery[:5]], extend_ms=3_600_000)
    assert d.core.statistics()["timers"] < 1_500
    # Compaction kept the live (one hour) deadline: with only heartbeats from here on,
    # the lease outlives the 30 s ack timeout its first deadline had.
    for _ in range(8):
        d.advance(5_000)
        d.call("heartbeat", m.Heartbeat(group="g", member_id=a.member_id, generation=a.generation))
    assert d.partition()["in_flight"] == 10


def test_compacting_the_timers_keeps_what_forgets_a_lease_acked_early():
    # Answered long polls leave timer entries behind, which makes the heap compact
    # often. The lease's own deadline entry is what drops the lease record once all
    # of it is acked: compaction dropped it, and every early-acked lease stayed for ever.
    from tests.coordinator import ranges_of
    d = Driver(logs={("t", 0): (0, 0)}, config=GroupConfig(ack_timeout_ms=5_000))
    a = d.join()
    for i in range(3000):
        token = next(d.tokens)
        assert d.call("poll", m.Poll(group="g", member_id=a.member_id, generation=a.generation,
                                     max_wait_ms=30_000), token) is PARKED
        d.log_range("t", 0, 0, i + 1)
        d.settle("ack", a, ranges_of(d.answers[token]))
        d.advance(10)
    d.advance(31_000)
    stats = d.core.statistics()
    assert stats["lease_records"] == 0
    assert d.committed() == 3000


def test_an_ack_repeated_under_a_lease_that_a_reset_revoked_is_stale():
    """PROTOCOL.md reset_group: the leases are revoked and their acks become stale, also a
    client's resend of an ack applied before the reset (those records are unfinished again)."""
    d = Driver()
    d.log_range("t", 0, 0, 10)
    a = d.join()
    lease = d.poll(a, max_records=10).deliveries[0][2]
    assert d.settle("ack", a, [["t", 0, lease, 0, 5]]).applied == 5
    d.ok("reset_group", m.ResetGroup(group="g", topic="t", to="earliest"))
    assert d.committed() == 0
    assert isinstance(d.settle("ack", a, [["t", 0, lease, 0, 5]]), StaleLease)
    assert d.committed() == 0


def test_redeliveries_and_dead_letters_are_counted_by_reason():
    """What the console's zbroker_redelivered_total / zbroker_dead_lettered_total read."""
    d = Driver(config=GroupConfig(ack_timeout_ms=100, max_deliveries=2), logs={("t", 0): (0, 6)})
    a = d.join()
    lease = d.poll(a, max_records=6).deliveries[0][2]
    d.settle("nack", a, [["t", 0, lease, 0, 2]], reason="later: client text is not a label")
    d.settle("reject", a, [["t", 0, lease, 2, 3]], reason="poison")
    d.settle("ack", a, [["t", 0, lease, 3, 4]])
    d.advance(100)  # 4 and 5 expire
    again = d.poll(a, max_records=6)
    assert sorted((s, e, r) for s, e, _n, r in spans(again)) == [(0, 2, "nack:later: client text is not a label"),
                                                                  (4, 6, "timeout")]
    part = d.partition()
    assert part["redeliveries_by_reason"] == {"nack": 2, "timeout": 2}
    assert part["redeliveries"] == 4
    d.advance(100)  # the second deliveries expire too: max_deliveries reached
    for offset in (0, 1, 2, 4, 5):
        d.feed(d.core.on_dead_letter_done(d.dead_letter(offset), d.now))
    part = d.partition()
    assert part["dead_letters_by_reason"] == {"rejected": 1, "max_deliveries": 4}
    assert part["dead_letters"] == 5 and d.committed() == 6
