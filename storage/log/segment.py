"""Segment files: naming, walking stored batches, finding the batch that holds an offset.

Theory of operation
-------------------
A partition log is a sequence of segments. Segment `<base>.log` (base offset,
20 digits) holds stored batches back to back (layout in `protocol/batch.py`),
the first one starting at offset `base`; `<base>.index` is its sparse offset
index (`index.py`).

Everything that walks batches goes through `scan_batches`: it reads the file
in windows with `os.pread` (few system calls for many small batches, and for
header-only walks it skips over large payloads), checks that each header
parses and continues the offset sequence, optionally verifies the CRC, and
stops at the first batch that fails, saying why. Recovery, index rebuilds and
the producer-state rebuild all use it, so they agree on what "intact" means.

`Segment.position_of` is the read path's lookup: floor entry from the index,
then a short header walk. The entry it starts from is checked against the
header it points at; a mismatch means the `.index` file was damaged in a way
recovery's shape check could not see, and the index is rebuilt from the data
on the spot.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, NamedTuple

import structlog

from zbroker.protocol.batch import BATCH_HEADER_SIZE, BatchHeader, batch_crc_ok, parse_batch_header
from zbroker.protocol.errors import CorruptBatch
from zbroker.storage.log.index import OffsetIndex, write_index_file

log = structlog.get_logger("zbroker.log")

DATA_SUFFIX = ".log"
INDEX_SUFFIX = ".index"
_SEGMENT_FILE = re.compile(r"^(\d{20})(\.log|\.index)$")

# A CRC walk reads every byte anyway, so it reads big windows; a header walk
# mostly needs 44 bytes per batch, so it reads small ones and seeks over payloads.
CRC_SCAN_WINDOW = 1024 * 1024
HEADER_SCAN_WINDOW = 16 * 1024


def segment_file_name(base_offset: int, suffix: str) -> str:
    return f"{base_offset:020d}{suffix}"


def parse_segment_file_name(file_name: str) -> tuple[int, str] | None:
    """(base offset, suffix) for a segment or index file name, None for anything else."""
    match = _SEGMENT_FILE.match(file_name)
    if match is None:
        return None
    return int(match.group(1)), match.group(2)


class _WindowedReader:
    """Serves byte ranges of a file from one pread window, re-reading only on a miss."""

    __slots__ = ("_fd", "_window_bytes", "_buffer", "_buffer_start")

    def __init__(self, fd: int, window_bytes: int) -> None:
        self._fd = fd
        self._window_bytes = window_bytes
        self._buffer = b""
        self._buffer_start = 0

    def view(self, position: int, length: int) -> tuple[bytes, int]:
        """A buffer and the index in it where `position` starts; shorter than asked at EOF."""
        start = self._buffer_start
        if start <= position and position + length <= start + len(self._buffer):
            return self._buffer, position - start
        self._buffer = os.pread(self._fd, max(length, self._window_bytes), position)
        self._buffer_start = position
        return self._buffer, 0


class ScanResult(NamedTuple):
    end_position: int                 # just past the last intact batch
    next_offset: int                  # offset the next batch must start with
    batches: int
    newest_append_time_ms: int | None  # None when no batch was walked
    stop_reason: str | None           # why the walk stopped before end of data; None at a clean end


def scan_batches(fd: int, *, data_size: int, start_position: int, start_offset: int, verify_crc: bool,
                 on_batch: Callable[[BatchHeader, int], None]) -> ScanResult:
    """Walk intact batches from `start_position`, calling `on_batch(header, position)` for each."""
    reader = _WindowedReader(fd, CRC_SCAN_WINDOW if verify_crc else HEADER_SCAN_WINDOW)
    position = start_position
    expected_offset = start_offset
    batches = 0
    newest: int | None = None
    stop_reason = None
    while position < data_size:
        if data_size - position < BATCH_HEADER_SIZE:
            stop_reason = "short batch header"
            break
        buffer, at = reader.view(position, BATCH_HEADER_SIZE)
        try:
            header = parse_batch_header(buffer, at)
        except CorruptBatch as exc:
            stop_reason = exc.message
            break
        if header.base_offset != expected_offset:
            stop_reason = "unexpected base offset"
            break
        end = position + header.total_size
        if end > data_size:
            stop_reason = "batch runs past the end of the file"
            break
        if verify_crc:
            buffer, at = reader.view(position, header.total_size)
            if not batch_crc_ok(buffer, at, header):
                stop_reason = "batch CRC mismatch"
                break
        on_batch(header, position)
        batches += 1
        if newest is None or header.append_time_ms > newest:
            newest = header.append_time_ms
        position = end
        expected_offset = header.next_offset
    return ScanResult(position, expected_offset, batches, newest, stop_reason)


class Segment:
    """One data file and its in-memory index. `fd` is managed by the owning log."""

    __slots__ = ("base_offset", "data_path", "index_path", "next_offset", "size",
                 "newest_append_time_ms", "index", "fd")

    def __init__(self, directory: Path, base_offset: int, index: OffsetIndex) -> None:
        self.base_offset = base_offset
        self.data_path = directory / segment_file_name(base_offset, DATA_SUFFIX)
        self.index_path = directory / segment_file_name(base_offset, INDEX_SUFFIX)
        self.next_offset = base_offset
        self.size = 0  # bytes of intact batches; reads never go past it
        # Newest broker append time in the segment (age-based retention); None while empty.
        self.newest_append_time_ms: int | None = None
        self.index = index
        self.fd: int | None = None

    @property
    def name(self) -> str:
        return self.data_path.name

    def __repr__(self) -> str:
        return f"Segment({self.name}, offsets {self.base_offset}..{self.next_offset}, {self.size} bytes)"

    def close_fd(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def position_of(self, offset: int) -> int:
        """File position of the batch holding `offset` (base_offset <= offset < next_offset)."""
        relative, position = self.index.lookup(offset - self.base_offset)
        found = self._walk_to(offset, position, self.base_offset + relative)
        if found is None and position:
            self.rebuild_index(reason="index entry does not match the batch it points at")
            found = self._walk_to(offset, 0, self.base_offset)
        if found is None:
            raise CorruptBatch("stored batches are damaged", segment=self.name, offset=offset)
        return found

    def _walk_to(self, offset: int, position: int, expected_offset: int) -> int | None:
        assert self.fd is not None
        reader = _WindowedReader(self.fd, HEADER_SCAN_WINDOW)
        while position + BATCH_HEADER_SIZE <= self.size:
            buffer, at = reader.view(position, BATCH_HEADER_SIZE)
            try:
                header = parse_batch_header(buffer, at)
            except CorruptBatch:
                return None
            if header.base_offset != expected_offset:
                return None
            if offset < header.next_offset:
                return position
            position += header.total_size
            expected_offset = header.next_offset
        return None

    def rebuild_index(self, *, reason: str) -> None:
        """Replace the index (memory and file) with one built by a header walk of the data."""
        assert self.fd is not None
        index = OffsetIndex(self.index.interval_bytes)
        base = self.base_offset
        scan_batches(self.fd, data_size=self.size, start_position=0, start_offset=base, verify_crc=False,
                     on_batch=lambda header, position: index.note_batch(header.base_offset - base, position))
        self.index = index
        write_index_file(self.index_path, index)
        log.warning("log.index_rebuilt", directory=str(self.data_path.parent), segment=self.name,
                    entries=len(index), reason=reason)
