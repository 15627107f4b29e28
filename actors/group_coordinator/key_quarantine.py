"""Key quarantine for `exclusive` groups (`quarantine_after` N > 0).

Theory of operation
-------------------
An exclusive group leases a partition's records in offset order to its one
owner, many at a time, several of one key among them. With quarantine on, the
partition state also gets an `ExclusiveQuarantine` in `state.keys` (the slot a
key_shared group's `key_order.KeyOrder` takes), which keeps a key column
(`key_order.KeyColumn`, fetched by the shell as for key_shared) and changes
leasing in two ways only:

* records are leased only up to the offset whose key hash is known, so a record
  that fails can always be traced to its key; and no ahead leases are granted
  (the core checks), since an ahead lease hands out records the coordinator has
  not looked at;
* while some key is *parked*, leasing checks each record it would hand out:
  records of a parked key are *held* (a range map, as in key_order) and leasing
  goes on past them, so every other key keeps flowing. The held records pin
  the committed offset (the blocker view says "quarantined").

A keyed record whose N-th delivery in a row ends in a nack or a timeout parks
its key (`park`). Then its ready and delayed records are held at once, and any
record of it that comes back later from a member (nack, timeout) is held
instead of requeued. Unlike key_shared, records of one key may be in flight
together, as always in exclusive groups: later records of a parked key leased
before the park stay with the member, an ack finishes them.

Releasing a key makes its held records ready, their attempts counted afresh
(reason "released"), or dead-letters them, in offset order. Parked keys are at
most MAX_PARKED_KEYS per partition: past that a failing record follows
`max_deliveries` as without quarantine (logged), which also bounds what is
persisted with the offsets.

After a restart the parked keys come back with the offsets (core.load_offsets);
their records, ready again with reason "restart", are held as leasing meets
them, which it does in offset order once their hashes are known.

Cost: nothing per record while no key is parked (ranges as before); while one
is, one hash lookup per record leased.
"""

from __future__ import annotations

from bisect import insort
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

from zbroker.actors.group_coordinator.key_order import (MAX_HELD, MAX_PARKED_KEYS, RELEASED, KeyColumn, ParkedKey,
                                                       quarantine_rows)
from zbroker.actors.group_coordinator.partition_state import NEW, Lease, Piece, Ready
from zbroker.actors.group_coordinator.ranges import RangeMap
from zbroker.protocol.batch import NO_KEY_HASH

if TYPE_CHECKING:
    from zbroker.actors.group_coordinator.partition_state import PartitionState


class ExclusiveQuarantine:
    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys  # not used by exclusive groups; kept so the core may set it alike
        self.column = KeyColumn()
        self.held: RangeMap[Ready] = RangeMap()
        self.pending: dict[int, list[int]] = {}  # parked key -> its held offsets, ascending
        self.parked: dict[int, ParkedKey] = {}
        self.paused: str | None = None
        self.paused_count = 0
        self.events: list[tuple[str, dict]] = []

    # -- leasing ------------------------------------------------------------------------

    def take(self, state: PartitionState, member_id: str, limit: int, log_end: int,
             now_ms: int, new_lease_id: Callable[[], int], ack_timeout_ms: int, max_pieces: int) -> list[Piece]:
        """Redeliveries first, then new records, in offset order, up to where key hashes are
        known, going past (and holding) the records of parked keys."""
        self._align(state)
        known_end = min(log_end, self.column.end)
        grants: list[Piece] = []
        deadline = now_ms + ack_timeout_ms
        for start, end, ready in state.ready.pieces(state.committed, known_end):
            runs = self._unparked_runs(state, start, end, ready) if self.parked else [(start, end)]
            for s, e in runs:
                if limit <= 0 or len(grants) >= max_pieces:
                    return grants
                e = min(e, s + limit)
                grants.append(state.lease_ready(s, e, ready, member_id, new_lease_id(), deadline, now_ms))
                limit -= e - s
        if limit <= 0 or state.ahead is not None or len(grants) >= max_pieces or known_end <= state.next_new:
            return grants
        if not self.parked:
            end = min(known_end, state.next_new + limit)
            runs = [[state.next_new, end]]
            state.next_new = end
        else:
            runs = self._new_runs(state, known_end, limit, max_pieces - len(grants), now_ms)
        if runs:
            lease = Lease(new_lease_id(), member_id, 1, NEW, deadline, now_ms)
            for s, e in runs:
                state.leased.set(s, e, lease)
                grants.append((s, e, lease))
        return grants

    def _new_runs(self, state: PartitionState, stop: int, limit: int, max_pieces: int,
                  now_ms: int) -> list[list[int]]:
        """New records from `next_new` to lease, holding those of parked keys on the way."""
        column, parked = self.column, self.parked
        base, hashes = column.base, column.hashes
        runs: list[list[int]] = []
        offset = state.next_new
        self.paused = None
        while offset < stop and limit > 0:
            h = hashes[offset - base]
            if h in parked:
                if self.held.count() >= MAX_HELD:
                    self.paused = "held"
                    self.paused_count += 1
                    break
                self._hold(offset, Ready(0, NEW, now_ms, now_ms), h)
            elif runs and runs[-1][1] == offset:
                runs[-1][1] += 1
                limit -= 1
            elif len(runs) >= max_pieces:
                break
            else:
                runs.append([offset, offset + 1])
                limit -= 1
            offset += 1
        state.next_new = offset
        return runs

    def _unparked_runs(self, state: PartitionState, start: int, end: int, ready: Ready) -> list[tuple[int, int]]:
        """The parts of ready [start, end) whose keys are not parked; the rest is held."""
        runs: list[list[int]] = []
        for offset in range(start, end):
            h = self.column.get(offset)
            if h in self.parked:
                state.ready.remove(offset, offset + 1)
                self._hold(offset, ready, h)
            elif runs and runs[-1][1] == offset:
                runs[-1][1] += 1
            else:
                runs.append([offset, offset + 1])
        return [(s, e) for s, e in runs]

    def _hold(self, offset: int, ready: Ready, h: int) -> None:
        self.held.set(offset, offset + 1, ready)
        insort(self.pending.setdefault(h, []), offset)

    def _align(self, state: PartitionState) -> None:
        """The column starts at or below the committed offset and reaches it."""
        column = self.column
        if column.base > state.committed or column.end < state.committed:
            column.reset(state.committed)

    # -- parking, releasing -----------------------------------------------------------------

    def park(self, state: PartitionState, offset: int, ready: Ready, now_ms: int) -> bool:
        """Hold record `offset` (just taken back from a member) and park its key if it is not
        yet. False: keyless, hash unknown, or no room for another parked key (the caller
        requeues it as usual)."""
        h = self.column.get(offset)
        if h is None or h == NO_KEY_HASH:
            return False
        if h not in self.parked:
            if len(self.parked) >= MAX_PARKED_KEYS:
                self.events.append(("quarantine_full", {"key_hash": h, "offset": offset,
                                                        "limit": MAX_PARKED_KEYS}))
                return False
            self.parked[h] = ParkedKey(now_ms, ready.reason, ready.failures)
            self.events.append(("key_quarantined", {"key_hash": h, "offset": offset,
                                                    "failures": ready.failures, "reason": ready.reason}))
            self._gather(state, h)
        self._hold(offset, ready, h)
        return True

    def _gather(self, state: PartitionState, h: int) -> None:
        """Hold the ready and delayed records of newly parked key `h` (their stale nack timers
        find nothing when they fire)."""
        for region in (state.ready, state.delayed):
            for start, end, ready in region.pieces(state.committed, self.column.end):
                for offset in range(start, end):
                    if self.column.get(offset) == h:
                        region.remove(offset, offset + 1)
                        self._hold(offset, ready, h)

    def release(self, state: PartitionState, h: int, to_dlq: bool,
                now_ms: int) -> list[tuple[int, int, Ready]] | None:
        """Release parked key `h`: its held records become ready, attempts counted afresh, or
        (`to_dlq`) are returned for the caller to dead-letter. None if `h` is not parked."""
        if self.parked.pop(h, None) is None:
            return None
        # Records of the key leased before the park are still out: their failures start
        # afresh too, or the next timeout of one parks the key again at once.
        for start, end, lease in list(state.leased.pieces(self.column.base, self.column.end)):
            if lease.failures:
                for offset in range(start, end):
                    if self.column.get(offset) == h:
                        state.leased.set(offset, offset + 1, replace(lease, failures=0))
        doomed = []
        for offset in self.pending.pop(h, []):
            ready = self.held.get(offset)
            if ready is None:
                continue
            self.held.remove(offset, offset + 1)
            if to_dlq:
                doomed.append((offset, offset + 1, ready))
            else:
                state.ready.set(offset, offset + 1, Ready(0, RELEASED, now_ms, now_ms))
        return doomed

    def finish(self, state: PartitionState, start: int, end: int) -> None:
        """Held records are never leased, so nothing finished was held: nothing to do."""

    def reset(self, state: PartitionState) -> None:
        """`committed` jumped (skip, reset): forget held offsets the caller removed."""
        self.pending = {h: kept for h, offsets in self.pending.items()
                        if (kept := [o for o in offsets if self.held.get(o) is not None])}
        self._align(state)

    def drop(self, state: PartitionState) -> None:
        """Quarantine is off for this group now: every held record is ready again."""
        for start, end, ready in self.held:
            state.ready.set(start, end, ready)
        self.held.clear()
        self.pending.clear()
        self.parked.clear()

    # -- reporting, hashes ------------------------------------------------------------------

    def report(self) -> dict:
        return {"held": self.held.count(), "quarantined_keys": len(self.parked),
                "held_limit_reached": self.paused == "held", "keys_known_to": self.column.end}

    def quarantine_report(self, now_ms: int) -> list[dict]:
        return quarantine_rows(self.parked, self.pending, now_ms)

    def hashes_wanted(self, state: PartitionState, log_end: int) -> int | None:
        if self.column.fetching or state.committed is None:
            return None
        self._align(state)
        return self.column.wanted_from(state.committed, log_end)
