"""Leader-epoch cache of one replicated partition: which leader epoch wrote which offsets.

Theory of operation
-------------------
Stored batches carry no leader epoch (their bytes are the wire format and
predate replication), so a replicated partition keeps, beside its segments,
the list of ``(epoch, start_offset)`` pairs: epoch ``e`` wrote the offsets
from its start up to the next entry's start (the last one: up to the log
end). Epochs and start offsets both strictly increase; an epoch that wrote
nothing before the next one began is replaced by it (same start offset).

This is what lets a follower find where its log and the leader's part
(KIP-101 / KIP-279): the follower sends the epoch of its last record, and
the leader answers with the end of that epoch in its own log
(`end_offset_for`). Truncating by high watermark alone loses acknowledged
records or keeps divergent ones; by epoch it does neither.

The checkpoint file ``leader-epoch-checkpoint`` is replaced atomically
(written to a temporary file, fsynced, renamed, directory fsynced) on every
change. Changes are rare (one per leadership change, and truncations), so
each one is made durable at once, before anything relies on it: a follower
truncates, and a leader appends in its epoch, only after the entry that
describes it is on disk. An unreplicated partition never has the file.

Retention deleting old segments moves the first entry's start up to the new
log start (`truncate_from_start`), and drops entries wholly below it.

After a crash the checkpoint may name starts beyond the recovered log end
(the log lost an unsynced tail, or a truncation stopped between cutting the
segments and rewriting the checkpoint): `trimmed_to(log_end)` drops those on
open, so the cache never describes offsets the log does not hold.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from pathlib import Path

CHECKPOINT_NAME = "leader-epoch-checkpoint"
_HEADER = "zbroker-leader-epochs 1"
NO_EPOCH = -1


class CorruptEpochCheckpoint(ValueError):
    """The checkpoint cannot be parsed: without it no truncation point can be trusted."""


class LeaderEpochCache:
    __slots__ = ("path", "_epochs", "_starts")

    def __init__(self, path: Path, entries: list[tuple[int, int]] | None = None) -> None:
        self.path = Path(path)
        self._epochs: list[int] = [epoch for epoch, _ in entries or ()]
        self._starts: list[int] = [start for _, start in entries or ()]

    @classmethod
    def load(cls, directory: Path) -> "LeaderEpochCache":
        """The cache stored in `directory`; empty (and no file written) when there is none."""
        path = Path(directory) / CHECKPOINT_NAME
        try:
            text = path.read_text()
        except FileNotFoundError:
            return cls(path)
        lines = text.splitlines()
        if not lines or lines[0] != _HEADER:
            raise CorruptEpochCheckpoint(f"{path}: not a leader-epoch checkpoint")
        entries: list[tuple[int, int]] = []
        for line in lines[1:]:
            parts = line.split()
            try:
                epoch, start = int(parts[0]), int(parts[1])
            except (IndexError, ValueError):
                raise CorruptEpochCheckpoint(f"{path}: bad line {line!r}") from None
            if len(parts) != 2 or epoch < 0 or start < 0 or (
                    entries and (epoch <= entries[-1][0] or start <= entries[-1][1])):
                raise CorruptEpochCheckpoint(f"{path}: entries must be increasing, got {line!r}")
            entries.append((epoch, start))
        return cls(path, entries)

    # -- queries ---------------------------------------------------------------------------

    def entries(self) -> list[tuple[int, int]]:
        return list(zip(self._epochs, self._starts))

    def __len__(self) -> int:
        return len(self._epochs)

    @property
    def latest_epoch(self) -> int:
        return self._epochs[-1] if self._epochs else NO_EPOCH

    def epoch_at(self, offset: int) -> int:
        """The epoch that wrote `offset`, NO_EPOCH below the first entry."""
        i = bisect_right(self._starts, offset)
        return self._epochs[i - 1] if i else NO_EPOCH

    def end_offset_for(self, epoch: int, log_end: int) -> tuple[int, int]:
        """(the largest epoch <= `epoch` here, the offset just past what it wrote).

        (NO_EPOCH, NO_EPOCH) when every entry is of a later epoch: the asker's
        records of that epoch are unknown here (KIP-279's "undefined").
        """
        i = bisect_right(self._epochs, epoch)
        if i == 0:
            return NO_EPOCH, NO_EPOCH
        end = self._starts[i] if i < len(self._starts) else log_end
        return self._epochs[i - 1], end

    def entries_from(self, offset: int) -> list[list[int]]:
        """The entries that describe offsets from `offset` on (the one covering it first)."""
        i = max(bisect_right(self._starts, offset) - 1, 0)
        return [[e, s] for e, s in zip(self._epochs[i:], self._starts[i:])]

    # -- changes (each one durable before it returns) --------------------------------------

    def assign(self, epoch: int, start_offset: int) -> bool:
        """Epoch `epoch` writes from `start_offset` on. Returns whether anything changed.

        An epoch at or below the latest one is ignored (it is already known, or
        it is a stale leader's). An entry whose epoch wrote nothing (its start
        equals the new one's) is replaced.
        """
        if self._epochs and epoch <= self._epochs[-1]:
            return False
        if self._starts and start_offset < self._starts[-1]:
            raise ValueError(f"epoch {epoch} cannot start at {start_offset}, below the latest "
                             f"entry's start {self._starts[-1]}: truncate first")
        while self._starts and self._starts[-1] == start_offset:
            self._epochs.pop()
            self._starts.pop()
        self._epochs.append(epoch)
        self._starts.append(start_offset)
        self._write()
        return True

    def truncate_from_end(self, offset: int) -> bool:
        """Forget entries that start at or after `offset` (the log is cut there)."""
        keep = bisect_right(self._starts, offset - 1) if offset > 0 else 0
        if keep == len(self._starts):
            return False
        del self._epochs[keep:], self._starts[keep:]
        self._write()
        return True

    def truncate_from_start(self, log_start: int) -> bool:
        """Retention moved the log start: forget the epochs wholly below it, and start the one
        that covers it there (KIP-101's truncateFromStart). Entries that described deleted
        segments would answer a follower's `end_offset_for` with offsets nobody holds.
        Returns whether anything changed."""
        covering = bisect_right(self._starts, log_start) - 1
        if covering < 0 or (covering == 0 and self._starts[0] == log_start):
            return False
        del self._epochs[:covering], self._starts[:covering]
        self._starts[0] = log_start
        self._write()
        return True

    def trimmed_to(self, log_end: int) -> bool:
        """On open: drop entries starting beyond the recovered log end. Empty entries at the
        very end (start == log_end) are kept: the epoch began there and wrote nothing yet."""
        keep = bisect_right(self._starts, log_end)
        if keep == len(self._starts):
            return False
        del self._epochs[keep:], self._starts[keep:]
        self._write()
        return True

    def clear(self) -> None:
        self._epochs.clear()
        self._starts.clear()
        self._write()

    def _write(self) -> None:
        text = "\n".join([_HEADER, *(f"{e} {s}" for e, s in zip(self._epochs, self._starts))]) + "\n"
        temporary = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            data = memoryview(text.encode())
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, self.path)
        fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
