"""The durable log of one topic-partition: append, read, flush, retention.

Theory of operation
-------------------
The log is a list of segments (`segment.py`), oldest first; only the last one,
the *active* segment, is written. `append` writes `header + payload` with one
`os.writev` on an `O_APPEND` descriptor and returns without fsync: the caller
(the partition-log actor) decides when `flush` makes things durable, and
acknowledges a produce accordingly. A segment is rolled when the next batch
would push it past `segment_bytes`; a batch larger than that still goes into
an empty segment of its own.

Reads hand back stored batches verbatim (they are the fetch wire format),
whole batches only, starting with the batch that contains the requested
offset. Finding that batch costs an index lookup and a short header walk, so
the log remembers where recent reads stopped (next offset -> segment and
position): a consumer reading forward starts each read with one `pread`.

Closed segments are opened for reading on demand and kept in a small LRU of
file descriptors. Retention deletes whole closed segments from the front,
which is what moves `log_start`.

Durability bookkeeping: `flush` fsyncs the active segment, every segment
rolled since the previous flush (its last batches may not be on disk yet)
and then writes and fsyncs that segment's `.index`, and the directory when
files were created or deleted. An index file is thus the segment's proof of
durability, which recovery relies on. The active segment has no `.index`:
recovery rebuilds the last segment's index from the data anyway.

Recovery on open lives in `recovery.py`; idempotent-producer state in
`producers.py`. Nothing here reads a clock: times are arguments.

Replicated partitions (the replica core in actors/partition_log/replica.py)
use three more things, none of which an unreplicated log touches: the
leader-epoch cache (`epochs.py`, `self.epochs`), `append_stored` (a
follower writes the leader's stored batches byte for byte, offsets and all)
and `truncate_to` (a follower cuts a divergent tail). Truncation is ordered
for crashes: segment files are deleted newest first and the cut segment is
cut and fsynced before the epoch checkpoint is rewritten, so a crash at any
point leaves a contiguous log that is at most longer than asked, never
shorter, and a checkpoint that recovery trims to the log (`trimmed_to`);
the follower simply truncates again when it next hears from its leader.
"""

from __future__ import annotations

import errno
import os
import struct
from bisect import bisect_right
from collections import OrderedDict
from pathlib import Path

import structlog

from zbroker.protocol.batch import (BATCH_HEADER_SIZE, batch_crc_ok, build_batch_header, iter_stored_batches,
                                    parse_batch_header)
from zbroker.protocol.errors import CorruptBatch, OffsetOutOfRange
from zbroker.storage.log.config import LogConfig
from zbroker.storage.log.epochs import LeaderEpochCache
from zbroker.storage.log.index import OffsetIndex, write_index_file
from zbroker.storage.log.producers import ProducerStates
from zbroker.storage.log.recovery import RecoveryReport, producers_of, recover
from zbroker.storage.log.segment import DATA_SUFFIX, Segment

__all__ = ["LogConfig", "PartitionLog", "RecoveryReport"]

log = structlog.get_logger("zbroker.log")

MAX_U32 = 0xFFFFFFFF
# Closed segments with an open read descriptor; consumers usually read near the tail.
OPEN_READ_FDS = 8
# Where recent reads stopped. One entry per consumer position worth remembering.
READ_CACHE_ENTRIES = 64

_PAYLOAD_LENGTH = struct.Struct(">I")
_PAYLOAD_LENGTH_AT = 8


class PartitionLog:
    def __init__(self, directory: Path, config: LogConfig, segments: list[Segment], producers: ProducerStates,
                 recovery: RecoveryReport, *, directory_changed: bool) -> None:
        """Use `PartitionLog.open`, which recovers the directory first."""
        self.directory = directory
        self.config = config
        self.recovery = recovery
        self._segments = segments
        self._base_offsets = [segment.base_offset for segment in segments]
        self._active = segments[-1]
        self._producers = producers
        self._size_bytes = sum(segment.size for segment in segments)
        # Append times never go down within a partition (see `append`).
        self._last_append_time_ms = max((segment.newest_append_time_ms for segment in segments
                                         if segment.newest_append_time_ms is not None), default=0)
        self._read_fds: OrderedDict[int, Segment] = OrderedDict()  # base offset -> closed segment with an fd
        self._read_cache: dict[int, tuple[Segment, int]] = {}     # next offset -> (segment, position)
        self._read_cache_hits = 0
        self._read_cache_misses = 0
        self._rolled_since_flush: list[Segment] = []
        self._directory_dirty = directory_changed
        self._closed = False
        # Only a replicated partition ever writes one; an absent file is an empty cache.
        self.epochs = LeaderEpochCache.load(directory)
        if len(self.epochs):
            self.epochs.trimmed_to(self.log_end)

    @classmethod
    def open(cls, directory: Path, config: LogConfig, *, now_ms: int) -> "PartitionLog":
        directory = Path(directory)
        recovered = recover(directory, config, now_ms=now_ms)
        plog = cls(directory, config, recovered.segments, recovered.producers, recovered.report,
                   directory_changed=recovered.directory_changed)
        log.info("log.opened", directory=str(directory), segments=len(recovered.segments),
                 log_start=plog.log_start, log_end=plog.log_end, size_bytes=plog.size_bytes,
                 batches_scanned=recovered.report.batches_scanned,
                 truncated_bytes=recovered.report.truncated_bytes)
        return plog

    def __enter__(self) -> "PartitionLog":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"partition log {self.directory} is closed")

    @property
    def log_start(self) -> int:
        return self._segments[0].base_offset

    @property
    def log_end(self) -> int:
        return self._active.next_offset

    @property
    def size_bytes(self) -> int:
        return self._size_bytes

    # -- writing ---------------------------------------------------------------------------

    def append(self, payload: bytes | memoryview, record_count: int, *, append_time_ms: int,
               producer_id: int = 0, producer_seq: int = -1) -> int:
        """Write one batch; returns its base offset. Not durable until `flush`.

        For an idempotent producer call `check_sequence` first: append records
        the sequence without judging it.

        `append_time_ms` is the wall clock, which can step back; a batch is stamped
        no earlier than the one before it. Recovery reads a closed segment's newest
        append time off its last batches only, so with a time that went down it
        took the segment for older than it was and age retention deleted it early.
        """
        self._check_open()
        if not 1 <= record_count <= MAX_U32:
            raise ValueError(f"record_count must be in 1..{MAX_U32}, got {record_count}")
        if append_time_ms < self._last_append_time_ms:
            append_time_ms = self._last_append_time_ms
        self._last_append_time_ms = append_time_ms
        segment = self._active
        base_offset = segment.next_offset
        header = build_batch_header(payload, base_offset=base_offset, record_count=record_count,
                                    append_time_ms=append_time_ms, producer_id=producer_id,
                                    producer_seq=producer_seq)
        batch_size = BATCH_HEADER_SIZE + len(payload)
        if segment.size and (segment.size + batch_size > self.config.segment_bytes
                             or base_offset - segment.base_offset > MAX_U32):
            segment = self._roll()
        position = segment.size
        _write_batch(segment.fd, header, payload, position)
        segment.index.note_batch(base_offset - segment.base_offset, position)
        segment.size = position + batch_size
        segment.next_offset = base_offset + record_count
        if segment.newest_append_time_ms is None or append_time_ms > segment.newest_append_time_ms:
            segment.newest_append_time_ms = append_time_ms
        self._size_bytes += batch_size
        if producer_id:
            self._producers.record(producer_id, producer_seq, base_offset, record_count)
        return base_offset

    def check_sequence(self, producer_id: int, producer_seq: int) -> tuple[int, int] | None:
        """(base_offset, record_count) if this batch was already appended, None if it is new.

        Raises DuplicateSequence for a sequence at or below the producer's last
        one that is no longer (or never was) remembered.
        """
        return self._producers.check(producer_id, producer_seq)

    # -- replication (never called for an unreplicated partition) -------------------------

    def append_stored(self, data: bytes | memoryview) -> int:
        """Append a leader's stored batches verbatim (headers, offsets, times and all);
        returns the new log end. Not durable until `flush`.

        Every batch is checked (whole, CRC, continues the log end) before any is
        written, so a bad frame from the network changes nothing.
        """
        self._check_open()
        view = memoryview(data)
        spans: list[tuple[int, int, object]] = []
        position = 0
        expected = self.log_end
        while position < len(view):
            header = parse_batch_header(view, position)
            end = position + header.total_size
            if header.base_offset != expected:
                raise CorruptBatch("a replicated batch does not continue the log", base_offset=header.base_offset,
                                   log_end=expected)
            if not batch_crc_ok(view, position, header):
                raise CorruptBatch("replicated batch CRC mismatch", base_offset=header.base_offset)
            spans.append((position, end, header))
            expected = header.next_offset
            position = end
        for start, end, header in spans:
            segment = self._active
            batch_size = end - start
            if segment.size and (segment.size + batch_size > self.config.segment_bytes
                                 or header.base_offset - segment.base_offset > MAX_U32):
                segment = self._roll()
            position = segment.size
            _write_batch(segment.fd, bytes(view[start:start + BATCH_HEADER_SIZE]),
                         view[start + BATCH_HEADER_SIZE:end], position)
            segment.index.note_batch(header.base_offset - segment.base_offset, position)
            segment.size = position + batch_size
            segment.next_offset = header.next_offset
            stamp = header.append_time_ms
            if segment.newest_append_time_ms is None or stamp > segment.newest_append_time_ms:
                segment.newest_append_time_ms = stamp
            self._last_append_time_ms = max(self._last_append_time_ms, stamp)
            self._size_bytes += batch_size
            if header.producer_id:
                self._producers.record(header.producer_id, header.producer_seq, header.base_offset,
                                       header.record_count)
        return self.log_end

    def truncate_to(self, offset: int) -> int:
        """Cut the log so that it ends at `offset` (at the start of the batch holding it,
        if that is lower); returns the new log end. Durable before it returns.

        Crash ordering (see the module comment): later segments are deleted
        newest first, the cut segment is cut and fsynced, the directory is
        fsynced, and only then the epoch checkpoint is trimmed. Producer state
        is rebuilt from what remains, as recovery would.
        """
        self._check_open()
        if offset >= self.log_end:
            return self.log_end
        if offset < self.log_start:
            raise OffsetOutOfRange("cannot truncate below the log start (reset the log instead)",
                                   log_start=self.log_start, log_end=self.log_end, offset=offset)
        keep = bisect_right(self._base_offsets, offset) - 1
        if keep and self._base_offsets[keep] == offset:
            # Cut to a segment boundary: the segment before it becomes the active one again,
            # as in a log that never rolled there (and rolls there again, as the leader did).
            keep -= 1
        target = self._segments[keep]
        for segment in reversed(self._segments[keep + 1:]):
            self._read_fds.pop(segment.base_offset, None)
            segment.close_fd()
            segment.data_path.unlink()
            segment.index_path.unlink(missing_ok=True)
        del self._segments[keep + 1:], self._base_offsets[keep + 1:]
        if offset < target.next_offset:
            self._read_fd(target)  # position_of reads through segment.fd
            position = target.position_of(offset)
            new_end = parse_batch_header(os.pread(target.fd, BATCH_HEADER_SIZE, position)).base_offset
        else:
            position, new_end = target.size, target.next_offset
        if target is not self._active:
            self._read_fds.pop(target.base_offset, None)
            target.close_fd()
            # The active segment's index lives in memory only (recovery rebuilds it).
            target.index_path.unlink(missing_ok=True)
            target.fd = os.open(target.data_path, os.O_RDWR | os.O_APPEND)
            if target in self._rolled_since_flush:
                self._rolled_since_flush.remove(target)
            self._active = target
        os.ftruncate(target.fd, position)
        os.fsync(target.fd)
        _fsync_path(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        target.index.cut_at(position)
        target.size = position
        target.next_offset = new_end
        if position == 0:
            target.newest_append_time_ms = None
        self._rolled_since_flush = [s for s in self._rolled_since_flush if s in self._segments]
        self._read_cache.clear()
        self._size_bytes = sum(segment.size for segment in self._segments)
        self.epochs.truncate_from_end(new_end)
        self._rebuild_producers()
        log.warning("log.truncated_to", directory=str(self.directory), offset=new_end, asked=offset)
        return new_end

    def reset_to(self, offset: int) -> None:
        """Throw the whole log away and start it empty at `offset` (a follower that holds
        nothing the leader still has: a lost disk, or a leader whose retention moved past it)."""
        self._check_open()
        for segment in reversed(self._segments):
            segment.close_fd()
            segment.data_path.unlink()
            segment.index_path.unlink(missing_ok=True)
        self._read_fds.clear()
        self._read_cache.clear()
        self._rolled_since_flush.clear()
        fresh = Segment(self.directory, offset, OffsetIndex(self.config.index_interval_bytes))
        fresh.fd = os.open(fresh.data_path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644)
        os.fsync(fresh.fd)
        _fsync_path(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        self._segments = [fresh]
        self._base_offsets = [offset]
        self._active = fresh
        self._size_bytes = 0
        self.epochs.clear()
        self._producers = ProducerStates()
        self._directory_dirty = False
        log.warning("log.reset", directory=str(self.directory), offset=offset)

    def _rebuild_producers(self) -> None:
        window = self._segments[-self.config.producer_window_segments:]
        self._producers = producers_of(window)
        if len(self._segments) > len(window) or self._segments[0].base_offset != 0:
            self._producers.only_remembered_is_known()

    def _roll(self) -> Segment:
        old = self._active
        # The rolled segment's index is written by the next flush, after its data is
        # fsynced: recovery trusts an older segment that has an index file, and
        # CRC-checks one that has none (it may have been rolled just before a
        # power loss, with its last batches never on disk).
        new = Segment(self.directory, old.next_offset, OffsetIndex(self.config.index_interval_bytes))
        new.fd = os.open(new.data_path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644)
        self._keep_read_fd(old)
        self._rolled_since_flush.append(old)
        self._segments.append(new)
        self._base_offsets.append(new.base_offset)
        self._active = new
        self._directory_dirty = True
        self._forget_producers_outside_window()
        return new

    def flush(self) -> None:
        run_sync_jobs(self.sync_jobs())

    def sync_jobs(self) -> list[tuple]:
        """What `flush` must fsync, in a form another thread may carry out.

        File descriptors are ``dup``-ed, so the caller's thread may roll or delete
        segments meanwhile without the fsync hitting a closed or reused fd. Index
        files and the directory go by path. Everything written before this call is
        covered once the jobs have run (`run_sync_jobs`).
        """
        self._check_open()
        jobs: list[tuple] = []
        for segment in self._rolled_since_flush:
            jobs.append(("fd", os.dup(self._read_fd(segment))))
            jobs.append(("index", segment.index_path, segment.index.to_bytes()))
            self._directory_dirty = True  # the index file is new
        self._rolled_since_flush.clear()
        jobs.append(("fd", os.dup(self._active.fd)))
        if self._directory_dirty:
            jobs.append(("path", self.directory, os.O_RDONLY | os.O_DIRECTORY))
            self._directory_dirty = False
        return jobs

    def make_durable(self) -> None:
        """fsync every segment, every closed segment's index and the directory.

        For a log just opened: a crash between a `write()` and its fsync leaves
        bytes that recovery accepts (they are whole and their CRCs match) but
        that a power loss could still take back, in the active segment or in a
        segment rolled within the last fsync interval, and a file whose
        directory entry was never synced. Nothing may be served, reported or
        acknowledged as a duplicate from them before they are on disk.
        """
        self._check_open()
        jobs: list[tuple] = []
        for segment in self._segments[:-1]:
            jobs.append(("path", segment.data_path, os.O_RDONLY))
            if segment in self._rolled_since_flush:
                jobs.append(("index", segment.index_path, segment.index.to_bytes()))
            else:
                jobs.append(("path", segment.index_path, os.O_RDONLY))
        jobs.append(("fd", os.dup(self._active.fd)))
        jobs.append(("path", self.directory, os.O_RDONLY | os.O_DIRECTORY))
        self._rolled_since_flush.clear()
        self._directory_dirty = False
        run_sync_jobs(jobs)

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            for segment in self._segments:
                segment.close_fd()
            self._read_fds.clear()
            self._read_cache.clear()

    # -- reading ---------------------------------------------------------------------------

    def read(self, offset: int, max_bytes: int) -> bytes:
        """Whole stored batches from the one containing `offset`, up to `max_bytes`.

        The first batch is returned even when it alone exceeds `max_bytes`.
        """
        self._check_open()
        log_end = self.log_end
        if offset < self.log_start or offset > log_end:
            raise OffsetOutOfRange("offset is outside the log", log_start=self.log_start, log_end=log_end,
                                   offset=offset)
        if offset == log_end:
            return b""
        segment, position = self._locate(offset)
        while position >= segment.size:
            # The read starts in a later segment: a cached end of a closed segment, or a
            # damaged segment's lost tail.
            following = self._segment_after(segment)
            if following is None:
                return b""
            segment, position = following, 0
        parts: list[bytes | memoryview] = []
        budget = max_bytes
        while True:
            fd = self._read_fd(segment)
            data = os.pread(fd, min(segment.size - position, max(budget, 0)), position)
            whole, after = _whole_batches(data)
            if whole == 0:
                if parts:
                    break
                data = _read_one_batch(fd, position)
                whole, after = len(data), parse_batch_header(data).next_offset
            parts.append(data if whole == len(data) else memoryview(data)[:whole])
            position += whole
            budget -= whole
            next_offset = after
            if position < segment.size:
                break  # the budget ran out inside this segment
            following = self._segment_after(segment)
            if following is None:
                break
            segment, position = following, 0
        self._remember_read_end(next_offset, segment, position)
        if len(parts) == 1 and isinstance(parts[0], bytes):
            return parts[0]
        return b"".join(parts)

    def offset_for_time(self, time_ms: int) -> int:
        """The first offset of the first batch appended at or after `time_ms` (wall clock);
        `log_end` when none was. Append times never decrease (`append` stamps a batch no
        earlier than the one before), so segments whose newest batch is older are skipped
        and the first batch found at or after `time_ms` is the answer."""
        self._check_open()
        log_end = self.log_end
        for segment in self._segments:
            newest = segment.newest_append_time_ms
            if newest is not None and newest < time_ms:
                continue
            offset = max(segment.base_offset, self.log_start)
            while offset < log_end:
                blob = self.read(offset, 1 << 16)
                if not blob:
                    break
                for header, _payload in iter_stored_batches(blob, verify_crc=False):
                    if header.append_time_ms >= time_ms:
                        return max(header.base_offset, self.log_start)
                    offset = header.next_offset
            return log_end
        return log_end

    def _locate(self, offset: int) -> tuple[Segment, int]:
        cached = self._read_cache.get(offset)
        if cached is not None:
            self._read_cache_hits += 1
            return cached
        self._read_cache_misses += 1
        segment = self._segments[bisect_right(self._base_offsets, offset) - 1]
        if offset >= segment.next_offset:
            # A damaged older segment ends early; the read continues with the next one.
            return segment, segment.size
        self._read_fd(segment)  # position_of reads through segment.fd
        return segment, segment.position_of(offset)

    def _remember_read_end(self, next_offset: int, segment: Segment, position: int) -> None:
        cache = self._read_cache
        if next_offset not in cache and len(cache) >= READ_CACHE_ENTRIES:
            del cache[next(iter(cache))]
        cache[next_offset] = (segment, position)

    def _segment_after(self, segment: Segment) -> Segment | None:
        following = bisect_right(self._base_offsets, segment.base_offset)
        return self._segments[following] if following < len(self._segments) else None

    def _read_fd(self, segment: Segment) -> int:
        if segment is self._active:
            return segment.fd
        if segment.fd is not None:
            self._read_fds.move_to_end(segment.base_offset)
            return segment.fd
        segment.fd = os.open(segment.data_path, os.O_RDONLY)
        self._keep_read_fd(segment)
        return segment.fd

    def _keep_read_fd(self, segment: Segment) -> None:
        self._read_fds[segment.base_offset] = segment
        if len(self._read_fds) > OPEN_READ_FDS:
            _, evicted = self._read_fds.popitem(last=False)
            evicted.close_fd()

    # -- retention -------------------------------------------------------------------------

    def enforce_retention(self, now_ms: int) -> int:
        """Delete closed segments beyond the size or age limit, oldest first. Returns how many.

        By size, a segment goes when the newer ones alone still hold
        `retention_bytes`. By age, when its newest batch was appended before
        `now_ms - retention_ms`. Only a prefix is deleted, and never the
        active segment, so the log stays contiguous.
        """
        self._check_open()
        retention_bytes = self.config.retention_bytes
        retention_ms = self.config.retention_ms
        deleted = 0
        while len(self._segments) > 1:
            oldest = self._segments[0]
            over_size = retention_bytes >= 0 and self._size_bytes - oldest.size >= retention_bytes
            newest = oldest.newest_append_time_ms
            over_age = retention_ms >= 0 and (newest is None or newest < now_ms - retention_ms)
            if not (over_size or over_age):
                break
            self._delete_oldest_segment()
            deleted += 1
        if deleted:
            self._forget_producers_outside_window()
            if len(self.epochs):
                self.epochs.truncate_from_start(self.log_start)
            log.info("log.retention", directory=str(self.directory), deleted_segments=deleted,
                     log_start=self.log_start, size_bytes=self._size_bytes)
        return deleted

    def _delete_oldest_segment(self) -> None:
        segment = self._segments.pop(0)
        self._base_offsets.pop(0)
        self._size_bytes -= segment.size
        self._read_fds.pop(segment.base_offset, None)
        segment.close_fd()
        if segment in self._rolled_since_flush:
            self._rolled_since_flush.remove(segment)
        self._read_cache = {offset: place for offset, place in self._read_cache.items() if place[0] is not segment}
        segment.data_path.unlink()
        segment.index_path.unlink(missing_ok=True)
        self._directory_dirty = True

    def _forget_producers_outside_window(self) -> None:
        window_start = self._segments[-self.config.producer_window_segments:][0].base_offset
        self._producers.forget_before(window_start)

    # -- introspection ---------------------------------------------------------------------

    def producer_snapshot(self) -> dict[int, list[tuple[int, int, int]]]:
        """Remembered (sequence, base_offset, record_count) per producer id."""
        return self._producers.snapshot()

    def statistics(self) -> dict[str, int]:
        return {
            "segments": len(self._segments),
            "log_start": self.log_start,
            "log_end": self.log_end,
            "size_bytes": self._size_bytes,
            "index_entries": sum(len(segment.index) for segment in self._segments),
            "producers": len(self._producers),
            "open_read_fds": len(self._read_fds),
            "read_cache_entries": len(self._read_cache),
            "read_cache_hits": self._read_cache_hits,
            "read_cache_misses": self._read_cache_misses,
            "segments_awaiting_fsync": len(self._rolled_since_flush),
        }


def _write_batch(fd: int, header: bytes, payload: bytes | memoryview, position: int) -> None:
    """Write the whole batch at the end of the file, or leave the file as it was."""
    try:
        written = os.writev(fd, (header, payload))
        if written < len(header) + len(payload):
            # Short writes are rare (a signal, a full disk); finish the rest, however slowly.
            remaining = memoryview(header + bytes(payload))[written:]
            while remaining:
                remaining = remaining[os.write(fd, remaining):]
    except OSError:
        # A partial batch at the tail would make the next batch unreachable after a
        # restart. If even this cut fails, its error propagates and recovery cleans up.
        os.ftruncate(fd, position)
        raise


def _whole_batches(data: bytes) -> tuple[int, int]:
    """Bytes of whole batches at the start of `data`, and the offset after the last of them."""
    end = 0
    last_start = -1
    size = len(data)
    while end + BATCH_HEADER_SIZE <= size:
        batch_end = end + BATCH_HEADER_SIZE + _PAYLOAD_LENGTH.unpack_from(data, end + _PAYLOAD_LENGTH_AT)[0]
        if batch_end > size:
            break
        last_start = end
        end = batch_end
    if last_start < 0:
        return 0, 0
    return end, parse_batch_header(data, last_start).next_offset


def _read_one_batch(fd: int, position: int) -> bytes:
    header = parse_batch_header(os.pread(fd, BATCH_HEADER_SIZE, position))
    return os.pread(fd, header.total_size, position)


def run_sync_jobs(jobs: list[tuple]) -> None:
    """fsync what `PartitionLog.sync_jobs` listed, in order; safe on any thread.

    An ("index", path, bytes) job follows the fsync of its segment's data, so
    an index file on disk means the data it describes is on disk too.
    """
    for done, job in enumerate(jobs):
        try:
            if job[0] == "fd":
                try:
                    os.fsync(job[1])
                finally:
                    os.close(job[1])
            elif job[0] == "index":
                if job[1].with_suffix(DATA_SUFFIX).exists():  # not deleted by retention meanwhile
                    write_index_file(job[1], job[2], fsync=True)
            else:
                try:
                    _fsync_path(job[1], job[2])
                except FileNotFoundError:
                    pass  # deleted by retention since: nothing left to make durable
        except BaseException:
            # The dup()-ed descriptors of the jobs not reached would leak (one per failed
            # flush: under EMFILE, the very thing that made the job fail).
            for later in jobs[done + 1:]:
                if later[0] == "fd":
                    os.close(later[1])
            raise


def _fsync_path(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Directories whose entry in their parent this process has synced (see make_directories_durably).
_durable_directories: set[Path] = set()


def make_directories_durably(path: Path, root: Path) -> None:
    """`mkdir -p path`, then make the entry of every directory from `path` up to `root`
    (both included) durable in its parent, once per process.

    A new partition's directory entry (and its topic's, the logs directory's and the
    data directory's) lives in the directory above it: until that is synced, a
    machine crash can take the directory back with every segment in it,
    acknowledged batches included, even though the segments themselves were
    fsynced (`make_durable` syncs the partition directory itself, not what is
    above it). A directory counts as done only after its parent's fsync succeeded,
    so a retry after a failed fsync syncs it again, and a directory someone else
    created (the supervisor's data directory) is synced too.
    """
    path, root = Path(path).absolute(), Path(root).absolute()
    if path != root and root not in path.parents:
        raise ValueError(f"{path} is not inside {root}")
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))
    path.mkdir(parents=True, exist_ok=True)
    directory = path
    while True:
        if directory not in _durable_directories:
            _fsync_path(directory.parent, os.O_RDONLY | os.O_DIRECTORY)
            _durable_directories.add(directory)
        if directory == root:
            return
        directory = directory.parent
