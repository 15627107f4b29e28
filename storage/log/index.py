"""Sparse offset index of one segment.

Theory of operation
-------------------
A segment's data file is a run of stored batches. To start a read at an
offset without walking the whole file, each segment keeps a sparse index of
(relative offset, file position) pairs, one for the first batch that starts at
least `interval_bytes` after the previous entry. Position 0 (relative offset
0) is an implicit entry, so every lookup has a floor and the walk that follows
covers about one interval plus one batch. Appends and rebuilds apply the same
rule (`note_batch`), so an index rebuilt from the data equals the one built
while appending.

Entries live in two `array('I')` columns: 8 bytes per entry, no per-entry
objects (a 64 MiB segment at 4 KiB intervals holds 16 Ki entries, 128 KiB).

The `.index` file holds the same pairs as big-endian u32, written whole when a
segment is rolled. It is a hint, never the truth: recovery rejects a file of
the wrong shape (`from_bytes` returns None), and a reader checks the entry it
uses against the batch header it points at (see `segment.py`).
"""

from __future__ import annotations

import operator
import os
import sys
from array import array
from bisect import bisect_right
from pathlib import Path

from zbroker.protocol.batch import BATCH_HEADER_SIZE

ENTRY_SIZE = 8
if array("I").itemsize != 4:
    raise ImportError("the offset index needs a 4-byte unsigned array type ('I')")


def _strictly_increasing(column: array) -> bool:
    return all(map(operator.lt, column[:-1], column[1:]))


class OffsetIndex:
    __slots__ = ("interval_bytes", "relative_offsets", "positions", "_last_position")

    def __init__(self, interval_bytes: int) -> None:
        self.interval_bytes = interval_bytes
        self.relative_offsets = array("I")
        self.positions = array("I")
        self._last_position = 0

    def __len__(self) -> int:
        return len(self.positions)

    def note_batch(self, relative_offset: int, position: int) -> None:
        """Called for every batch of the segment, in file order."""
        if position - self._last_position >= self.interval_bytes:
            self.relative_offsets.append(relative_offset)
            self.positions.append(position)
            self._last_position = position

    def cut_at(self, position: int) -> None:
        """Drop the entries at or past `position` (the data was truncated there), so that
        later batches get entries exactly where a rebuild from the data would put them."""
        keep = bisect_right(self.positions, position - 1)
        del self.relative_offsets[keep:], self.positions[keep:]
        self._last_position = self.positions[-1] if self.positions else 0

    def lookup(self, relative_offset: int) -> tuple[int, int]:
        """The last entry at or below `relative_offset`, as (relative offset, position)."""
        i = bisect_right(self.relative_offsets, relative_offset)
        if i == 0:
            return 0, 0
        return self.relative_offsets[i - 1], self.positions[i - 1]

    def last_entry(self) -> tuple[int, int]:
        if not self.positions:
            return 0, 0
        return self.relative_offsets[-1], self.positions[-1]

    def to_bytes(self) -> bytes:
        pairs = array("I", bytes(ENTRY_SIZE * len(self.positions)))
        pairs[0::2] = self.relative_offsets
        pairs[1::2] = self.positions
        if sys.byteorder == "little":
            pairs.byteswap()
        return pairs.tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, interval_bytes: int, data_size: int) -> "OffsetIndex | None":
        """Parse an `.index` file, or None if its shape cannot be an index of this data.

        Entries must be strictly increasing in both columns, never name the
        implicit first batch, and point at a whole header inside the data file.
        """
        if len(data) % ENTRY_SIZE:
            return None
        pairs = array("I")
        pairs.frombytes(data)
        if sys.byteorder == "little":
            pairs.byteswap()
        index = cls(interval_bytes)
        index.relative_offsets = pairs[0::2]
        index.positions = pairs[1::2]
        if index.positions:
            if index.positions[0] == 0 or index.relative_offsets[0] == 0:
                return None
            if index.positions[-1] + BATCH_HEADER_SIZE > data_size:
                return None
            if not (_strictly_increasing(index.positions) and _strictly_increasing(index.relative_offsets)):
                return None
            index._last_position = index.positions[-1]
        return index


def read_index_file(path: Path, interval_bytes: int, data_size: int) -> OffsetIndex | None:
    """The index stored at `path`, or None when it is missing or malformed."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    return OffsetIndex.from_bytes(data, interval_bytes, data_size)


def write_index_file(path: Path, index: OffsetIndex | bytes, *, fsync: bool = False) -> None:
    """Replace the file's content; fsync only when asked (the owner decides when durability is due)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        data = memoryview(index if isinstance(index, bytes) else index.to_bytes())
        while data:
            data = data[os.write(fd, data):]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
