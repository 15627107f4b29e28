"""Idempotent-producer state: which (producer_id, sequence) batches a partition already holds.

Theory of operation
-------------------
A producer that retries after a lost reply sends the same sequence again. The
log remembers the last `REMEMBERED_BATCHES` sequences of each producer with
their (base_offset, record_count), so a retry is answered with the
original offsets instead of being appended twice.

Sequences are per (producer, partition) and normally arrive in order, but a
pipelining producer may see a later batch land before an earlier one is
retried (the actor restarted with both in flight, and the earlier one timed
out). So the rule is:

* a remembered sequence is a duplicate: answer with its original offsets;
* a sequence above the highest one is new;
* a sequence at or above the producer's ``complete_from`` that is not
  remembered was never appended: it is a gap being filled, and is new. The
  log knows every batch of the producer from ``complete_from`` on: 0 while
  nothing was forgotten (so a pipelining producer whose batch 0 lands after
  its batch 1 is served), else just above the last batch it forgot;
* a sequence below ``complete_from`` cannot be vouched for and is refused
  with `DuplicateSequence`.

The state is not persisted on its own: recovery rebuilds it from the batch
headers of the last `producer_window_segments` segments, and the live log
forgets batches that fall out of that window (`forget_before`), so a reopened
log remembers exactly what the running one did.
"""

from __future__ import annotations

import heapq

from zbroker.protocol.errors import DuplicateSequence

REMEMBERED_BATCHES = 4096


class _Producer:
    __slots__ = ("batches", "highest", "order", "complete_from")

    def __init__(self) -> None:
        self.batches: dict[int, tuple[int, int]] = {}  # sequence -> (base_offset, record_count)
        self.highest = -1
        # Every batch of this producer at or above this sequence is in `batches`
        # (a producer numbers its batches from 0, and nothing was forgotten yet).
        self.complete_from = 0
        # Min-heap of remembered sequences, so the lowest is found and evicted in
        # O(log n) per append; entries already forgotten are skipped lazily.
        self.order: list[int] = []

    def lowest(self) -> int:
        while self.order[0] not in self.batches:
            heapq.heappop(self.order)
        return self.order[0]


class ProducerStates:
    def __init__(self) -> None:
        self._producers: dict[int, _Producer] = {}

    def __len__(self) -> int:
        return len(self._producers)

    def record(self, producer_id: int, sequence: int, base_offset: int, record_count: int) -> None:
        """Note an appended batch. Callers check the sequence first (`check`)."""
        state = self._producers.get(producer_id)
        if state is None:
            state = self._producers[producer_id] = _Producer()
        state.batches[sequence] = (base_offset, record_count)
        heapq.heappush(state.order, sequence)
        state.highest = max(state.highest, sequence)
        if len(state.batches) > REMEMBERED_BATCHES:
            evicted = state.lowest()
            del state.batches[evicted]
            state.complete_from = max(state.complete_from, evicted + 1)
        if len(state.order) > 2 * REMEMBERED_BATCHES:  # forgotten entries piled up: rebuild
            state.order = sorted(state.batches)

    def check(self, producer_id: int, sequence: int) -> tuple[int, int] | None:
        """None for a new batch, (base_offset, record_count) for a remembered one; raises otherwise."""
        if producer_id == 0:
            return None
        state = self._producers.get(producer_id)
        if state is None or not state.batches:
            return None
        remembered = state.batches.get(sequence)
        if remembered is not None:
            return remembered
        if sequence > state.highest or sequence >= state.complete_from:
            return None  # new, or a gap being filled: never appended
        raise DuplicateSequence(
            "sequence is below every batch this log remembers for the producer",
            producer_id=producer_id, sequence=sequence, last_sequence=state.highest,
            oldest_remembered_sequence=state.lowest())

    def only_remembered_is_known(self) -> None:
        """For state rebuilt from part of a log (older segments not scanned, or deleted):
        below each producer's lowest remembered batch, nothing can be vouched for."""
        for state in self._producers.values():
            if state.batches:
                state.complete_from = max(state.complete_from, state.lowest())

    def forget_before(self, offset: int) -> None:
        """Drop batches that start below `offset` (they left the rebuild window)."""
        for producer_id in list(self._producers):
            state = self._producers[producer_id]
            for seq in [q for q, (base, _count) in state.batches.items() if base < offset]:
                del state.batches[seq]
                state.complete_from = max(state.complete_from, seq + 1)
            if not state.batches:
                del self._producers[producer_id]

    def snapshot(self) -> dict[int, list[tuple[int, int, int]]]:
        """Every producer's remembered batches (sequence, base, count) by sequence, for tests and diagnostics."""
        return {producer_id: [(q, b, c) for q, (b, c) in sorted(state.batches.items())]
                for producer_id, state in self._producers.items()}
