"""Appending and reading: offsets, whole-batch reads, segment rolling, the sparse index, read cache."""

import errno
import os

import pytest

from zbroker.protocol.batch import BATCH_HEADER_SIZE, iter_stored_batches
from zbroker.protocol.errors import OffsetOutOfRange
from zbroker.storage.log.index import OffsetIndex
from tests.log.support import batch_spans, make_payload, open_log, read_all, read_records, record_value


def append_batches(plog, counts, *, value_size=20, first_tag=0, append_time_ms=0):
    return [plog.append(make_payload(first_tag + i, n, value_size), n, append_time_ms=append_time_ms)
            for i, n in enumerate(counts)]


def batch_bases(blob):
    return [header.base_offset for header, _ in iter_stored_batches(blob)]


def test_appends_get_consecutive_offsets_and_read_back_exactly(tmp_path):
    counts = [1, 5, 3, 10, 2]
    with open_log(tmp_path) as plog:
        bases = append_batches(plog, counts)
        assert bases == [0, 1, 6, 9, 19]
        assert plog.log_end == 21
        records = read_all(plog)
    assert [r.offset for r in records] == list(range(21))
    expected_values = [record_value(tag, i, 20) for tag, n in enumerate(counts) for i in range(n)]
    assert [r.value for r in records] == expected_values


def test_read_from_the_middle_of_a_batch_starts_with_the_whole_batch(tmp_path):
    with open_log(tmp_path) as plog:
        append_batches(plog, [5, 5, 5])
        blob = plog.read(7, 1 << 20)
        assert batch_bases(blob) == [5, 10]
        assert [r.offset for r in read_records(plog, 7)] == list(range(7, 15))
        assert batch_bases(plog.read(14, 1 << 20)) == [10]


def test_a_read_returns_whole_batches_only_and_at_least_one(tmp_path):
    with open_log(tmp_path) as plog:
        append_batches(plog, [10, 10, 10])
        batch_size = BATCH_HEADER_SIZE + len(make_payload(0, 10))
        assert batch_bases(plog.read(0, 1)) == [0]
        assert batch_bases(plog.read(0, 0)) == [0]
        assert batch_bases(plog.read(0, batch_size)) == [0]
        assert batch_bases(plog.read(0, 2 * batch_size + batch_size // 2)) == [0, 10]
        assert batch_bases(plog.read(15, 2 * batch_size - 1)) == [10]
        assert len(plog.read(0, 3 * batch_size)) == 3 * batch_size


def test_reading_at_log_end_returns_nothing(tmp_path):
    with open_log(tmp_path) as plog:
        assert plog.read(0, 100) == b""
        append_batches(plog, [3])
        assert plog.read(3, 100) == b""


@pytest.mark.parametrize("offset", [-1, 4, 1000])
def test_reading_outside_the_log_raises_offset_out_of_range(tmp_path, offset):
    with open_log(tmp_path) as plog:
        append_batches(plog, [3])
        with pytest.raises(OffsetOutOfRange) as caught:
            plog.read(offset, 100)
    assert caught.value.data == {"log_start": 0, "log_end": 3, "offset": offset}


def test_record_count_must_be_positive(tmp_path):
    with open_log(tmp_path) as plog:
        with pytest.raises(ValueError):
            plog.append(make_payload(0, 1), 0, append_time_ms=0)
        assert plog.log_end == 0 and plog.size_bytes == 0


def test_segments_roll_by_size_and_reads_cross_every_boundary(tmp_path):
    with open_log(tmp_path, segment_bytes=1000) as plog:
        append_batches(plog, [5] * 60)  # 175-byte batches: 5 per segment
        assert plog.log_end == 300
        stats = plog.statistics()
        assert stats["segments"] == 12
        assert stats["size_bytes"] == 60 * 175
        for max_bytes in (1, 200, 999, 1000, 3000, 1 << 20):
            assert [r.offset for r in read_all(plog, max_bytes=max_bytes)] == list(range(300))
        for boundary in range(25, 300, 25):  # every segment's first offset, and the one before it
            assert read_records(plog, boundary, 1)[0].offset == boundary
            assert read_records(plog, boundary - 1, 1)[-1].offset == boundary - 1
    names = sorted(p.name for p in tmp_path.glob("*.log"))
    assert names == [f"{base:020d}.log" for base in range(0, 300, 25)]
    for path in tmp_path.glob("*.log"):
        data = path.read_bytes()
        assert len(data) <= 1000
        assert batch_spans(data)[0][2] == int(path.stem)


def test_a_batch_larger_than_a_segment_gets_a_segment_of_its_own(tmp_path):
    with open_log(tmp_path, segment_bytes=500) as plog:
        append_batches(plog, [1, 100, 1])
        assert plog.statistics()["segments"] == 3
        assert [r.offset for r in read_all(plog, max_bytes=10)] == list(range(102))


def test_the_index_is_sparse_and_survives_roll_and_reopen(tmp_path):
    interval = 512
    with open_log(tmp_path, segment_bytes=100_000, index_interval_bytes=interval) as plog:
        append_batches(plog, [5] * 1000)  # 175-byte batches
        first = plog._segments[0]
        entries, size = len(first.index), first.size
        assert (size - 175) // (interval + 175) <= entries <= size // interval
        assert entries >= size // (interval + 175)
        assert not first.index_path.exists(), "written by the flush that makes the segment durable"
        plog.flush()
        assert first.index_path.read_bytes() == first.index.to_bytes()
        in_memory = [(s.base_offset, s.index.to_bytes()) for s in plog._segments]
    with open_log(tmp_path, segment_bytes=100_000, index_interval_bytes=interval) as plog:
        assert [(s.base_offset, s.index.to_bytes()) for s in plog._segments] == in_memory
        assert not plog.recovery.index_rebuilt


def test_index_lookup_returns_the_floor_entry():
    index = OffsetIndex(100)
    for relative, position in [(0, 0), (3, 60), (7, 130), (9, 250), (12, 300)]:
        index.note_batch(relative, position)
    assert list(index.positions) == [130, 250]
    assert index.lookup(0) == (0, 0)
    assert index.lookup(6) == (0, 0)
    assert index.lookup(7) == (7, 130)
    assert index.lookup(11) == (9, 250)
    assert OffsetIndex.from_bytes(index.to_bytes(), 100, 300).to_bytes() == index.to_bytes()


def test_an_index_file_of_the_wrong_shape_is_refused():
    def stored(*pairs):
        return b"".join(r.to_bytes(4, "big") + p.to_bytes(4, "big") for r, p in pairs)

    assert OffsetIndex.from_bytes(stored((3, 100), (8, 300)), 100, 400) is not None
    assert OffsetIndex.from_bytes(stored((3, 100), (8, 300))[:-1], 100, 400) is None  # not whole entries
    assert OffsetIndex.from_bytes(stored((3, 100), (8, 300)), 100, 343) is None       # header past the data
    assert OffsetIndex.from_bytes(stored((3, 100), (2, 300)), 100, 400) is None       # offsets go back
    assert OffsetIndex.from_bytes(stored((3, 100), (8, 100)), 100, 400) is None       # positions repeat
    assert OffsetIndex.from_bytes(stored((0, 0)), 100, 400) is None                   # names the implicit entry


def test_a_read_whose_budget_ends_at_a_segment_boundary_stops_there(tmp_path):
    with open_log(tmp_path, segment_bytes=1000) as plog:
        append_batches(plog, [5] * 12)  # 175-byte batches, 5 per segment
        assert batch_bases(plog.read(0, 5 * 175)) == [0, 5, 10, 15, 20]
        assert batch_bases(plog.read(20, 2 * 175)) == [20, 25]
        assert batch_bases(plog.read(0, 11 * 175 + 174)) == list(range(0, 55, 5))


def test_a_forward_reader_hits_the_read_cache(tmp_path):
    with open_log(tmp_path, segment_bytes=2000, index_interval_bytes=256) as plog:
        append_batches(plog, [5] * 100)
        records = read_all(plog, max_bytes=500)
        stats = plog.statistics()
    assert len(records) == 500
    assert stats["read_cache_misses"] == 1
    assert stats["read_cache_hits"] >= 100 // 3


def test_a_tailing_reader_is_served_from_the_cache_after_appends_and_rolls(tmp_path):
    with open_log(tmp_path, segment_bytes=400) as plog:
        offset = 0
        for tag in range(20):
            plog.append(make_payload(tag, 5), 5, append_time_ms=0)
            batch = read_records(plog, offset)
            assert [r.offset for r in batch] == list(range(offset, offset + 5))
            offset += 5
        assert plog.statistics()["read_cache_misses"] == 1


def test_closed_segments_share_a_bounded_set_of_descriptors(tmp_path):
    with open_log(tmp_path, segment_bytes=200) as plog:
        append_batches(plog, [1] * 50)
        for offset in range(0, 50, 3):
            read_records(plog, offset, 1)
        assert plog.statistics()["open_read_fds"] <= 8
        assert len(os.listdir("/proc/self/fd")) < 50


def test_flush_fsyncs_rolled_segments_their_indexes_the_active_segment_and_the_directory(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    with open_log(tmp_path, segment_bytes=400) as plog:
        plog.flush()
        append_batches(plog, [5, 5, 5])
        monkeypatch.setattr(os, "fsync", recording_fsync)
        plog.flush()
        assert sorted(synced) == sorted([str(tmp_path / "00000000000000000000.log"),
                                         str(tmp_path / "00000000000000000000.index"),
                                         str(tmp_path / "00000000000000000010.log"),
                                         str(tmp_path)])
        synced.clear()
        plog.flush()
        assert synced == [str(tmp_path / "00000000000000000010.log")]


def test_a_failed_write_leaves_the_log_as_it_was(tmp_path, monkeypatch):
    real_writev = os.writev

    def disk_full(fd, buffers):
        real_writev(fd, [bytes(buffers[0])[:20]])
        raise OSError(errno.ENOSPC, "No space left on device")

    with open_log(tmp_path) as plog:
        append_batches(plog, [3])
        monkeypatch.setattr(os, "writev", disk_full)
        with pytest.raises(OSError):
            plog.append(make_payload(1, 3), 3, append_time_ms=0)
        monkeypatch.undo()
        assert plog.log_end == 3
        assert (tmp_path / "00000000000000000000.log").stat().st_size == plog.size_bytes
        assert plog.append(make_payload(2, 3), 3, append_time_ms=0) == 3
    with open_log(tmp_path) as plog:
        assert plog.recovery.truncated_bytes == 0
        assert [r.value for r in read_all(plog)][3:] == [record_value(2, i, 20) for i in range(3)]


def test_a_short_write_is_completed(tmp_path, monkeypatch):
    real_writev = os.writev

    def short_writev(fd, buffers):
        return real_writev(fd, [bytes(buffers[0])[:10]])

    with open_log(tmp_path) as plog:
        monkeypatch.setattr(os, "writev", short_writev)
        plog.append(make_payload(0, 4), 4, append_time_ms=0)
        monkeypatch.undo()
        assert [r.value for r in read_all(plog)] == [record_value(0, i, 20) for i in range(4)]


def test_a_closed_log_refuses_work_and_closes_twice_quietly(tmp_path):
    plog = open_log(tmp_path)
    plog.close()
    plog.close()
    with pytest.raises(ValueError):
        plog.append(make_payload(0, 1), 1, append_time_ms=0)
    with pytest.raises(ValueError):
        plog.read(0, 10)
