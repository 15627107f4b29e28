"""Per-key order for `key_shared` groups, and key quarantine.

Theory of operation
-------------------
A `key_shared` group lets every member lease from every partition (like
`shared`) but keeps one rule per key: a record with key K is leased only
when every earlier record of K in the partition is finished (acked or
dead-lettered). So at most one record of a key is ever in flight, and a
key's records are delivered in offset order, whoever gets them.

The coordinator never reads record bytes for this. It keeps, per partition
and shared by all groups, a `KeyColumn`: one 32-bit key hash per offset
(`protocol.batch.key_hash`), filled from fetches the shell makes for the
offsets about to be leased. A collision of two keys only orders them as one
key (safe). Keyless records (hash 0) are never ordered: they flow as in
`shared`.

Per (group, partition), `KeyOrder` holds the only per-key state there is:
`pending`, for each key with an unfinished record in [committed, next_new),
its unfinished offsets in order. The head of a key's list is the one record
of that key that may be leased (it is leased, ready, delayed or
dead-lettering); every other one is *held* (`held`, a range map of the Ready
value it will have once it is the head). Finishing the head makes the next
record of that key the head: held -> ready. A key leaves `pending` when its
last record finishes, so the state is bounded by the keys in flight or held
back; `max_keys` bounds it (a new key past that pauses new leasing, reported
as `key_limit_reached`), and `MAX_HELD` bounds the held records.

Records are *classified* (entered into `pending`) in offset order as their
hashes arrive; `classified_to` is the first offset not classified. Records
below it that were delivered before the group became key_shared (a restart,
a mode change) are classified the same way: a ready one that is not its
key's head is moved to `held`, so the rule holds from then on.

Quarantine: when a head record has failed (nack or timeout) `quarantine_after`
times in a row, its key is *parked*: the record goes to `held`, and as every
later record of the key is held behind it anyway, nothing of the key is
delivered until an operator releases it, to flow again (the head becomes
ready, its attempts counted afresh) or to the dead-letter topic (every held
record of the key is dead-lettered, in order).
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from zbroker.actors.group_coordinator.partition_state import NEW, Lease, Piece, Ready
from zbroker.actors.group_coordinator.ranges import RangeMap
from zbroker.protocol.batch import NO_KEY_HASH

if TYPE_CHECKING:
    from zbroker.actors.group_coordinator.partition_state import PartitionState

# Held records per partition and group, at most (each is an entry in its key's list).
MAX_HELD = 100_000
# Key hashes kept per partition beyond the lowest committed offset of its key_shared groups.
KEY_WINDOW = 1_000_000
RELEASED = "released"
# Parked keys per partition and group, at most; each is persisted with the offsets
# ([hash, failures, reason of up to 200 bytes]), so 1000 keep a row under 256 KB.
MAX_PARKED_KEYS = 1000


class KeyColumn:
    """The key hash of each offset in [base, end) of one partition (4 bytes each)."""

    __slots__ = ("base", "hashes", "fetching", "retry_at_ms")

    def __init__(self, base: int = 0) -> None:
        self.base = base
        self.hashes = array("I")
        self.fetching = False  # a fetch for [end, ...) is under way
        self.retry_at_ms = 0   # after a failed fetch, not before this

    @property
    def end(self) -> int:
        return self.base + len(self.hashes)

    def get(self, offset: int) -> int | None:
        i = offset - self.base
        return self.hashes[i] if 0 <= i < len(self.hashes) else None

    def add(self, start: int, hashes: list[int]) -> None:
        """Hashes of offsets [start, start + len(hashes)); what is known already is kept."""
        if start > self.end:  # retention moved the log start past what we had
            self.reset(start)
        skip = self.end - start
        if skip < len(hashes):
            self.hashes.extend(hashes[skip:])

    def reset(self, base: int) -> None:
        self.base, self.hashes = base, array("I")

    def wanted_from(self, committed: int, log_end: int) -> int | None:
        """The offset to fetch hashes from next (None: all known, or far enough ahead),
        after forgetting most of what is below `committed`."""
        self.trim_below(committed)
        if self.end >= log_end or self.end >= committed + KEY_WINDOW:
            return None
        return self.end

    def trim_below(self, offset: int) -> None:
        """Forget hashes below `offset`, when that frees most of the column (a copy)."""
        cut = offset - self.base
        if cut > 4096 and cut * 2 > len(self.hashes):
            self.hashes = self.hashes[cut:]
            self.base = offset


@dataclass(slots=True)
class ParkedKey:
    """A quarantined key: its head record failed `failures` times in a row."""
    since_ms: int
    reason: str
    failures: int


def parked_rows(parked: dict[int, ParkedKey]) -> list[list]:
    """The parked keys as persisted with the offsets: [[key_hash, failures, reason], ...]."""
    return [[h, info.failures, info.reason] for h, info in parked.items()]


def parked_from_rows(rows: list, now_ms: int) -> dict[int, ParkedKey]:
    """Parked keys loaded after a restart. Their age counts from the load: the stored
    times were another process's monotonic clock."""
    return {h: ParkedKey(now_ms, reason, failures) for h, failures, reason in rows[:MAX_PARKED_KEYS]}


class KeyOrder:
    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys
        # This group's own: a column shared by the groups of a partition would have to be
        # refetched from a lower offset when a group starts below it, and the others'
        # records in flight meanwhile could not be finished by key.
        self.column = KeyColumn()
        self.pending: dict[int, deque[int]] = {}
        self.held: RangeMap[Ready] = RangeMap()
        self.parked: dict[int, ParkedKey] = {}
        self.classified_to: int | None = None
        self.paused: str | None = None  # why the last take stopped short of the log: "keys" | "held"
        self.paused_count = 0           # takes that stopped so
        self.events: list[tuple[str, dict]] = []  # for the core's log (parked keys)

    # -- leasing ------------------------------------------------------------------------

    def take(self, state: PartitionState, member_id: str, limit: int, log_end: int,
             now_ms: int, new_lease_id: Callable[[], int], ack_timeout_ms: int, max_pieces: int) -> list[Piece]:
        """Lease up to `limit` records that their keys allow: ready heads and keyless records
        first, in offset order, then new ones as far as their hashes are known. All of one
        call's pieces share one lease id."""
        column = self.column
        self.classify(state, min(state.next_new, column.end))
        grants: list = []
        deadline = now_ms + ack_timeout_ms
        lease_id = 0
        for start, end, ready in state.ready.pieces(state.committed, self.classified_to):
            if limit <= 0 or len(grants) >= max_pieces:
                break
            for s, e in self._eligible_runs(state, start, end, ready):
                if limit <= 0 or len(grants) >= max_pieces:
                    break
                e = min(e, s + limit)
                lease_id = lease_id or new_lease_id()
                state.ready.remove(s, e)
                lease = Lease(lease_id, member_id, ready.attempts + 1, ready.reason, deadline, now_ms, ready.failures)
                state.leased.set(s, e, lease)
                grants.append((s, e, lease))
                if ready.attempts:
                    state.redeliveries += e - s
                limit -= e - s
        if self.classified_to != state.next_new or state.ahead is not None:
            return grants
        self.paused = None
        offset, stop = state.next_new, min(log_end, column.end)
        if offset < column.base:  # retention moved the column past next_new: skip_to follows
            return grants
        runs: list[list[int]] = []
        base, hashes, pending, held = column.base, column.hashes, self.pending, self.held
        while offset < stop and limit > 0:
            h = hashes[offset - base]
            if h != NO_KEY_HASH:
                keyed = pending.get(h)
                if keyed is None and h in self.parked:  # parked, loaded so, with nothing unfinished
                    keyed = pending[h] = deque()
                if keyed is not None:  # an earlier record of the key is unfinished (or parked): held
                    if held.count() >= MAX_HELD:
                        self.paused = "held"
                        break
                    keyed.append(offset)
                    held.set(offset, offset + 1, Ready(0, NEW, now_ms, now_ms))
                    offset += 1
                    continue
                if len(pending) >= self.max_keys:
                    self.paused = "keys"
                    break
            if runs and runs[-1][1] == offset:
                runs[-1][1] += 1
            elif len(grants) + len(runs) >= max_pieces:
                break  # no piece left in the reply for it
            else:
                runs.append([offset, offset + 1])
            if h != NO_KEY_HASH:
                pending[h] = deque((offset,))
            limit -= 1
            offset += 1
        if self.paused:
            self.paused_count += 1
        if runs:
            lease = Lease(lease_id or new_lease_id(), member_id, 1, NEW, deadline, now_ms)
            for s, e in runs:
                state.leased.set(s, e, lease)
                grants.append((s, e, lease))
        state.next_new = self.classified_to = offset
        return grants

    def _eligible_runs(self, state: PartitionState, start: int, end: int,
                       ready: Ready) -> list[tuple[int, int]]:
        """The parts of ready [start, end) that may be leased: keyless records and heads of
        keys not parked. A keyed record that is not (a delayed nack released behind an
        earlier record, a parked head) moves to `held`."""
        runs: list[list[int]] = []
        column = self.column
        for offset in range(start, end):
            h = column.get(offset)
            if h is not None and h != NO_KEY_HASH:
                keyed = self.pending.get(h)
                if keyed is not None and (keyed[0] != offset or h in self.parked):
                    state.ready.remove(offset, offset + 1)
                    self.held.set(offset, offset + 1, ready)
                    continue
            if runs and runs[-1][1] == offset:
                runs[-1][1] += 1
            else:
                runs.append([offset, offset + 1])
        return [(s, e) for s, e in runs]

    def classify(self, state: PartitionState, upto: int) -> None:
        """Enter the unfinished records of [classified_to, upto) into their keys' lists."""
        if self.classified_to is None or self.classified_to < state.committed:
            self.classified_to = state.committed
        if self.column.end < self.classified_to or self.column.base > self.classified_to:
            self.column.reset(self.classified_to)  # new, or what it held is all below committed
        if upto <= self.classified_to:
            return
        column = self.column
        for gap_start, gap_end in state.finished.gaps(self.classified_to, upto):
            for offset in range(gap_start, gap_end):
                h = column.get(offset)
                if h is None or h == NO_KEY_HASH:
                    continue
                keyed = self.pending.get(h)
                if keyed is None:
                    self.pending[h] = deque((offset,))
                    continue
                keyed.append(offset)
                ready = state.ready.get(offset)
                if ready is not None:
                    state.ready.remove(offset, offset + 1)
                    self.held.set(offset, offset + 1, ready)
        self.classified_to = upto

    # -- finishing, parking, releasing ------------------------------------------------------

    def finish(self, state: PartitionState, start: int, end: int) -> None:
        """Records [start, end) are finished: the next record of each of their keys may go."""
        column = self.column
        for offset in range(start, min(end, self.classified_to or start)):
            h = column.get(offset)
            if h is None or h == NO_KEY_HASH:
                continue
            keyed = self.pending.get(h)
            if keyed is None:
                continue
            if keyed[0] == offset:
                keyed.popleft()
            else:
                try:
                    keyed.remove(offset)  # delivered before the group was key_shared
                except ValueError:
                    continue
            if not keyed:
                del self.pending[h]
                self.parked.pop(h, None)
            elif h not in self.parked:
                self._promote(state, keyed[0])

    def _promote(self, state: PartitionState, offset: int) -> None:
        ready = self.held.get(offset)
        if ready is not None:
            self.held.remove(offset, offset + 1)
            state.ready.set(offset, offset + 1, ready)

    def park(self, state: PartitionState, offset: int, ready: Ready,
             now_ms: int) -> bool:
        """Quarantine the key of head record `offset` (which failed `ready.failures` times
        in a row). False for a keyless record, which has no key to park."""
        h = self.column.get(offset)
        if h is None or h == NO_KEY_HASH or h not in self.pending:
            return False
        if h not in self.parked and len(self.parked) >= MAX_PARKED_KEYS:
            self.events.append(("quarantine_full", {"key_hash": h, "offset": offset, "limit": MAX_PARKED_KEYS}))
            return False
        self.held.set(offset, offset + 1, ready)
        if h not in self.parked:
            self.parked[h] = ParkedKey(now_ms, ready.reason, ready.failures)
            self.events.append(("key_quarantined", {"key_hash": h, "offset": offset,
                                                    "failures": ready.failures, "reason": ready.reason}))
        return True

    def release(self, state: PartitionState, h: int, to_dlq: bool, now_ms: int) -> list[tuple[int, int, Ready]] | None:
        """Release parked key `h`. To flow: its head becomes ready with its attempts counted
        afresh; returns []. To the dead-letter topic: returns the held records of the key
        (removed from `held`), which the caller dead-letters. None if `h` is not parked."""
        if self.parked.pop(h, None) is None:
            return None
        keyed = self.pending.get(h)
        if not keyed:
            return []
        if not to_dlq:
            head = keyed[0]
            if self.held.get(head) is not None:
                self.held.remove(head, head + 1)
                state.ready.set(head, head + 1, Ready(0, RELEASED, now_ms, now_ms))
            return []
        doomed = []
        for offset in keyed:
            ready = self.held.get(offset)
            if ready is not None:
                self.held.remove(offset, offset + 1)
                doomed.append((offset, offset + 1, ready))
        return doomed

    def reset(self, state: PartitionState) -> None:
        """Forget the classification (a skip or reset moved `committed`); held records become
        ready again and are classified anew from `committed`. Parked keys stay parked."""
        for start, end, ready in self.held:
            if start >= state.committed:
                state.ready.set(start, end, ready)
        self.held.clear()
        self.pending.clear()
        self.classified_to = state.committed
        if self.column.end < state.committed or self.column.base > state.committed:
            self.column.reset(state.committed)

    def drop(self, state: PartitionState) -> None:
        """The group is no longer key_shared: every held record is ready again."""
        for start, end, ready in self.held:
            state.ready.set(start, end, ready)
        self.held.clear()

    def report(self) -> dict:
        """The key_shared fields of a partition in describe_group."""
        return {"keys_pending": len(self.pending), "held": self.held.count(), "quarantined_keys": len(self.parked),
                "max_keys": self.max_keys, "key_limit_reached": self.paused == "keys",
                "held_limit_reached": self.paused == "held", "key_limit_pauses": self.paused_count,
                "keys_known_to": self.column.end}

    def hashes_wanted(self, state: PartitionState, log_end: int) -> int | None:
        """The offset to fetch key hashes from next, or None: none wanted, or a fetch is
        under way. Trims what is below the committed offset first."""
        column = self.column
        if column.fetching or state.committed is None:
            return None
        if self.classified_to is None:
            self.classify(state, state.committed)
        return column.wanted_from(state.committed, log_end)

    def quarantine_report(self, now_ms: int) -> list[dict]:
        return quarantine_rows(self.parked, self.pending, now_ms)


def quarantine_rows(parked: dict, pending: dict, now_ms: int) -> list[dict]:
    """`list_quarantine` rows: each parked key with the offsets of it held back (both modes)."""
    out = []
    for h, info in parked.items():
        held = pending.get(h) or ()
        out.append({"key_hash": h, "first_offset": held[0] if held else None, "held": len(held),
                    "age_ms": now_ms - info.since_ms, "reason": info.reason, "failures": info.failures})
    return out
