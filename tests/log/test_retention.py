"""Retention: whole closed segments go, oldest first, by size or by age; log_start follows."""

import pytest

from zbroker.protocol.errors import DuplicateSequence, OffsetOutOfRange
from tests.log.support import make_payload, open_log, read_all

BATCH = 175          # make_payload(tag, 5) plus the header
PER_SEGMENT = 5      # 5 batches of 175 bytes fit in 1000


def fill(plog, batches, *, time_ms=lambda i: 0, producer_id=0):
    for i in range(batches):
        plog.append(make_payload(i, 5), 5, append_time_ms=time_ms(i), producer_id=producer_id,
                    producer_seq=i if producer_id else -1)


def test_size_retention_keeps_the_newest_bytes_in_whole_segments(tmp_path):
    with open_log(tmp_path, segment_bytes=1000, retention_bytes=2000) as plog:
        fill(plog, 42)  # 8 full segments and an active one with 2 batches
        assert plog.statistics()["segments"] == 9
        deleted = plog.enforce_retention(now_ms=0)
        # 350 active + 875 + 875 = 2100 >= 2000, and dropping one more would leave 1225 < 2000.
        assert deleted == 6
        assert plog.size_bytes == 2100
        assert plog.log_start == 6 * PER_SEGMENT * 5
        assert plog.enforce_retention(now_ms=0) == 0
        with pytest.raises(OffsetOutOfRange) as caught:
            plog.read(plog.log_start - 1, 100)
        assert caught.value.data["log_start"] == 150
        assert [r.offset for r in read_all(plog)] == list(range(150, 210))
    assert sorted(int(p.stem) for p in tmp_path.glob("*.log")) == [150, 175, 200]
    assert sorted(int(p.stem) for p in tmp_path.glob("*.index")) == [150, 175]
    with open_log(tmp_path, segment_bytes=1000) as plog:
        assert (plog.log_start, plog.log_end, plog.size_bytes) == (150, 210, 2100)


@pytest.mark.parametrize("retention_bytes, kept_segments", [(1225, 2), (1226, 3), (0, 1)])
def test_size_retention_boundary(tmp_path, retention_bytes, kept_segments):
    with open_log(tmp_path, segment_bytes=1000, retention_bytes=retention_bytes) as plog:
        fill(plog, 12)  # two full segments of 875 bytes, 350 in the active one
        plog.enforce_retention(now_ms=0)
        assert plog.statistics()["segments"] == kept_segments


def test_age_retention_deletes_segments_whose_newest_batch_is_too_old(tmp_path):
    # Batch i is appended at time 1000 * i; segment k holds batches 5k..5k+4.
    with open_log(tmp_path, segment_bytes=1000, retention_ms=10_000) as plog:
        fill(plog, 30, time_ms=lambda i: 1000 * i)
        assert plog.enforce_retention(now_ms=0) == 0
        # At 24_000 the horizon is 14_000: segments with newest 4_000 and 9_000 go, 14_000 stays.
        assert plog.enforce_retention(now_ms=24_000) == 2
        assert plog.log_start == 50
        assert plog.enforce_retention(now_ms=24_000) == 0
        assert plog.enforce_retention(now_ms=24_001) == 1
        assert plog.log_start == 75


def test_the_active_segment_is_never_deleted(tmp_path):
    with open_log(tmp_path, segment_bytes=1000, retention_ms=0, retention_bytes=0) as plog:
        fill(plog, 12)
        assert plog.enforce_retention(now_ms=10 ** 12) == 2
        assert plog.statistics()["segments"] == 1
        assert plog.log_start == 50 and plog.log_end == 60
        assert [r.offset for r in read_all(plog)] == list(range(50, 60))
        fill(plog, 1)
        assert plog.log_end == 65


def test_unlimited_retention_deletes_nothing(tmp_path):
    with open_log(tmp_path, segment_bytes=1000, retention_ms=-1, retention_bytes=-1) as plog:
        fill(plog, 30)
        assert plog.enforce_retention(now_ms=10 ** 15) == 0
        assert plog.log_start == 0


def test_deleted_segments_leave_the_read_cache_and_descriptors(tmp_path):
    with open_log(tmp_path, segment_bytes=1000, retention_bytes=0) as plog:
        fill(plog, 20)
        read_all(plog, max_bytes=300)
        assert plog.enforce_retention(now_ms=0) == 3
        assert plog.statistics()["open_read_fds"] == 0
        remembered = {id(segment) for segment, _ in plog._read_cache.values()}
        assert remembered and remembered <= {id(segment) for segment in plog._segments}
        assert [r.offset for r in read_all(plog)] == list(range(75, 100))


def test_producer_batches_in_deleted_segments_are_forgotten_as_a_reopen_would(tmp_path):
    config = {"segment_bytes": 1000, "retention_bytes": 0, "producer_window_segments": 5}
    with open_log(tmp_path, **config) as plog:
        fill(plog, 7, producer_id=3)
        assert plog.check_sequence(3, 0) == (0, 5)
        plog.enforce_retention(now_ms=0)
        with pytest.raises(DuplicateSequence):
            plog.check_sequence(3, 0)
        assert plog.check_sequence(3, 6) == (30, 5)
        live = plog.producer_snapshot()
        assert [base for _, base, _ in live[3]] == [25, 30]
    with open_log(tmp_path, **config) as plog:
        assert plog.producer_snapshot() == live


def test_a_clock_step_back_does_not_make_a_reopened_segment_look_older(tmp_path):
    # A reviewer's point: the running log kept a segment's newest append time as the
    # maximum over its batches, a reopen read it off the batches after the last index
    # entry only; with the wall clock stepped back in between, age retention then
    # deleted, 500 ms after it was appended, a record it had to keep for 1,000.
    config = {"segment_bytes": 1000, "index_interval_bytes": 100, "retention_ms": 1000,
              "producer_window_segments": 1}
    plog = open_log(tmp_path, **config)
    for i, t in enumerate([100] * 5 + [5000] + [4000] * 5):  # the clock stepped back after the 6th batch
        plog.append(make_payload(i, 1, 40), 1, append_time_ms=t)
    while len(plog._segments) < 3:
        plog.append(make_payload(99, 1, 40), 1, append_time_ms=6000)
    live_newest = plog._segments[0].newest_append_time_ms
    plog.close()
    with open_log(tmp_path, **config) as reopened:
        assert reopened._segments[0].newest_append_time_ms == live_newest == 5000
        assert reopened.enforce_retention(5500) == 0  # 500 ms old: kept
        assert reopened.enforce_retention(6001) > 0
