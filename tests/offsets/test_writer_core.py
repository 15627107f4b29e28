"""Commit writer core: coalescing, flush timing, durability replies, failure handling.

No sockets, no database, no clock: the tests drive time and the store by hand.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zbroker.actors.commit_writer.core import (
    CommitWriterCore, Flush, Load, Probe, Reply, ReplyError, Status, WriterConfig,
)
from zbroker.protocol.errors import ErrorCode
from zbroker.storage.offsets import OffsetRow, winner


def adv(partition=0, committed=0, holes=None, generation=1, epoch=0, group="g", topic="t") -> list:
    return [group, topic, partition, committed, holes or [], generation, epoch]


def of(effects, kind):
    return [e for e in effects if isinstance(e, kind)]


def one(effects, kind):
    found = of(effects, kind)
    assert len(found) == 1, effects
    return found[0]


def ready(core: CommitWriterCore, now: float = 0.0) -> None:
    """Bring a fresh core past its first probe, so that the store counts as healthy."""
    probe = one(core.on_tick(now), Probe)
    core.on_flush_done(probe.flush_id, now)


@pytest.fixture
def core() -> CommitWriterCore:
    c = CommitWriterCore(WriterConfig(flush_interval_ms=10, batch_size=1000))
    ready(c)
    return c


# -- coalescing ------------------------------------------------------------------------

def test_coalescing_keeps_the_newest_value_per_key(core):
    assert not of(core.on_advance("r1", [adv(0, 5), adv(0, 7, [[9, 10]]), adv(1, 3)], 1), Flush)
    assert not of(core.on_advance("r2", [adv(0, 6), adv(1, 4, generation=2)], 2), Flush)
    flush = one(core.on_tick(11), Flush)
    assert sorted(flush.rows, key=lambda r: r.key) == [
        OffsetRow("g", "t", 0, 7, [(9, 10)], 1, 0),
        OffsetRow("g", "t", 1, 4, [], 2, 0),
    ]
    stats = core.statistics(11)
    assert stats["advances_received"] == 5
    assert stats["advances_coalesced"] == 3
    assert stats["advances_stale"] == 1  # (0, 6) arrived after (0, 7)


def test_a_reset_epoch_wins_over_a_higher_offset_and_fences_late_advances(core):
    core.on_advance("r1", [adv(0, 100), adv(0, 4, epoch=1), adv(0, 150, epoch=0)], 0)
    flush = one(core.on_tick(10), Flush)
    assert [(r.committed_offset, r.reset_epoch) for r in flush.rows] == [(4, 1)]


def test_equal_offset_replaces_holes(core):
    core.on_advance("r1", [adv(0, 5, [[6, 7]]), adv(0, 5, [[6, 9]])], 0)
    assert one(core.on_tick(10), Flush).rows[0].holes == [(6, 9)]


# -- when to flush -----------------------------------------------------------------------

def test_flush_waits_for_the_interval(core):
    assert not of(core.on_advance("r1", [adv(0, 1)], 100), Flush)
    assert core.next_deadline() == 110
    assert not of(core.on_tick(109.9), Flush)
    assert of(core.on_tick(110), Flush)


def test_flush_starts_at_once_when_the_batch_is_full():
    core = CommitWriterCore(WriterConfig(flush_interval_ms=10_000, batch_size=3))
    ready(core)
    assert not of(core.on_advance("r1", [adv(0, 1), adv(1, 1)], 1), Flush)
    assert not of(core.on_advance("r2", [adv(0, 2), adv(1, 2)], 2), Flush)  # still two keys
    flush = one(core.on_advance("r3", [adv(2, 1)], 3), Flush)
    assert len(flush.rows) == 3


def test_one_flush_at_a_time_and_the_next_takes_what_came_meanwhile(core):
    core.on_advance("r1", [adv(0, 1)], 0)
    first = one(core.on_tick(10), Flush)
    core.on_advance("r2", [adv(0, 2), adv(1, 1)], 11)
    assert not of(core.on_tick(50), Flush)  # first still in flight
    effects = core.on_flush_done(first.flush_id, 51)
    second = one(effects, Flush)  # overdue, so it starts right away
    assert sorted((r.partition, r.committed_offset) for r in second.rows) == [(0, 2), (1, 1)]


def test_a_big_backlog_drains_in_batches_oldest_first():
    core = CommitWriterCore(WriterConfig(flush_interval_ms=10, batch_size=2))
    ready(core)
    core.on_advance("old", [adv(0, 1)], 0)
    flush = of(core.on_advance("new", [adv(p, 1) for p in range(1, 5)], 1), Flush)  # full batch
    seen = []
    replies = []
    while flush:
        batch = flush[0]
        assert len(batch.rows) <= 2
        seen += [r.partition for r in batch.rows]
        effects = core.on_flush_done(batch.flush_id, 20)
        replies += [e.token for e in of(effects, Reply)]
        flush = of(effects, Flush)
    assert seen == [0, 1, 2, 3, 4]
    assert replies == ["old", "new"]


# -- durability replies -------------------------------------------------------------------

def test_reply_only_after_the_values_are_durable(core):
    assert not of(core.on_advance("r1", [adv(0, 5), adv(1, 6)], 0), Reply)
    flush = one(core.on_tick(10), Flush)
    assert not of(core.on_tick(12), Reply)
    reply = one(core.on_flush_done(flush.flush_id, 13), Reply)
    assert reply.token == "r1"
    assert sorted(reply.durable) == [["g", "t", 0, 5, 0], ["g", "t", 1, 6, 0]]


def test_a_request_that_arrives_during_a_flush_waits_for_the_next(core):
    core.on_advance("r1", [adv(0, 5)], 0)
    first = one(core.on_tick(10), Flush)
    core.on_advance("r2", [adv(0, 6)], 11)
    effects = core.on_flush_done(first.flush_id, 12)
    assert [r.token for r in of(effects, Reply)] == ["r1"]
    second = one(core.on_tick(21), Flush)
    reply = one(core.on_flush_done(second.flush_id, 22), Reply)
    assert reply.token == "r2" and reply.durable == [["g", "t", 0, 6, 0]]


def test_a_request_spanning_batches_waits_for_all_of_them():
    core = CommitWriterCore(WriterConfig(flush_interval_ms=10, batch_size=2))
    ready(core)
    first = one(core.on_advance("big", [adv(p, 1) for p in range(5)], 0), Flush)
    second = one(core.on_flush_done(first.flush_id, 1), Flush)
    assert not of(core.on_flush_done(second.flush_id, 2), Reply)
    third = one(core.on_tick(20), Flush)
    reply = one(core.on_flush_done(third.flush_id, 21), Reply)
    assert sorted(d[2] for d in reply.durable) == [0, 1, 2, 3, 4]


def test_a_superseded_request_is_answered_with_the_newer_durable_value(core):
    core.on_advance("r1", [adv(0, 5)], 0)
    core.on_advance("r2", [adv(0, 9)], 1)
    effects = core.on_flush_done(one(core.on_tick(10), Flush).flush_id, 11)
    assert {r.token: r.durable for r in of(effects, Reply)} == {
        "r1": [["g", "t", 0, 9, 0]], "r2": [["g", "t", 0, 9, 0]]}


def test_a_resent_stale_advance_is_answered_without_a_write(core):
    core.on_advance("r1", [adv(0, 9)], 0)
    core.on_flush_done(one(core.on_tick(10), Flush).flush_id, 11)
    effects = core.on_advance("again", [adv(0, 5)], 20)  # the coordinator restarted and resends
    assert one(effects, Reply).durable == [["g", "t", 0, 9, 0]]
    assert not of(core.on_tick(100), Flush)
    # An equal value may carry other holes, so it is written again: harmless, by the guard.
    assert not of(core.on_advance("same", [adv(0, 9)], 200), Reply)
    flush = one(core.on_tick(210), Flush)
    assert one(core.on_flush_done(flush.flush_id, 211), Reply).durable == [["g", "t", 0, 9, 0]]


def test_an_empty_advance_is_answered_at_once(core):
    assert one(core.on_advance("r", [], 0), Reply).durable == []


# -- failures -----------------------------------------------------------------------------

def test_failure_keeps_newest_per_key_bounded_by_keys_and_replies_after_recovery(core):
    core.on_advance("r0", [adv(p, 1) for p in range(10)], 0)
    flush = one(core.on_tick(10), Flush)
    assert core.healthy(10)
    core.on_flush_failed(flush.flush_id, 11, "connection refused")
    assert not core.healthy(11)
    now = 11.0
    for i in range(2, 1002):  # a thousand commits per key while the database is down
        now += 1
        effects = core.on_advance(f"r{i}", [adv(p, i, [[i + 1, i + 2]]) for p in range(10)], now)
        for e in of(effects + core.on_tick(now), Flush):
            core.on_flush_failed(e.flush_id, now, "connection refused")
    stats = core.statistics(now)
    assert stats["pending_keys"] == 10  # keys, not commits
    assert stats["flush_errors"] > 1
    assert not core.healthy(now)
    assert not of(core.on_tick(now), Reply)  # nothing reported durable
    now += 5000
    flush = one(core.on_tick(now), Flush)
    assert {(r.partition, r.committed_offset) for r in flush.rows} == {(p, 1001) for p in range(10)}
    assert all(r.holes == [(1002, 1003)] for r in flush.rows)
    effects = core.on_flush_done(flush.flush_id, now + 1)
    replies = of(effects, Reply)
    assert len(replies) == 1001 and all(len(r.durable) == 10 for r in replies)
    assert core.healthy(now + 1)


def test_backoff_doubles_and_is_capped():
    core = CommitWriterCore(WriterConfig(backoff_initial_ms=50, backoff_max_ms=400))
    ready(core)
    core.on_advance("r", [adv(0, 1)], 0)
    now = 10.0
    flush = one(core.on_tick(now), Flush)
    for wait in [50, 100, 200, 400, 400, 400, 400]:
        core.on_flush_failed(flush.flush_id, now, "down")
        assert core.next_deadline() <= now + wait
        assert not of(core.on_tick(now + wait - 0.001), Flush)  # no retry before the backoff
        now += wait
        flush = one(core.on_tick(now), Flush)
    core.on_flush_done(flush.flush_id, now)
    core.on_advance("r2", [adv(0, 2)], now)
    core.on_flush_failed(one(core.on_tick(now + 10), Flush).flush_id, now + 10, "down")
    assert core.next_deadline() == now + 10 + 50  # a success resets the backoff


def test_a_failed_flush_merges_back_under_newer_values(core):
    core.on_advance("r1", [adv(0, 5), adv(1, 5)], 0)
    flush = one(core.on_tick(10), Flush)
    core.on_advance("r2", [adv(0, 7)], 11)  # newer than the in-flight value
    core.on_advance("r3", [adv(1, 4)], 11)  # older than the in-flight value
    core.on_flush_failed(flush.flush_id, 12, "timeout")
    retry = one(core.on_tick(12 + core.backoff_ms()), Flush)
    assert sorted((r.partition, r.committed_offset) for r in retry.rows) == [(0, 7), (1, 5)]


def test_slow_store_is_unhealthy_while_the_flush_hangs(core):
    core.on_advance("r1", [adv(0, 5)], 0)
    one(core.on_tick(10), Flush)
    assert core.healthy(500)
    assert not core.healthy(1011)  # unhealthy_after_ms=1000 of flush in flight


def test_health_follows_the_age_of_the_oldest_waiting_value():
    """A backlog that never empties but keeps moving is healthy; one that stalls is not."""
    core = CommitWriterCore(WriterConfig(flush_interval_ms=10, batch_size=2))
    ready(core)
    flights = of(core.on_advance("r0", [adv(p, 1) for p in range(3)], 0), Flush)
    key = 3
    for now in range(5, 3000, 5):
        effects = core.on_advance(f"r{now}", [adv(key, 1), adv(key + 1, 1)], now)
        key += 2
        flights += of(effects, Flush)
        if flights:
            flights += of(core.on_flush_done(flights.pop(0).flush_id, now), Flush)
        assert core.statistics(now)["pending_keys"] > 0  # never drained
    assert core.healthy(3000)
    assert not core.healthy(3000 + 1001)  # nothing moved for a second


def test_idle_probe_reports_an_outage(core):
    probe = one(core.on_tick(1000), Probe)  # a second without a round trip
    assert core.healthy(1000)
    core.on_flush_failed(probe.flush_id, 1001, "connection refused")
    assert not core.healthy(1001)
    effects = core.on_tick(2000)
    status = one(effects, Status)
    assert status.healthy is False and status.metrics["consecutive_failures"] == 1
    probe = one(effects, Probe)  # the retry, after the backoff
    core.on_flush_done(probe.flush_id, 2001)
    assert core.healthy(2001)


def test_a_fresh_core_is_unhealthy_until_the_store_answers():
    core = CommitWriterCore()
    effects = core.on_tick(0)
    assert one(effects, Status).healthy is False
    core.on_flush_done(one(effects, Probe).flush_id, 1)
    assert core.healthy(1)


def test_status_every_interval_with_metrics(core):
    first = one(core.on_tick(1000), Status)  # the fixture's first tick sent one at 0
    assert not of(core.on_tick(1999), Status)
    second = one(core.on_tick(2000), Status)
    for key in ("advances_received", "advances_coalesced", "rows_flushed", "flush_latency_ms_p99",
                "pending_keys", "flush_errors", "ms_since_last_good_flush"):
        assert key in first.metrics and key in second.metrics


def test_flush_latency_and_time_since_last_good_flush(core):
    core.on_advance("r1", [adv(0, 5)], 0)
    core.on_flush_done(one(core.on_tick(10), Flush).flush_id, 17.5)
    stats = core.statistics(100)
    assert stats["flush_latency_ms_last"] == 7.5
    assert stats["flush_latency_ms_p50"] == 7.5
    assert stats["ms_since_last_good_flush"] == 82.5
    assert stats["flushes"] == 1 and stats["rows_flushed"] == 1


# -- waiting requests are bounded too ------------------------------------------------------

def test_too_many_waiting_requests_sheds_the_oldest_as_unavailable():
    core = CommitWriterCore(WriterConfig(max_waiting_requests=3))
    ready(core)
    flush = one(core.on_advance("r0", [adv(0, 0)], 0) + core.on_tick(10), Flush)
    core.on_flush_failed(flush.flush_id, 10, "down")
    errors = []
    for i in range(1, 6):
        errors += of(core.on_advance(f"r{i}", [adv(0, i)], 11), ReplyError)
    assert [e.token for e in errors] == ["r0", "r1", "r2"]
    assert all(e.error.code == ErrorCode.UNAVAILABLE and e.error.data["retained"] for e in errors)
    retry = one(core.on_tick(1000), Flush)
    assert retry.rows[0].committed_offset == 5  # shed requests' values were kept
    assert [r.token for r in of(core.on_flush_done(retry.flush_id, 1001), Reply)] == ["r3", "r4", "r5"]


def test_an_outage_bounds_waiting_requests_by_the_keys_they_name_not_only_by_their_number():
    """While the store is down the coordinator goes on sending: every 50 ms what moved, and
    every 3 s all it has unconfirmed. `pending` stays one value per key, but every waiting
    request keeps its key list for the reply, so with only the request cap the memory grew
    with the advances: 10,000 requests of 1,000 partitions each held ten million keys."""
    core = CommitWriterCore(WriterConfig(max_waiting_keys=5_000))
    ready(core)
    flush = one(core.on_advance("r0", [adv(p, 0) for p in range(500)], 0) + core.on_tick(10), Flush)
    core.on_flush_failed(flush.flush_id, 10, "down")
    shed = []
    for i in range(1, 40):  # the same 500 partitions, again and again
        shed += of(core.on_advance(f"r{i}", [adv(p, i) for p in range(500)], 10 + i), ReplyError)
        stats = core.statistics(10 + i)
        assert stats["pending_keys"] == 500
        assert stats["waiting_keys"] <= 5_000, stats["waiting_requests"]
    assert [e.token for e in shed] == [f"r{i}" for i in range(30)]
    assert all(e.error.code == ErrorCode.UNAVAILABLE and e.error.data["retained"] for e in shed)
    retry = one(core.on_tick(1000), Flush)
    assert {r.committed_offset for r in retry.rows} == {39}  # shed requests' values were kept
    assert [r.token for r in of(core.on_flush_done(retry.flush_id, 1001), Reply)] == [
        f"r{i}" for i in range(30, 40)]
    assert core.statistics(1001)["waiting_keys"] == 0


# -- validation -------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [
    adv(-1, 0), adv(0, -5), adv(0, 1 << 63), adv(1 << 31, 0), adv(0, 0, epoch=-1),
    adv(0, 0, generation=1 << 64),
    adv(0, 5, [[3, 4]]),             # hole below committed
    adv(0, 5, [[7, 7]]),             # empty hole
    adv(0, 5, [[8, 9], [6, 7]]),     # unsorted
    adv(0, 5, [[6, 9], [8, 10]]),    # overlapping
    adv(0, 5, [[6]]), adv(0, 5, [[6, "7"]]), adv(0, 5, [[6, True]]), adv(0, 5, [7]),
    adv(group=""), adv(topic="x" * 256), adv(group="a\x00b"),
    adv() + [[[0, 1, "r"]]], adv() + [[[1 << 32, 1, "r"]]], adv() + [[[5, -1, "r"]]],  # parked keys:
    adv() + [[[5, 1, 7]]], adv() + [[[5, 1]]], adv() + [[[5, 1, "r"]] * 1001],        # hash, count, reason
])
def test_values_the_store_would_refuse_are_a_bad_request(core, bad):
    effects = core.on_advance("r", [adv(1, 1), bad], 0)
    error = one(effects, ReplyError).error
    assert error.code == ErrorCode.BAD_REQUEST and error.data["index"] == 1
    assert core.statistics(0)["pending_keys"] == 0  # all or nothing


def test_values_at_the_limits_are_accepted(core):
    big = (1 << 63) - 1
    effects = core.on_advance("r", [adv((1 << 31) - 1, big - 2, [[big - 1, big]], generation=-big, epoch=big),
                                    adv(0, 0, group="g" * 255, topic="ü" * 255)], 0)
    assert not of(effects, ReplyError)


def test_an_advance_carries_its_parked_keys_to_the_store(core):
    parked = [[17, 2, "nack:boom"]]
    assert not of(core.on_advance("r", [adv(0, 3) + [parked], adv(1, 4)], 0), ReplyError)
    flush = one(core.on_tick(100), Flush)
    assert {r.partition: r.quarantine for r in flush.rows} == {0: parked, 1: []}


# -- load_offsets and shutdown ---------------------------------------------------------------

def test_load_offsets_waits_for_what_is_pending_then_reads(core):
    assert one(core.on_load_offsets("l0", 0), Load).token == "l0"  # nothing pending
    core.on_advance("r1", [adv(0, 5)], 1)
    assert not core.on_load_offsets("l1", 2)
    effects = core.on_flush_done(one(core.on_tick(11), Flush).flush_id, 12)
    assert one(effects, Load).token == "l1"


def test_load_offsets_fails_fast_while_the_store_is_down(core):
    core.on_advance("r1", [adv(0, 5)], 1)
    core.on_load_offsets("l1", 2)
    effects = core.on_flush_failed(one(core.on_tick(11), Flush).flush_id, 12, "down")
    assert one(effects, ReplyError).token == "l1"
    error = one(core.on_load_offsets("l2", 13), ReplyError).error
    assert error.code == ErrorCode.UNAVAILABLE and error.retriable


def test_shutdown_flushes_at_once_then_answers_the_rest():
    core = CommitWriterCore(WriterConfig(flush_interval_ms=60_000))
    ready(core)
    core.on_advance("r1", [adv(0, 5)], 1)
    flush = one(core.begin_shutdown(2), Flush)  # no waiting for the interval
    assert one(core.on_advance("late", [adv(0, 6)], 3), ReplyError).error.code == ErrorCode.SHUTTING_DOWN
    assert not core.drained
    assert one(core.on_flush_done(flush.flush_id, 4), Reply).token == "r1"
    assert core.drained
    assert not of(core.on_tick(5), Probe)


def test_abort_answers_every_waiting_request():
    core = CommitWriterCore()
    ready(core)
    core.on_advance("r1", [adv(0, 5)], 1)
    core.on_load_offsets("l1", 1)
    errors = core.abort(2)
    assert [e.token for e in errors] == ["r1", "l1"]
    assert all(e.error.code == ErrorCode.SHUTTING_DOWN for e in errors)


# -- the whole contract, under random schedules ---------------------------------------------

def covers(row: OffsetRow, committed: int, epoch: int) -> bool:
    return row.reset_epoch > epoch or (row.reset_epoch == epoch and row.committed_offset >= committed)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_random_schedules_never_report_early_never_go_back_and_end_newest(data):
    """A simulated store applies each flush through the monotonic guard (or fails it)."""
    batch_size = data.draw(st.integers(1, 6), label="batch_size")
    core = CommitWriterCore(WriterConfig(flush_interval_ms=10, batch_size=batch_size, backoff_max_ms=100))
    store: dict = {}
    newest: dict = {}
    requests: dict = {}
    inflight: list[Flush] = []
    now = 0.0
    rng = random.Random(data.draw(st.integers(0, 2**32), label="seed"))

    def handle(effects):
        for e in effects:
            if isinstance(e, (Flush, Probe)):
                inflight.append(e)
            elif isinstance(e, Reply):
                sent = requests.pop(e.token)
                for g, t, p, committed, epoch in e.durable:  # reported durable: it is
                    assert covers(store[(g, t, p)], committed, epoch)
                for a in sent:  # every value asked for is durable, or something newer is
                    assert covers(store[(a[0], a[1], a[2])], a[3], a[6])

    for step in range(data.draw(st.integers(1, 60), label="steps")):
        now += rng.choice([0, 1, 5, 20, 200])
        action = rng.random()
        if action < 0.5:
            items = []
            for _ in range(rng.randint(0, 4)):
                key = (rng.choice("gh"), "t", rng.randint(0, 3))
                epoch = rng.choice([0, 0, 0, 1])
                a = [key[0], key[1], key[2], rng.randint(0, 50), [], 1, epoch]
                items.append(a)
                old = newest.get(key)
                if old is None or a[6] > old[6] or (a[6] == old[6] and a[3] >= old[3]):
                    newest[key] = a
            requests[step] = items
            handle(core.on_advance(step, items, now))
        elif inflight:
            job = inflight.pop()
            if rng.random() < 0.3:
                handle(core.on_flush_failed(job.flush_id, now, "down"))
            else:
                if isinstance(job, Flush):
                    for r in job.rows:
                        cur = store.get(r.key)
                        new = r if cur is None else winner(cur, r)
                        if cur is not None:
                            assert covers(new, cur.committed_offset, cur.reset_epoch)  # never backwards
                        store[r.key] = new
                handle(core.on_flush_done(job.flush_id, now))
        handle(core.on_tick(now))
        assert core.statistics(now)["pending_keys"] <= 8  # at most one entry per key

    for _ in range(200):  # heal: everything succeeds from now on
        now += 500
        handle(core.on_tick(now))
        if not inflight:
            continue
        job = inflight.pop()
        if isinstance(job, Flush):
            for r in job.rows:
                cur = store.get(r.key)
                store[r.key] = r if cur is None else winner(cur, r)
        handle(core.on_flush_done(job.flush_id, now))
    assert not requests, "every request was answered"
    assert {k: (v.committed_offset, v.reset_epoch) for k, v in store.items()} == \
        {k: (a[3], a[6]) for k, a in newest.items()}


def test_every_flush_is_counted_into_its_latency_bucket(core):
    """The console's zbroker_commit_flush_seconds: buckets that never forget (the p50 window does)."""
    now = 0.0
    for took in (0.5, 7.5, 7.5, 20_000.0):
        core.on_advance("r", [adv(0, int(now) + 1)], now)
        flush = one(core.on_tick(now + 10), Flush)
        now += 10 + took
        core.on_flush_done(flush.flush_id, now)
    stats = core.statistics(now)
    buckets = dict((b, n) for b, n in stats["flush_ms_buckets"])
    assert buckets[1] == 1 and buckets[10] == 2 and buckets[None] == 1
    assert sum(buckets.values()) == stats["flushes"] == 4
    assert stats["flush_ms_sum"] == 20_015.5


# -- fencing by the coordinator epoch (issue 26) -------------------------------------------

def _lease(epoch: int, held: bool = True):
    from zbroker.storage.offsets.metadata import LeaseState

    return LeaseState("n1" if held else "n2", "tcp://n:1", epoch, held, 5000)


def test_flushes_are_unfenced_until_a_lease_is_held_then_carry_its_epoch(core):
    core.on_advance("r1", [adv(0, 1)], 0)
    assert one(core.on_tick(11), Flush).coordinator_epoch is None
    core = CommitWriterCore(WriterConfig(flush_interval_ms=10))
    ready(core)
    assert core.on_lease(_lease(4, held=False), 0) == []
    assert core.coordinator_epoch is None  # another node's lease is not ours to write with
    assert core.on_lease(_lease(3), 0) == []
    core.on_advance("r1", [adv(0, 1)], 1)
    assert one(core.on_tick(12), Flush).coordinator_epoch == 3


def test_a_fenced_flush_ends_the_term_what_waits_is_answered_stale_epoch(core):
    from zbroker.protocol.errors import StaleEpoch

    core.on_lease(_lease(3), 0)
    core.on_advance("r1", [adv(0, 5)], 1)
    flush = one(core.on_tick(12), Flush)
    core.on_advance("r2", [adv(1, 7)], 13)  # pending behind the flush
    core.on_load_offsets("load", 14)  # waits for those to be written
    effects = core.on_flush_fenced(flush.flush_id, 20, StaleEpoch("over", epoch=4, got=3))
    errors = of(effects, ReplyError)
    assert [e.token for e in errors] == ["r1", "r2"]
    assert all(e.error.code == ErrorCode.STALE_EPOCH for e in errors)
    assert [e.token for e in of(effects, Load)] == ["load"]
    assert core.drained  # nothing of the old term is kept to be written later
    assert not of(core.on_tick(100), Flush)
    stats = core.statistics(100)
    assert stats["flushes_fenced"] == 1 and stats["advances_fenced"] == 2 and stats["waiting_requests"] == 0


def test_the_lease_back_at_a_new_epoch_drops_the_old_terms_values(core):
    core.on_lease(_lease(3), 0)
    core.on_advance("r1", [adv(0, 5)], 1)
    flush = one(core.on_tick(12), Flush)
    core.on_advance("r2", [adv(1, 7)], 13)
    effects = core.on_lease(_lease(5), 14)  # this node lost the lease and took it again
    assert sorted(e.token for e in of(effects, ReplyError)) == ["r1", "r2"]
    assert all(e.error.code == ErrorCode.STALE_EPOCH for e in of(effects, ReplyError))
    # The old flush fails (the store refused it, or the network did): not merged back.
    core.on_flush_failed(flush.flush_id, 15, "cut")
    assert core.drained
    core.on_advance("r3", [adv(2, 9)], 16)
    assert [(r.partition, f.coordinator_epoch) for f in of(core.on_tick(200), Flush) for r in f.rows] == [(2, 5)]
