"""Offset ranges: sorted, disjoint, half-open ``[start, end)`` intervals.

The group coordinator keeps every per-record fact (leased, ready, acked,
dead-lettering, attempt count) as ranges so that its cost follows the number
of *gaps* in the offset space, not the number of records: a million leased
records under one lease are one entry.

`RangeMap` maps ranges to values. Setting a range overwrites whatever was
there (splitting neighbours at the edges) and merges with an adjacent entry
whose value is equal, so uniform state stays one entry. `RangeSet` is a
`RangeMap` whose only value is ``True``; adding therefore unions.

Entries live in three parallel Python lists searched with `bisect`; an
insert or delete moves list memory (fast memmove), and every operation is
``O(log n + k)`` list work for ``n`` entries and ``k`` entries touched.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Generic, Iterator, TypeVar

V = TypeVar("V")


class RangeMap(Generic[V]):
    """Sorted disjoint half-open ranges, each carrying a value."""

    __slots__ = ("_starts", "_ends", "_values", "_count")

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._values: list[V] = []
        self._count = 0

    # -- introspection --------------------------------------------------------------

    def __len__(self) -> int:
        """Number of entries (ranges), not offsets."""
        return len(self._starts)

    def __bool__(self) -> bool:
        return bool(self._starts)

    def count(self) -> int:
        """Number of offsets covered (kept up to date, not summed)."""
        return self._count

    def __iter__(self) -> Iterator[tuple[int, int, V]]:
        # A snapshot, so callers may move entries elsewhere while iterating.
        return iter(list(zip(self._starts, self._ends, self._values)))

    def first(self) -> tuple[int, int, V] | None:
        return (self._starts[0], self._ends[0], self._values[0]) if self._starts else None

    def last(self) -> tuple[int, int, V] | None:
        return (self._starts[-1], self._ends[-1], self._values[-1]) if self._starts else None

    def entry_at(self, offset: int) -> tuple[int, int, V] | None:
        """The whole entry covering `offset`, or None."""
        i = bisect_right(self._starts, offset) - 1
        if i >= 0 and self._ends[i] > offset:
            return self._starts[i], self._ends[i], self._values[i]
        return None

    def get(self, offset: int) -> V | None:
        entry = self.entry_at(offset)
        return entry[2] if entry else None

    def _span(self, start: int, end: int) -> tuple[int, int]:
        """Index range [i, j) of the entries overlapping [start, end)."""
        i = bisect_right(self._starts, start) - 1
        if i < 0 or self._ends[i] <= start:
            i += 1
        j = bisect_left(self._starts, end)
        return i, j

    def pieces(self, start: int, end: int) -> list[tuple[int, int, V]]:
        """The parts of entries inside [start, end), clipped to it, in order."""
        if start >= end:
            return []
        i, j = self._span(start, end)
        return [(max(self._starts[k], start), min(self._ends[k], end), self._values[k])
                for k in range(i, j)]

    # -- mutation -------------------------------------------------------------------

    def remove(self, start: int, end: int) -> list[tuple[int, int, V]]:
        """Uncover [start, end); return the removed pieces (clipped), in order."""
        if start >= end:
            return []
        i, j = self._span(start, end)
        if i >= j:
            return []
        starts, ends, values = self._starts, self._ends, self._values
        removed = [(max(starts[k], start), min(ends[k], end), values[k]) for k in range(i, j)]
        keep_s: list[int] = []
        keep_e: list[int] = []
        keep_v: list[V] = []
        if starts[i] < start:  # the left neighbour keeps its head
            keep_s.append(starts[i]); keep_e.append(start); keep_v.append(values[i])
        if ends[j - 1] > end:  # the right neighbour keeps its tail
            keep_s.append(end); keep_e.append(ends[j - 1]); keep_v.append(values[j - 1])
        starts[i:j] = keep_s
        ends[i:j] = keep_e
        values[i:j] = keep_v
        self._count -= sum(e - s for s, e, _ in removed)
        return removed

    def set(self, start: int, end: int, value: V) -> None:
        """Cover [start, end) with `value`, replacing what was there."""
        if start >= end:
            return
        self.remove(start, end)
        self._count += end - start  # merged neighbours were counted already
        starts, ends, values = self._starts, self._ends, self._values
        i = bisect_left(starts, start)
        # Merge with equal neighbours so that uniform state stays one entry.
        if i > 0 and ends[i - 1] == start and values[i - 1] == value:
            i -= 1
            start = starts[i]
            del starts[i], ends[i], values[i]
        if i < len(starts) and starts[i] == end and values[i] == value:
            end = ends[i]
            del starts[i], ends[i], values[i]
        starts.insert(i, start)
        ends.insert(i, end)
        values.insert(i, value)

    def clear(self) -> None:
        self._starts.clear()
        self._ends.clear()
        self._values.clear()
        self._count = 0


class RangeSet:
    """Sorted disjoint half-open ranges of offsets (adjacent ranges merge)."""

    __slots__ = ("_map",)

    def __init__(self, ranges: "list[tuple[int, int]] | None" = None) -> None:
        self._map: RangeMap[bool] = RangeMap()
        for start, end in ranges or ():
            self.add(start, end)

    def add(self, start: int, end: int) -> None:
        self._map.set(start, end, True)

    def remove(self, start: int, end: int) -> int:
        """Remove [start, end); return how many offsets were in the set."""
        return sum(e - s for s, e, _ in self._map.remove(start, end))

    def contains(self, offset: int) -> bool:
        return self._map.entry_at(offset) is not None

    __contains__ = contains

    def first_gap_from(self, offset: int) -> int:
        """The first offset >= `offset` that is not in the set."""
        entry = self._map.entry_at(offset)
        return entry[1] if entry else offset  # entries never touch, so `end` is a gap

    def intersection(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of [start, end) in the set."""
        return [(s, e) for s, e, _ in self._map.pieces(start, end)]

    def gaps(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of [start, end) not in the set."""
        out = []
        cursor = start
        for s, e, _ in self._map.pieces(start, end):
            if s > cursor:
                out.append((cursor, s))
            cursor = e
        if cursor < end:
            out.append((cursor, end))
        return out

    def first(self) -> tuple[int, int] | None:
        entry = self._map.first()
        return entry[:2] if entry else None

    def last(self) -> tuple[int, int] | None:
        entry = self._map.last()
        return entry[:2] if entry else None

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((s, e) for s, e, _ in self._map)

    def len_ranges(self) -> int:
        return len(self._map)

    def count(self) -> int:
        return self._map.count()

    def __bool__(self) -> bool:
        return bool(self._map)

    def clear(self) -> None:
        self._map.clear()

    def __repr__(self) -> str:
        return f"RangeSet({list(self)!r})"
