"""bench.latency: payload stamps, the pacing schedule, the histogram summary."""

from __future__ import annotations

import pytest
from hdrh.histogram import HdrHistogram

from bench.latency import LatencyRecorder, Pacer, paced_loop, read_stamp, stamp


@pytest.mark.parametrize("size", [1, 8, 100, 1024])
def test_stamp_round_trips_and_pads_to_size(size):
    payload = stamp(size, 1_700_000_000_123_456_789)
    assert read_stamp(payload) == 1_700_000_000_123_456_789
    assert len(payload) == max(size, 8)


def test_pacer_releases_records_on_schedule():
    pacer = Pacer(rate=1000, seconds=0.01, start=100.0)  # 10 records, one per ms
    assert pacer.total == 10
    assert pacer.due(99.0) == 0                 # before the start
    assert pacer.due(100.0) == 1                # record 0 is due at the start
    assert pacer.due(100.0) == 0
    assert pacer.next_due_at() == pytest.approx(100.001)
    assert pacer.due(100.0035) == 3             # records 1, 2, 3
    assert pacer.due(200.0) == 6                # never more than the total
    assert pacer.done and pacer.next_due_at() is None
    assert pacer.due(300.0) == 0


def test_pacer_reports_how_far_behind_it_fell():
    pacer = Pacer(rate=100, seconds=1, start=0.0)
    pacer.due(0.0)
    pacer.due(0.5)  # records 1..50 were due from 0.01 on: 0.49 s late
    assert pacer.max_lag_s == pytest.approx(0.49)


def test_paced_loop_with_a_hand_driven_clock():
    now = [0.0]
    sent = []
    pacer = Pacer(rate=100, seconds=0.1, start=0.0)

    def sleep(seconds: float) -> None:
        now[0] += seconds

    paced_loop(pacer, sent.append, clock=lambda: now[0], sleep=sleep)
    assert sum(sent) == 10 and all(n == 1 for n in sent)  # on time: one at a time
    assert now[0] == pytest.approx(0.09)
    assert pacer.max_lag_s == pytest.approx(0.0, abs=1e-9)


def test_paced_loop_wakes_for_the_service_deadline_between_records():
    # 10 records/s and a producer that must flush 0.03 s after each send: the loop
    # sleeps until the flush deadline, not straight through to the next record.
    now = [0.0]
    flush_due: list[float] = []
    flushed_at: list[float] = []

    def publish(n: int) -> None:
        flush_due.append(now[0] + 0.03)

    def service() -> float | None:
        while flush_due and flush_due[0] <= now[0] + 1e-12:
            flushed_at.append(now[0])
            flush_due.pop(0)
        return flush_due[0] if flush_due else None

    def sleep(seconds: float) -> None:
        now[0] += seconds

    pacer = Pacer(rate=10, seconds=0.3, start=0.0)
    paced_loop(pacer, publish, clock=lambda: now[0], sleep=sleep, service=service)
    # The last record's flush is the caller's (its `flush()` after the loop).
    assert flushed_at == pytest.approx([0.03, 0.13])
    assert pacer.sent == 3


def test_recorder_summary_percentiles_and_restorable_histogram():
    recorder = LatencyRecorder()
    sent_ns = 1_000_000_000
    for micros in [100] * 98 + [5_000, 20_000]:
        recorder.record(stamp(100, sent_ns), sent_ns + micros * 1000)
    summary = recorder.summary()
    assert summary["received"] == 100
    lat = summary["latency_ms"]
    assert lat["p50"] == pytest.approx(0.1, rel=0.01)
    assert lat["p99"] == pytest.approx(5.0, rel=0.01)
    assert lat["max"] == pytest.approx(20.0, rel=0.01)
    fractions = [fraction for _ms, fraction in summary["cdf"]]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert HdrHistogram.decode(summary["hdr"]).get_total_count() == 100


def test_negative_or_zero_latency_is_clamped_not_an_error():
    recorder = LatencyRecorder()
    recorder.record(stamp(16, 2_000), 1_000)  # receiver clock "behind"
    assert recorder.summary()["latency_ms"]["max"] == pytest.approx(0.001)


def test_empty_recorder():
    assert LatencyRecorder().summary() == {"received": 0}
