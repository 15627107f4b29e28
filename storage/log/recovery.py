"""Opening a partition directory: find the segments, validate them, rebuild what is derived.

Theory of operation
-------------------
A produce is acknowledged once its batch is written (page cache), so after a
crash the only place a torn or half-written batch can be is the tail of the
last segment. Recovery therefore:

- walks every batch of the LAST segment with its CRC and truncates the file
  at the first batch that is short, has a bad magic or CRC, runs past the end
  of the file, or does not continue the offset sequence. Everything before
  that point was fully written, so every acknowledged batch survives, and the
  next append continues right after the last intact batch. Its index is
  rebuilt from that walk; the `.index` file of the active segment is never
  trusted (it is only written when the segment is rolled).
- trusts the data of an OLDER segment that has an `.index` file: the log
  writes a rolled segment's index only after fsyncing its data, so the file's
  presence says the data is on disk. A well-formed index is extended by a
  short header walk from its last entry, which is also how the segment's end
  offset and newest append time are found; a malformed one is rebuilt by a
  header walk. An older segment with NO index was rolled shortly before a
  crash (with `--fsync never`, which never flushes, at any time since the
  actor started: a start after a crash then reads those segments whole):
  after a power loss its tail may be garbage that still parses, so it is
  walked with CRCs, fsynced, and only then given its index. Should a walk
  hit a broken batch, the segment is reported damaged and served up to that
  point; its files are left untouched for inspection (and a CRC-walked one
  gets no index, so the next open checks it again).
- rebuilds idempotent-producer state from the headers of the last
  `producer_window_segments` segments (a header walk seeks over payloads).
- deletes an `.index` that has no `.log`, and starts an empty directory with
  segment 0.
- when the last segment is empty and the one before it is damaged and ends
  below it, renames the empty one to start where the damaged one ends, so
  that the log never ends above offsets it cannot serve. Segments between
  them that serve nothing at all (a turn that rolled more than once before a
  power loss leaves several files created since the last fsync, any of which
  may come back empty or torn at its first batch) are set aside first: an
  empty file is deleted, one with bytes is renamed to `<name>.damaged`, which
  no later open reads, and kept for inspection.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import structlog

from zbroker.protocol.batch import BatchHeader
from zbroker.storage.log.config import LogConfig
from zbroker.storage.log.index import OffsetIndex, read_index_file, write_index_file
from zbroker.storage.log.producers import ProducerStates
from zbroker.storage.log.segment import (
    DATA_SUFFIX,
    INDEX_SUFFIX,
    ScanResult,
    Segment,
    parse_segment_file_name,
    scan_batches,
    segment_file_name,
)

log = structlog.get_logger("zbroker.log")


@dataclass
class RecoveryReport:
    directory: str
    opened_at_ms: int
    segments: int = 0
    batches_scanned: int = 0
    truncated_bytes: int = 0                    # cut off the tail of the last segment
    truncated_at_offset: int | None = None      # log end after the cut; None when nothing was cut
    reason: str | None = None                   # why the tail was cut
    index_rebuilt: bool = False                 # any older segment's .index was rebuilt or extended
    rebuilt_indexes: list[str] = field(default_factory=list)
    damaged_segments: list[str] = field(default_factory=list)  # older segments served only up to a broken batch
    stray_indexes_deleted: int = 0
    producers: int = 0


class RecoveredLog(NamedTuple):
    segments: list[Segment]          # oldest first; the last one has its read-write fd open
    producers: ProducerStates
    report: RecoveryReport
    directory_changed: bool          # files were created or deleted: the directory needs an fsync


def recover(directory: Path, config: LogConfig, *, now_ms: int) -> RecoveredLog:
    directory.mkdir(parents=True, exist_ok=True)
    report = RecoveryReport(directory=str(directory), opened_at_ms=now_ms)
    data_bases: set[int] = set()
    index_bases: set[int] = set()
    with os.scandir(directory) as entries:
        for entry in entries:
            parsed = parse_segment_file_name(entry.name)
            if parsed is not None:
                (data_bases if parsed[1] == DATA_SUFFIX else index_bases).add(parsed[0])

    directory_changed = False
    for base in sorted(index_bases - data_bases):
        (directory / segment_file_name(base, INDEX_SUFFIX)).unlink()
        report.stray_indexes_deleted += 1
        directory_changed = True

    bases = sorted(data_bases)
    if not bases:
        bases = [0]
        directory_changed = True
    window_start = len(bases) - config.producer_window_segments
    producers = ProducerStates()
    segments = []
    for ordinal, base in enumerate(bases):
        segment = Segment(directory, base, OffsetIndex(config.index_interval_bytes))
        window_producers = producers if ordinal >= window_start else None
        if ordinal == len(bases) - 1:
            _recover_last(segment, window_producers, report)
        else:
            _recover_closed(segment, window_producers, report)
        segments.append(segment)
    if len(segments) > 1 and segments[-1].size == 0:
        # The segments before the empty last one that serve nothing (size 0) hold no
        # offset anybody could have read: the log really ends where the last segment
        # that serves something ends.
        serving = len(segments) - 2
        while serving >= 0 and segments[serving].size == 0:
            serving -= 1
        end = segments[serving].next_offset if serving >= 0 else segments[0].base_offset
        if end < segments[-1].base_offset:
            # Set aside before the rename: the first of them may carry the very name
            # (base offset) the empty one is about to take.
            for unserved in segments[serving + 1:-1]:
                _set_aside(unserved, report)
            set_aside = len(segments) - 2 - serving
            del segments[serving + 1:-1]
            segments[-1] = _rebase_empty_last(directory, segments[-1], end, config, report)
            directory_changed = True
            if set_aside:
                # The window is the last `producer_window_segments` segments of the log as
                # it is now, as the running log counts it (`_forget_producers_outside_window`)
                # and the next open will: with fewer segments it reaches further back than
                # the walk above did, and an acknowledged batch there would be appended again.
                producers = producers_of(segments[-config.producer_window_segments:])
    if len(segments) > config.producer_window_segments or segments[0].base_offset != 0:
        # Batches in segments not scanned (or deleted by retention) are not remembered.
        producers.only_remembered_is_known()
    report.segments = len(segments)
    report.producers = len(producers)
    return RecoveredLog(segments, producers, report, directory_changed)


def _batch_visitor(segment: Segment, index: OffsetIndex, producers: ProducerStates | None
                   ) -> Callable[[BatchHeader, int], None]:
    base = segment.base_offset
    note_batch = index.note_batch
    if producers is None:
        return lambda header, position: note_batch(header.base_offset - base, position)

    def visit(header: BatchHeader, position: int) -> None:
        note_batch(header.base_offset - base, position)
        if header.producer_id:
            producers.record(header.producer_id, header.producer_seq, header.base_offset, header.record_count)
    return visit


def _adopt_scan(segment: Segment, index: OffsetIndex, result: ScanResult) -> None:
    segment.index = index
    segment.size = result.end_position
    segment.next_offset = result.next_offset
    segment.newest_append_time_ms = result.newest_append_time_ms


def _recover_last(segment: Segment, producers: ProducerStates | None, report: RecoveryReport) -> None:
    fd = os.open(segment.data_path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        file_size = os.fstat(fd).st_size
        index = OffsetIndex(segment.index.interval_bytes)
        result = scan_batches(fd, data_size=file_size, start_position=0, start_offset=segment.base_offset,
                              verify_crc=True, on_batch=_batch_visitor(segment, index, producers))
        if result.stop_reason is not None:
            os.ftruncate(fd, result.end_position)
            # Make the cut durable now: new batches will be written where the torn one was.
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    segment.fd = fd
    _adopt_scan(segment, index, result)
    report.batches_scanned += result.batches
    if result.stop_reason is None:
        return
    dropped = file_size - result.end_position
    report.truncated_bytes = dropped
    report.truncated_at_offset = result.next_offset
    report.reason = result.stop_reason
    log.warning("log.truncated", directory=report.directory, segment=segment.name,
                position=result.end_position, dropped_bytes=dropped, reason=result.stop_reason,
                offset=result.next_offset)


def _rebase_empty_last(directory: Path, segment: Segment, next_offset: int, config: LogConfig,
                       report: RecoveryReport) -> Segment:
    """Start the empty last segment where the damaged one before it now ends.

    A machine crash between a roll and its sync can leave the rolled segment
    broken at its tail and the new one with nothing intact: the log would end
    at the new segment's base, above offsets it can never serve, and a fetch
    there returned nothing although PROTOCOL.md promises a batch below the log
    end. The offsets in between were not acknowledged under `--fsync always`;
    under `interval` or `never` a machine crash takes back the unsynced tail
    anyway (docs/SEMANTICS.md), so they are written again, as after any cut.
    """
    segment.close_fd()
    rebased = Segment(directory, next_offset, OffsetIndex(config.index_interval_bytes))
    if rebased.data_path.exists():  # no segment starts inside another's range; never replace one
        raise FileExistsError(f"cannot rebase {segment.data_path.name}: {rebased.data_path.name} exists")
    os.rename(segment.data_path, rebased.data_path)
    if segment.index_path.exists():
        segment.index_path.unlink()
    _recover_last(rebased, None, report)
    report.truncated_at_offset = next_offset
    log.warning("log.empty_segment_rebased", directory=report.directory, from_offset=segment.base_offset,
                to_offset=next_offset, reason="the segment before it is damaged at its tail")
    return rebased


def producers_of(segments: list[Segment]) -> ProducerStates:
    """Producer state from a header walk of the intact part of `segments`."""
    producers = ProducerStates()

    def visit(header: BatchHeader, position: int) -> None:
        if header.producer_id:
            producers.record(header.producer_id, header.producer_seq, header.base_offset, header.record_count)
    for segment in segments:
        fd = os.open(segment.data_path, os.O_RDONLY)
        try:
            scan_batches(fd, data_size=segment.size, start_position=0, start_offset=segment.base_offset,
                         verify_crc=False, on_batch=visit)
        finally:
            os.close(fd)
    return producers


def _set_aside(segment: Segment, report: RecoveryReport) -> None:
    """Take a segment that serves nothing out of the log, keeping any bytes it holds."""
    segment.close_fd()
    if segment.data_path.stat().st_size == 0:
        segment.data_path.unlink()
        kept = None
    else:
        kept = segment.data_path.with_name(segment.data_path.name + ".damaged")
        ordinal = 0
        while kept.exists():  # an earlier recovery's: never replace what was kept
            ordinal += 1
            kept = segment.data_path.with_name(f"{segment.data_path.name}.damaged.{ordinal}")
        os.rename(segment.data_path, kept)
    segment.index_path.unlink(missing_ok=True)
    log.warning("log.segment_set_aside", directory=report.directory, segment=segment.name,
                kept_as=None if kept is None else kept.name,
                reason="serves no offset, and the log ends below it")


def _recover_closed(segment: Segment, producers: ProducerStates | None, report: RecoveryReport) -> None:
    fd = os.open(segment.data_path, os.O_RDONLY)
    try:
        file_size = os.fstat(fd).st_size
        stored = read_index_file(segment.index_path, segment.index.interval_bytes, file_size)
        extended = None
        if producers is None and stored is not None:
            extended = _extend_stored_index(segment, fd, file_size, stored)
        if extended is not None:
            index = stored
            result, reason = extended
        else:
            # Inside the producer window every header is read anyway, so the index comes free.
            index = OffsetIndex(segment.index.interval_bytes)
            unvouched = stored is None and not segment.index_path.exists()
            result = scan_batches(fd, data_size=file_size, start_position=0, start_offset=segment.base_offset,
                                  verify_crc=unvouched, on_batch=_batch_visitor(segment, index, producers))
            if unvouched:
                reason = None if result.stop_reason else "index file missing"
                if reason:
                    os.fsync(fd)  # the index about to be written vouches for this data
            elif stored is None:
                reason = "index file malformed"
            elif producers is None:
                reason = "last index entry does not match the batch it points at"
            elif stored.to_bytes() != index.to_bytes():
                reason = "index file differs from the data"
            else:
                reason = None
    finally:
        os.close(fd)
    report.batches_scanned += result.batches
    _adopt_scan(segment, index, result)
    if reason is not None:
        write_index_file(segment.index_path, index)
        report.index_rebuilt = True
        report.rebuilt_indexes.append(segment.name)
        log.warning("log.index_rebuilt", directory=report.directory, segment=segment.name,
                    entries=len(index), reason=reason)
    if result.stop_reason is not None:
        report.damaged_segments.append(segment.name)
        log.error("log.segment_damaged", directory=report.directory, segment=segment.name,
                  position=result.end_position, unreadable_bytes=file_size - result.end_position,
                  reason=result.stop_reason, next_offset=result.next_offset)


def _extend_stored_index(segment: Segment, fd: int, file_size: int, stored: OffsetIndex
                         ) -> tuple[ScanResult, str | None] | None:
    """Walk from the stored index's last entry to the end, adding entries on the way.

    Returns the walk and why the index file needs rewriting (None: it does not),
    or None when the last entry does not point at the batch it names.
    """
    relative, position = stored.last_entry()
    entries_before = len(stored)
    result = scan_batches(fd, data_size=file_size, start_position=position,
                          start_offset=segment.base_offset + relative, verify_crc=False,
                          on_batch=_batch_visitor(segment, stored, None))
    if position and result.end_position == position:
        return None
    reason = "index did not cover the end of the data" if len(stored) != entries_before else None
    return result, reason
