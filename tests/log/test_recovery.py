"""Recovery: a torn or damaged tail is cut back to the intact prefix; damaged indexes never lose data."""

import pytest
from structlog.testing import capture_logs

from zbroker.protocol.batch import BATCH_HEADER_SIZE
from tests.log.support import (batch_spans, make_payload, open_log, read_all, read_records, record_value,
                               restore_files, snapshot_files)

CONFIG = {"segment_bytes": 1000, "index_interval_bytes": 150, "producer_window_segments": 1}


def build_log(directory, batches=40, config=CONFIG):
    """A log of several segments with batches of varied sizes; returns the expected value of every offset."""
    values = []
    with open_log(directory, **config) as plog:
        for tag in range(batches):
            count, size = 1 + tag % 4, 10 + tag % 7
            assert plog.append(make_payload(tag, count, size), count, append_time_ms=tag) == len(values)
            values.extend(record_value(tag, i, size) for i in range(count))
    return values


def last_segment(directory):
    return max(directory.glob("*.log"))


def check_recovered(directory, values, expected_end, *, reopen=True):
    """The log serves exactly values[:expected_end], appends continue there, and a reopen is clean."""
    with open_log(directory, **CONFIG) as plog:
        assert plog.log_end == expected_end
        assert [r.value for r in read_all(plog, max_bytes=300)] == values[:expected_end]
        assert plog.append(make_payload(999, 2), 2, append_time_ms=0) == expected_end
        assert [r.offset for r in read_records(plog, expected_end)] == [expected_end, expected_end + 1]
        report = plog.recovery
    if reopen:
        with open_log(directory, **CONFIG) as plog:
            assert plog.recovery.truncated_bytes == 0
            assert plog.log_end == expected_end + 2
    return report


def test_the_fixture_log_has_several_segments_with_indexes(tmp_path):
    build_log(tmp_path)
    assert len(list(tmp_path.glob("*.log"))) >= 4
    assert all(p.stat().st_size >= 16 for p in tmp_path.glob("*.index"))


def test_a_tail_cut_at_every_byte_of_the_last_two_batches_keeps_the_intact_prefix(tmp_path):
    values = build_log(tmp_path)
    pristine = snapshot_files(tmp_path)
    segment = last_segment(tmp_path)
    data = pristine[segment.name]
    spans = batch_spans(data)
    assert len(spans) >= 3
    for cut in range(spans[-2][0], len(data) + 1):
        restore_files(tmp_path, pristine)
        segment.write_bytes(data[:cut])
        intact = [span for span in spans if span[1] <= cut]
        report = check_recovered(tmp_path, values, intact[-1][3], reopen=cut % 7 == 0)
        assert report.truncated_bytes == cut - intact[-1][1]
        assert (report.reason is None) == (cut == intact[-1][1])
        assert report.truncated_at_offset == (None if report.reason is None else intact[-1][3])


def test_a_byte_corrupted_anywhere_in_the_last_segment_drops_that_batch_and_all_after_it(tmp_path):
    values = build_log(tmp_path)
    pristine = snapshot_files(tmp_path)
    segment = last_segment(tmp_path)
    data = pristine[segment.name]
    spans = batch_spans(data)
    for position in range(len(data)):
        restore_files(tmp_path, pristine)
        damaged = bytearray(data)
        damaged[position] ^= 0xFF if position % 2 else 0x01
        segment.write_bytes(damaged)
        hit = next(span for span in spans if span[0] <= position < span[1])
        report = check_recovered(tmp_path, values, hit[2], reopen=position % 11 == 0)
        assert report.truncated_bytes == len(data) - hit[0]
        assert report.reason is not None


def test_a_whole_batch_with_a_good_crc_but_the_wrong_offset_is_cut(tmp_path):
    values = build_log(tmp_path)
    segment = last_segment(tmp_path)
    data = segment.read_bytes()
    last_batch = batch_spans(data)[-1]
    segment.write_bytes(data + data[last_batch[0]:last_batch[1]])  # a write replayed at the tail
    report = check_recovered(tmp_path, values, len(values))
    assert report.reason == "unexpected base offset"
    assert report.truncated_bytes == last_batch[1] - last_batch[0]


def test_truncation_is_logged_with_what_was_dropped(tmp_path):
    build_log(tmp_path)
    segment = last_segment(tmp_path)
    data = segment.read_bytes()
    last_batch = batch_spans(data)[-1]
    segment.write_bytes(data[:-3])
    with capture_logs() as logs:
        open_log(tmp_path, **CONFIG).close()
    [event] = [e for e in logs if e["event"] == "log.truncated"]
    assert event["segment"] == segment.name
    assert event["position"] == last_batch[0]
    assert event["dropped_bytes"] == last_batch[1] - 3 - last_batch[0]
    assert event["reason"] == "batch runs past the end of the file"
    assert event["directory"] == str(tmp_path)


def test_a_wholly_unreadable_last_segment_is_emptied_and_offsets_continue_from_its_base(tmp_path):
    values = build_log(tmp_path)
    segment = last_segment(tmp_path)
    segment.write_bytes(b"\0" * 500)
    report = check_recovered(tmp_path, values, int(segment.stem))
    assert report.reason == "bad batch magic"


def test_an_empty_last_segment_is_fine(tmp_path):
    values = build_log(tmp_path)
    segment = last_segment(tmp_path)
    segment.write_bytes(b"")
    report = check_recovered(tmp_path, values, int(segment.stem))
    assert report.truncated_bytes == 0


def test_an_empty_directory_starts_at_zero_and_a_stray_index_is_deleted(tmp_path):
    (tmp_path / "00000000000000000042.index").write_bytes(b"\0" * 8)
    (tmp_path / ".lock").write_bytes(b"")
    with open_log(tmp_path) as plog:
        assert (plog.log_start, plog.log_end, plog.size_bytes) == (0, 0, 0)
        assert plog.recovery.stray_indexes_deleted == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "00000000000000000000.log"]


def test_a_missing_directory_is_created(tmp_path):
    with open_log(tmp_path / "topic-0") as plog:
        assert plog.append(make_payload(0, 1), 1, append_time_ms=0) == 0
    assert (tmp_path / "topic-0" / "00000000000000000000.log").exists()


def older_indexes(directory):
    last = last_segment(directory).with_suffix(".index")
    return sorted(p for p in directory.glob("*.index") if p != last)


def read_every_offset_fresh(directory, values, config=CONFIG):
    """Every offset read by a log with no read cache, so each read starts from an index lookup."""
    with open_log(directory, **config) as plog:
        for offset in range(len(values)):
            got = read_records(plog, offset, 1)
            assert got[0].offset == offset and got[0].value == values[offset]
            plog._read_cache.clear()
        assert [r.value for r in read_all(plog)] == values
        return plog.recovery


def test_an_older_index_cut_at_any_length_is_rebuilt_without_losing_data(tmp_path):
    values = build_log(tmp_path)
    pristine = snapshot_files(tmp_path)
    for index_path in older_indexes(tmp_path)[:2]:
        data = pristine[index_path.name]
        for cut in range(len(data)):
            restore_files(tmp_path, pristine)
            index_path.write_bytes(data[:cut])
            assert read_every_offset_fresh(tmp_path, values).index_rebuilt
            assert index_path.read_bytes() == data
        restore_files(tmp_path, pristine)
        index_path.unlink()
        assert read_every_offset_fresh(tmp_path, values).rebuilt_indexes == [index_path.stem + ".log"]
        assert index_path.read_bytes() == data


@pytest.mark.parametrize("window", [1, 2, 10])
def test_an_older_index_with_any_byte_corrupted_still_serves_every_offset(tmp_path, window):
    config = {**CONFIG, "producer_window_segments": window}
    values = build_log(tmp_path, config=config)
    pristine = snapshot_files(tmp_path)
    index_path = older_indexes(tmp_path)[0]
    data = pristine[index_path.name]
    repaired = 0
    for position in range(len(data)):
        for flip in (0x01, 0x80, 0xFF):
            restore_files(tmp_path, pristine)
            damaged = bytearray(data)
            damaged[position] ^= flip
            index_path.write_bytes(damaged)
            with capture_logs() as logs:
                read_every_offset_fresh(tmp_path, values, config)
            repaired += any(e["event"] == "log.index_rebuilt" for e in logs)
    # Most damage is caught on open; what passes the shape check is caught when a read uses it.
    assert repaired > len(data)


def test_garbage_in_the_last_segments_index_is_ignored(tmp_path):
    values = build_log(tmp_path)
    last_index = last_segment(tmp_path).with_suffix(".index")
    for garbage in (b"", b"\xff" * 8, b"\0" * 13, (tmp_path / "00000000000000000000.index").read_bytes()):
        last_index.write_bytes(garbage)
        read_every_offset_fresh(tmp_path, values)


def test_an_older_segment_broken_midway_is_served_up_to_the_break_and_reads_skip_the_gap(tmp_path):
    values = build_log(tmp_path)
    first = tmp_path / "00000000000000000000.log"
    data = first.read_bytes()
    spans = batch_spans(data)
    first.write_bytes(data[:spans[3][1] + BATCH_HEADER_SIZE // 2])
    second_base = spans[-1][3]
    with capture_logs() as logs:
        plog = open_log(tmp_path, **CONFIG)
    with plog:
        assert plog.recovery.damaged_segments == [first.name]
        assert any(e["event"] == "log.segment_damaged" for e in logs)
        records = read_all(plog, from_offset=0)
        assert [r.value for r in records] == values[:spans[3][3]] + values[second_base:]
        gap_offset = spans[3][3]
        assert read_records(plog, gap_offset, 1)[0].offset == second_base
    assert len(first.read_bytes()) > spans[3][1], "a damaged older segment is left as found"


def crash_without_flush(plog):
    """Drop the log as a killed process would: no flush, descriptors gone."""
    for segment in plog._segments:
        segment.close_fd()


def append_and_crash(directory, config):
    """Several rolls, no flush, then a crash; returns the value of every offset."""
    plog = open_log(directory, **config)
    values = []
    for tag in range(40):
        plog.append(make_payload(tag, 2), 2, append_time_ms=tag)
        values += [record_value(tag, i, 20) for i in range(2)]
    crash_without_flush(plog)
    return values


def test_a_rolled_segment_gets_its_index_only_when_a_flush_has_made_its_data_durable(tmp_path):
    plog = open_log(tmp_path, **CONFIG)
    for tag in range(40):
        plog.append(make_payload(tag, 2), 2, append_time_ms=tag)
    closed = sorted(tmp_path.glob("*.log"))[:-1]
    assert len(closed) >= 3
    assert not list(tmp_path.glob("*.index")), "an index would vouch for data not yet fsynced"
    jobs = plog.sync_jobs()
    kinds = [job[0] for job in jobs]
    for segment in closed:
        index_job = next(i for i, job in enumerate(jobs) if job[0] == "index" and job[1].stem == segment.stem)
        assert kinds[index_job - 1] == "fd", "each index is written right after its segment's fsync"
    assert jobs[-1][0] == "path" and jobs[-1][1] == tmp_path, "the directory is synced last: new index files"
    from zbroker.storage.log.partition_log import run_sync_jobs
    run_sync_jobs(jobs)
    assert sorted(p.stem for p in tmp_path.glob("*.index")) == [p.stem for p in closed]
    plog.close()


@pytest.mark.parametrize("window", [1, 10])
def test_garbage_in_a_rolled_segment_that_was_never_flushed_is_not_served(tmp_path, window):
    """A power loss just after a roll: the older segment's last pages never reached the disk.

    Its headers may still parse (the file size was updated) while a payload is garbage;
    without an index file vouching for it, recovery checks every CRC.
    """
    config = {**CONFIG, "producer_window_segments": window}
    values = append_and_crash(tmp_path, config)
    first = tmp_path / "00000000000000000000.log"
    data = bytearray(first.read_bytes())
    spans = batch_spans(bytes(data))
    data[spans[-1][1] - 3] ^= 0x5A  # inside the last batch's payload: the header still parses
    first.write_bytes(bytes(data))
    with capture_logs() as logs:
        plog = open_log(tmp_path, **config)
    with plog:
        assert plog.recovery.damaged_segments == [first.name]
        assert any(e["event"] == "log.segment_damaged" for e in logs)
        records = read_all(plog, from_offset=0)  # raises CorruptBatch if garbage is served
        assert [r.value for r in records] == values[:spans[-1][2]] + values[spans[-1][3]:]
    assert not (tmp_path / "00000000000000000000.index").exists(), "a damaged segment is checked again next time"


def test_a_crash_between_roll_and_flush_loses_nothing_and_writes_the_missing_indexes(tmp_path):
    values = append_and_crash(tmp_path, CONFIG)
    with open_log(tmp_path, **CONFIG) as plog:
        assert not plog.recovery.damaged_segments
        assert len(plog.recovery.rebuilt_indexes) == len(list(tmp_path.glob("*.log"))) - 1
        assert [r.value for r in read_all(plog)] == values
    with open_log(tmp_path, **CONFIG) as plog:
        assert not plog.recovery.index_rebuilt


def test_a_failed_sync_job_closes_the_descriptors_of_the_jobs_after_it(tmp_path):
    # A reviewer's finding: make_durable and sync_jobs dup() the active segment's fd up
    # front; when an earlier job failed (EMFILE, the very shortage), that dup leaked.
    import errno
    import os

    from zbroker.storage.log.partition_log import run_sync_jobs

    (tmp_path / "f").write_bytes(b"x")
    base = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        later = os.dup(base)
        with pytest.raises(OSError):  # a directory cannot be opened for writing
            run_sync_jobs([("path", tmp_path, os.O_WRONLY), ("fd", later)])
        with pytest.raises(OSError) as closed:
            os.fstat(later)
        assert closed.value.errno == errno.EBADF
    finally:
        os.close(base)


def test_an_empty_last_segment_above_a_damaged_one_starts_where_the_damage_does(tmp_path):
    # A reviewer's power loss right after a roll (nothing of it acknowledged under
    # --fsync always): the rolled segment's last batch is garbage and the new segment
    # holds only a torn batch. The log ended at the new segment's base, above offsets
    # it could not serve, and a fetch there returned nothing below the log end.
    config = {"segment_bytes": 400, "index_interval_bytes": 60}
    plog = open_log(tmp_path, **config)
    for tag in range(8):
        plog.append(make_payload(tag, 2, 20), 2, append_time_ms=tag)
    plog.flush()
    while len(plog._segments) < 3:
        plog.append(make_payload(99, 2, 20), 2, append_time_ms=99)
    for segment in plog._segments:
        segment.close_fd()  # the machine stops before the end-of-turn fsync
    rolled, last = sorted(tmp_path.glob("*.log"))[-2:]
    data = bytearray(rolled.read_bytes())
    spans = batch_spans(bytes(data))
    data[spans[-1][1] - 3] ^= 0x5A
    rolled.write_bytes(bytes(data))
    last.write_bytes(last.read_bytes()[:30])
    with capture_logs() as logs:
        plog = open_log(tmp_path, **config)
    with plog:
        damaged_end = spans[-1][2]
        assert plog.log_end == damaged_end
        assert any(e["event"] == "log.empty_segment_rebased" for e in logs)
        assert not last.exists()
        records = read_all(plog)  # every offset below the log end is served
        assert records[-1].offset == damaged_end - 1
        assert plog.append(make_payload(7, 1, 20), 1, append_time_ms=100) == damaged_end
        assert [r.value for r in read_records(plog, damaged_end)] == [record_value(7, 0, 20)]
    with open_log(tmp_path, **config) as plog:  # and it opens the same way again
        assert plog.log_end == damaged_end + 1


def test_an_empty_last_segment_is_never_renamed_onto_a_segment_that_serves_nothing(tmp_path):
    # A reviewer's case: the segment before the empty one broke at its first batch, so it
    # ended at its own base, and the rebase renamed the empty segment onto its file:
    # the damaged data was gone and two segments shared a file, one of which retention
    # then deleted, live data and all.
    config = {"segment_bytes": 100, "index_interval_bytes": 60}
    plog = open_log(tmp_path, **config)
    plog.append(make_payload(0, 2, 20), 2, append_time_ms=1)
    plog.flush()
    plog.append(make_payload(1, 2, 20), 2, append_time_ms=2)  # rolls: segment 2
    plog.flush()
    plog.append(make_payload(2, 2, 20), 2, append_time_ms=3)  # rolls: segment 4, segment 2 unsynced
    for segment in plog._segments:
        segment.close_fd()  # the machine stops
    middle, last = sorted(tmp_path.glob("*.log"))[-2:]
    damaged = bytearray(middle.read_bytes())
    damaged[-3] ^= 0x5A  # its only batch
    middle.write_bytes(bytes(damaged))
    last.write_bytes(b"")
    with open_log(tmp_path, **config) as plog:
        # Set aside rather than left in place: left there it made the log end above
        # offsets 2 and 3, which no fetch could be served.
        kept = tmp_path / (middle.name + ".damaged")
        assert kept.read_bytes() == bytes(damaged), "the damaged segment is kept for inspection"
        assert plog.log_end == 2
        read_all(plog)
        names = [segment.data_path.name for segment in plog._segments]
        assert len(names) == len(set(names)), names
        offset = plog.append(make_payload(7, 1, 20), 1, append_time_ms=10)
        assert [r.offset for r in read_records(plog, offset)] == [offset]


def roll_twice_unsynced(directory, config):
    """Flushed batches (acknowledged under --fsync always), then one loop turn's appends that
    roll two new segments, and the machine stops before that turn's fsync. Returns the
    acknowledged log end and the two segments created since the fsync."""
    plog = open_log(directory, **config)
    for tag in range(4):
        plog.append(make_payload(tag, 2, 20), 2, append_time_ms=tag)
    plog.flush()
    acknowledged = plog.log_end
    tag = 10
    while len(plog._segments) < 4:
        plog.append(make_payload(tag, 2, 20), 2, append_time_ms=tag)
        tag += 1
    crash_without_flush(plog)
    return acknowledged, sorted(directory.glob("*.log"))[-2:]


def test_segments_rolled_since_the_last_fsync_that_came_back_empty_leave_no_offsets_unserved(tmp_path):
    # A power loss after a turn that rolled twice: both new files were created after the
    # last fsync, so each may come back empty. The empty one before the last served
    # nothing, the rebase of the last skipped it, and the log ended at the last one's
    # base: every fetch below that log end returned nothing (PROTOCOL.md promises a batch).
    config = {"segment_bytes": 200, "index_interval_bytes": 60}
    acknowledged, rolled = roll_twice_unsynced(tmp_path, config)
    for path in rolled:
        path.write_bytes(b"")
    with open_log(tmp_path, **config) as plog:
        assert plog.log_end == acknowledged
        read_all(plog)  # every offset below the log end is served
        assert plog.append(make_payload(7, 1, 20), 1, append_time_ms=100) == acknowledged
    with open_log(tmp_path, **config) as plog:
        assert plog.log_end == acknowledged + 1
        assert [r.value for r in read_records(plog, acknowledged)] == [record_value(7, 0, 20)]


def test_a_torn_segment_that_serves_nothing_below_an_empty_last_one_is_set_aside(tmp_path):
    config = {"segment_bytes": 200, "index_interval_bytes": 60}
    acknowledged, (middle, last) = roll_twice_unsynced(tmp_path, config)
    torn = middle.read_bytes()[:BATCH_HEADER_SIZE + 5]  # the first batch only half written
    middle.write_bytes(torn)
    last.write_bytes(b"")
    with open_log(tmp_path, **config) as plog:
        assert plog.log_end == acknowledged
        read_all(plog)
        names = [segment.data_path.name for segment in plog._segments]
        assert len(names) == len(set(names)), names
        assert plog.append(make_payload(7, 1, 20), 1, append_time_ms=100) == acknowledged
    kept = [path for path in tmp_path.iterdir() if path.name.startswith(middle.name + ".")]
    assert [path.read_bytes() for path in kept] == [torn], "its bytes are kept for inspection"
    with open_log(tmp_path, **config) as plog:
        assert plog.log_end == acknowledged + 1
        read_all(plog)


def test_after_setting_segments_aside_acknowledged_batches_in_the_window_are_still_deduplicated(tmp_path):
    # The producer window is the log's last `producer_window_segments` segments. Recovery
    # walked the last two of the segments it found; once the ones that serve nothing are
    # set aside, the last two reach further back, and a retry of a batch acknowledged
    # there was not recognised and would have been appended a second time.
    config = {"segment_bytes": 200, "index_interval_bytes": 60, "producer_window_segments": 2}
    plog = open_log(tmp_path, **config)
    batches = []
    for sequence in range(4):
        base = plog.append(make_payload(sequence, 2, 20), 2, append_time_ms=sequence, producer_id=5,
                           producer_seq=sequence)
        batches.append((base, 2))
    plog.flush()
    acknowledged = plog.log_end
    while len(plog._segments) < 4:
        plog.append(make_payload(50, 2, 20), 2, append_time_ms=50)
    crash_without_flush(plog)
    for path in sorted(tmp_path.glob("*.log"))[-2:]:
        path.write_bytes(b"")
    with open_log(tmp_path, **config) as plog:
        assert plog.log_end == acknowledged
        window_start = plog._segments[-2].base_offset
        in_window = [sequence for sequence, (base, _) in enumerate(batches) if base >= window_start]
        assert in_window
        for sequence in in_window:
            assert plog.check_sequence(5, sequence) == batches[sequence]
        snapshot = plog.producer_snapshot()
    with open_log(tmp_path, **config) as plog:  # the next open remembers the same
        assert plog.producer_snapshot() == snapshot
