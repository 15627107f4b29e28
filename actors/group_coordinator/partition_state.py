"""Where one consumer group stands in one topic-partition, kept as ranges.

The offsets of a partition, seen by one group, fall into these regions::

    [0, committed)            finished, forgotten (committed = first offset not finished)
    [committed, next_new)     each offset in exactly one of:
                                finished        acked or dead-lettered (the "holes")
                                leased          handed to a member under a lease id
                                ready           deliverable again now (timeout, nack, rebalance, restart)
                                delayed         nacked with a delay; moves to `ready` on time
                                dead_lettering  being copied to the dead-letter topic
    [next_new, log_end)       never delivered ("new")
    [next_new, ahead.end)     exclusive groups: leased to one member before the records exist
                              (an "ahead" lease); each becomes `leased` when the log reaches it

Every region is a `RangeMap`/`RangeSet`, so a million records leased under
one lease are one entry. Attempt counts live in the `Lease`/`Ready`/
`DeadLettering` values: a range's value says how many times its records were
handed out, so equal neighbours merge and cost stays per range.

This module only moves ranges between regions. Decisions that need the rest
of the group (who may lease, member counters, effects) are made by
`core.GroupCoordinatorCore`, which owns these objects.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_right
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

from zbroker.actors.group_coordinator.ranges import RangeMap, RangeSet

NEW, TIMEOUT, REBALANCE, RESTART, AHEAD = "new", "timeout", "rebalance", "restart", "ahead"
# Loaded by a coordinator that took over from another node (issue 26), not restarted.
COORDINATOR_FAILOVER = "coordinator_failover"
QUARANTINE_RELEASE = "quarantine_release"  # the reason of a record released to the dead-letter topic


def reason_kind(reason: str) -> str:
    """The fixed word of a reason: "nack:<client text>" is "nack"."""
    return reason.split(":", 1)[0]


@dataclass(frozen=True, slots=True)
class Lease:
    """Records handed to `member_id`; `attempt` counts deliveries including this one,
    `failures` the nacks and timeouts in a row before it (what key quarantine counts: a
    revocation is a delivery but not a failure)."""
    lease_id: int
    member_id: str
    attempt: int
    reason: str
    deadline_ms: int
    since_ms: int
    failures: int = 0


@dataclass(frozen=True, slots=True)
class Ready:
    """Records delivered `attempts` times, `failures` of them in a row ending in a nack or a
    timeout, that may be delivered again at `ready_at_ms`."""
    attempts: int
    reason: str
    ready_at_ms: int
    since_ms: int
    failures: int = 0


@dataclass(frozen=True, slots=True)
class DeadLettering:
    """Records on their way to the dead-letter topic.

    `id` names this dead-lettering, so that a confirmation for an earlier one of the
    same offset (a copy started before a reset, reported after the record was
    rejected again) cannot finish or fail this one.
    """
    attempts: int
    last_reason: str
    since_ms: int
    id: int
    failed: bool = False  # the shell's copy failed; a retry is scheduled
    drop_value: bool = False  # the full copy was refused TOO_LARGE: copy it without its value


@dataclass(slots=True)
class Ahead:
    """Offsets [next_new, end) leased to `member_id` under `lease_id` before they exist.

    The member reads them with a parked fetch and hands each out as it arrives,
    so a new record reaches it without a poll round trip. Each record's lease
    (and ack timer) starts when the coordinator learns it exists (`fill_ahead`).
    Acks that arrive before that are kept in `early` and applied then.
    """
    lease_id: int
    member_id: str
    end: int
    early: RangeSet = field(default_factory=RangeSet)

    def as_lease(self) -> "Lease":
        return Lease(self.lease_id, self.member_id, 1, AHEAD, 0, 0)


Piece = tuple[int, int, Lease]  # [start, end) of one lease


class LogRange:
    """What the coordinator knows of one topic-partition log, shared by all groups.

    It also remembers, at about one-second resolution, when each offset was first
    seen to exist, so lag can be reported as an age ("oldest unfinished record
    appeared N ms ago") and not only as a count.
    """

    SEEN_RESOLUTION_MS = 1000
    MAX_SEEN_STEPS = 4096

    def __init__(self) -> None:
        self.start = 0
        self.end = 0
        self._seen_ends: list[int] = []  # offsets below _seen_ends[i] (and above i-1) ...
        self._seen_ms: list[int] = []    # ... were first seen at _seen_ms[i]

    def update(self, log_start: int, log_end: int, now_ms: int) -> None:
        if log_end > self.end or not self._seen_ends:
            if self._seen_ms and now_ms - self._seen_ms[-1] < self.SEEN_RESOLUTION_MS:
                self._seen_ends[-1] = max(self._seen_ends[-1], log_end)
            elif log_end > 0:
                self._seen_ends.append(log_end)
                self._seen_ms.append(now_ms)
        self.start, self.end = log_start, log_end
        self.forget_below(log_start)
        if len(self._seen_ends) > self.MAX_SEEN_STEPS:
            # Halve the resolution; merged steps keep the older time, so ages err high.
            self._seen_ends = self._seen_ends[1::2] + ([self._seen_ends[-1]] if len(self._seen_ends) % 2 else [])
            self._seen_ms = self._seen_ms[0::2]

    def forget_below(self, offset: int) -> None:
        cut = bisect_right(self._seen_ends, offset)
        if cut:
            del self._seen_ends[:cut], self._seen_ms[:cut]

    def first_seen_ms(self, offset: int) -> int | None:
        i = bisect_right(self._seen_ends, offset)
        return self._seen_ms[i] if i < len(self._seen_ms) else None


class PartitionState:
    """One group's progress and outstanding work in one topic-partition."""

    def __init__(self, topic: str, partition: int,
                 new_dead_lettering_id: Callable[[], int] | None = None) -> None:
        self.topic = topic
        self.partition = partition
        # Unique across every state the coordinator makes (a state made afresh for the
        # same partition must not reuse an id an old confirmation may still carry).
        self._new_dead_lettering_id = new_dead_lettering_id or itertools.count(1).__next__
        self.committed: int | None = None  # None until a start position is known
        self.next_new = 0
        self.finished = RangeSet()
        self.leased: RangeMap[Lease] = RangeMap()
        self.ready: RangeMap[Ready] = RangeMap()
        self.delayed: RangeMap[Ready] = RangeMap()
        # (ready_at_ms, start, end) of every delayed nack, so that each release visits only
        # what is due (a scan of all delayed ranges per timer was quadratic in the nacks).
        # Entries may be stale (the range since reset, revoked or merged): checked when popped.
        self._delayed_due: list[tuple[int, int, int]] = []
        self.dead_lettering: RangeMap[DeadLettering] = RangeMap()
        self.ahead: Ahead | None = None
        self.durable_committed: int | None = None  # last value the writer reported on disk
        self.durable_epoch = 0
        self.redeliveries = 0  # records handed out again (attempt > 1)
        self.dead_letters = 0  # records confirmed in the dead-letter topic
        # The same two counts by why (a few fixed words, so a metric label stays small):
        # redeliveries by the kind of the reason the record came back ("nack", "timeout",
        # "rebalance", "restart"), dead letters as "rejected" or "max_deliveries".
        self.redeliveries_by_reason: dict[str, int] = {}
        self.dead_letters_by_reason: dict[str, int] = {}
        self.holes_truncated = False
        # key_shared groups only (key_order.KeyOrder): per-key order and quarantine. The
        # other modes never touch it, so their paths cost what they did.
        self.keys = None

    @property
    def key(self) -> tuple[str, int]:
        return self.topic, self.partition

    # -- start positions ------------------------------------------------------------

    def start_at(self, offset: int) -> None:
        """First position of a group that has no stored offset here."""
        self.committed = self.next_new = offset

    def load(self, committed: int, holes: Iterable, now_ms: int, reason: str = RESTART) -> None:
        """Stored progress after a coordinator restart (or a takeover: `reason`).

        What lies between `committed` and the end of the highest hole without being
        in a hole was delivered before (we cannot tell how often): it becomes ready
        with `reason` and one previous attempt. Above that is fresh.
        """
        self.committed = committed
        for start, end in holes:
            if end > committed:
                self.finished.add(max(start, committed), end)
        self._advance_committed()
        top = self.finished.last()[1] if self.finished else self.committed
        for start, end in self.finished.gaps(self.committed, top):
            self.ready.set(start, end, Ready(1, reason, now_ms, now_ms))
        self.next_new = top

    # -- handing out ----------------------------------------------------------------

    def take(self, member_id: str, limit: int, log_end: int, now_ms: int,
             new_lease_id: Callable[[], int], ack_timeout_ms: int, max_pieces: int | None = None) -> list[Piece]:
        """Lease up to `limit` records in at most `max_pieces` leases: redeliveries first,
        in offset order, then new ones."""
        if max_pieces is None:
            max_pieces = limit
        if self.keys is not None:
            return self.keys.take(self, member_id, limit, log_end, now_ms, new_lease_id, ack_timeout_ms, max_pieces)
        grants: list[Piece] = []
        deadline = now_ms + ack_timeout_ms
        while limit > 0 and self.ready and len(grants) < max_pieces:
            start, end, ready = self.ready.first()
            end = min(end, start + limit)
            grants.append(self.lease_ready(start, end, ready, member_id, new_lease_id(), deadline, now_ms))
            limit -= end - start
        if (limit > 0 and log_end > self.next_new and self.ahead is None  # an ahead lease owns the new ones
                and len(grants) < max_pieces):
            start, end = self.next_new, min(log_end, self.next_new + limit)
            lease = Lease(new_lease_id(), member_id, 1, NEW, deadline, now_ms)
            self.leased.set(start, end, lease)
            grants.append((start, end, lease))
            self.next_new = end
        return grants

    def lease_ready(self, start: int, end: int, ready: Ready, member_id: str, lease_id: int,
                    deadline_ms: int, now_ms: int) -> Piece:
        """Lease ready records [start, end) again (a redelivery)."""
        self.ready.remove(start, end)
        lease = Lease(lease_id, member_id, ready.attempts + 1, ready.reason, deadline_ms, now_ms, ready.failures)
        self.leased.set(start, end, lease)
        self.redeliveries += end - start
        kind = reason_kind(ready.reason)
        self.redeliveries_by_reason[kind] = self.redeliveries_by_reason.get(kind, 0) + end - start
        return start, end, lease

    def available(self, log_end: int) -> int:
        """How many records `take` could hand out now (key_shared: at most)."""
        if self.keys is not None:
            log_end = min(log_end, self.keys.column.end)
        return self.ready.count() + (0 if self.ahead is not None else max(0, log_end - self.next_new))

    # -- leasing ahead of the log (exclusive groups) -----------------------------------

    def lease_ahead(self, member_id: str, lease_id: int, count: int) -> tuple[int, int]:
        """Lease the next `count` offsets from `next_new`, existing or not; returns [start, end)."""
        assert self.ahead is None, "one ahead lease per partition"
        self.ahead = Ahead(lease_id, member_id, self.next_new + count)
        return self.next_new, self.ahead.end

    def fill_ahead(self, log_end: int, now_ms: int, ack_timeout_ms: int) -> tuple[Piece | None, list]:
        """Records of the ahead lease that now exist become leased (deadline from now).

        Returns the new piece and the early-acked ranges within it, which the caller
        acks; the ahead lease ends once all its offsets exist.
        """
        ahead = self.ahead
        if ahead is None or log_end <= self.next_new:
            return None, []
        start, end = self.next_new, min(log_end, ahead.end)
        lease = Lease(ahead.lease_id, ahead.member_id, 1, NEW, now_ms + ack_timeout_ms, now_ms)
        self.leased.set(start, end, lease)
        self.next_new = end
        early = list(ahead.early.intersection(start, end))
        if early:
            ahead.early.remove(start, end)
        if end >= ahead.end:
            self.ahead = None
        return (start, end, lease), early

    def ack_early(self, lease_id: int, start: int, end: int) -> tuple[int, int] | None:
        """An ack under the ahead lease for offsets not known to exist yet: kept for `fill_ahead`.
        Returns the part of [start, end) it took, or None."""
        ahead = self.ahead
        if ahead is None or ahead.lease_id != lease_id:
            return None
        lo, hi = max(start, self.next_new), min(end, ahead.end)
        if lo >= hi:
            return None
        ahead.early.add(lo, hi)
        return lo, hi

    def drop_ahead(self) -> int:
        """End the ahead lease; returns how many of its offsets never became leased."""
        ahead, self.ahead = self.ahead, None
        return 0 if ahead is None else ahead.end - self.next_new

    def leased_under(self, lease_id: int, start: int, end: int) -> list[Piece]:
        return [p for p in self.leased.pieces(start, end) if p[2].lease_id == lease_id]

    # -- settling leased pieces -----------------------------------------------------

    def ack(self, pieces: list[Piece]) -> None:
        for start, end, _ in pieces:
            self.leased.remove(start, end)
            self.finished.add(start, end)
            if self.keys is not None:
                self.keys.finish(self, start, end)
        self._advance_committed()

    def requeue(self, pieces: list[Piece], reason: str, ready_at_ms: int, now_ms: int,
                max_deliveries: int | None, quarantine_after: int = 0) -> list[tuple[int, int, DeadLettering]]:
        """Make leased pieces deliverable again, or dead-letter those out of attempts.

        `max_deliveries` None means "never dead-letter" (used for revocation, which
        is not the consumer's failure). Returns the pieces that must be dead-lettered.
        With `quarantine_after` (key_shared and exclusive groups), a keyed record that failed
        that many times in a row parks its key instead (key_order.KeyOrder.park,
        key_quarantine.ExclusiveQuarantine.park), and one of a parked key is held.
        """
        doomed = []
        failed = max_deliveries is not None  # a revocation is not the consumer's failure
        if quarantine_after and failed and self.keys is not None:
            pieces = self._park_failed(pieces, reason, ready_at_ms, now_ms, quarantine_after)
        for start, end, lease in pieces:
            self.leased.remove(start, end)
            if failed and lease.attempt >= max_deliveries:
                doomed.append((start, end, DeadLettering(lease.attempt, reason, now_ms,
                                                         self._new_dead_lettering_id())))
                self.dead_lettering.set(start, end, doomed[-1][2])
            else:
                region = self.ready if ready_at_ms <= now_ms else self.delayed
                region.set(start, end, Ready(lease.attempt, reason, ready_at_ms, now_ms, lease.failures + failed))
                if region is self.delayed:
                    heapq.heappush(self._delayed_due, (ready_at_ms, start, end))
        return doomed

    def _park_failed(self, pieces: list[Piece], reason: str, ready_at_ms: int, now_ms: int,
                     quarantine_after: int) -> list[Piece]:
        """Park the keys of the records in `pieces` that reached `quarantine_after` failures in
        a row with this one; returns the pieces left to requeue."""
        rest = []
        parked, column = self.keys.parked, self.keys.column
        for start, end, lease in pieces:
            failures = lease.failures + 1
            if failures < quarantine_after and not parked:
                rest.append((start, end, lease))
                continue
            for offset in range(start, end):
                ready = Ready(lease.attempt, reason, ready_at_ms, now_ms, failures)
                if failures < quarantine_after and column.get(offset) not in parked:
                    rest.append((offset, offset + 1, lease))
                elif self.keys.park(self, offset, ready, now_ms):
                    self.leased.remove(offset, offset + 1)
                else:  # keyless: nothing to park, it is requeued as usual
                    rest.append((offset, offset + 1, lease))
        return rest

    def release_key(self, h: int, to_dlq: bool, now_ms: int) -> list[tuple[int, int, DeadLettering]] | None:
        """Release quarantined key hash `h` (None: not parked here); returns what must be
        dead-lettered: with `to_dlq`, every held record of the key, in order."""
        doomed = self.keys.release(self, h, to_dlq, now_ms)
        if doomed is None:
            return None
        out = []
        for start, end, ready in doomed:
            info = DeadLettering(ready.attempts, QUARANTINE_RELEASE, now_ms, self._new_dead_lettering_id())
            self.dead_lettering.set(start, end, info)
            out.append((start, end, info))
        return out

    def reject(self, pieces: list[Piece], reason: str, now_ms: int) -> list[tuple[int, int, DeadLettering]]:
        doomed = []
        for start, end, lease in pieces:
            self.leased.remove(start, end)
            doomed.append((start, end, DeadLettering(lease.attempt, reason, now_ms, self._new_dead_lettering_id())))
            self.dead_lettering.set(start, end, doomed[-1][2])
        return doomed

    def extend(self, pieces: list[Piece], deadline_ms: int) -> None:
        for start, end, lease in pieces:
            self.leased.set(start, end, replace(lease, deadline_ms=deadline_ms))

    def expire(self, lease_id: int, start: int, end: int, now_ms: int) -> list[Piece]:
        """Pieces of `lease_id` within [start, end) whose deadline has passed."""
        return [p for p in self.leased_under(lease_id, start, end) if p[2].deadline_ms <= now_ms]

    def revoke(self, keep: Callable[[Lease], bool], now_ms: int) -> list[Piece]:
        """Take back every lease `keep` rejects; its records become ready ("rebalance")."""
        pieces = [p for p in self.leased if not keep(p[2])]
        self.requeue(pieces, REBALANCE, now_ms, now_ms, None)
        return pieces

    def release_delayed(self, now_ms: int) -> bool:
        """Move nacked-with-delay records whose time has come to `ready`."""
        moved = False
        due = self._delayed_due
        while due and due[0][0] <= now_ms:
            _when, start, end = heapq.heappop(due)
            for s, e, ready in self.delayed.pieces(start, end):
                if ready.ready_at_ms <= now_ms:
                    self.delayed.remove(s, e)
                    self.ready.set(s, e, ready)
                    moved = True
        if len(due) > 2 * len(self.delayed) + 64:  # mostly stale entries: start again from the map
            self._delayed_due = [(ready.ready_at_ms, s, e) for s, e, ready in self.delayed]
            heapq.heapify(self._delayed_due)
        return moved

    def dead_lettering_of(self, offset: int, dead_lettering_id: int) -> DeadLettering | None:
        """The dead-lettering of `offset`, if it is the one named (not an earlier one)."""
        info = self.dead_lettering.get(offset)
        return info if info is not None and info.id == dead_lettering_id else None

    def dead_letter_failed(self, offset: int) -> bool:
        """Mark a failed copy for retry; False if the record is not being dead-lettered."""
        info = self.dead_lettering.get(offset)
        if info is None:
            return False
        self.dead_lettering.set(offset, offset + 1, replace(info, failed=True))
        return True

    def dead_letter_drop_value(self, offset: int) -> DeadLettering | None:
        """Copy the record without its value from now on (its retries too); None if the
        record is not being dead-lettered."""
        info = self.dead_lettering.get(offset)
        if info is None:
            return None
        info = replace(info, drop_value=True, failed=False)
        self.dead_lettering.set(offset, offset + 1, info)
        return info

    def dead_letter_retry(self, offset: int) -> DeadLettering | None:
        """The record to copy again, if its copy failed. The mark, not the timer, decides:
        a reset and a new dead-lettering of the same offset make an old retry void."""
        info = self.dead_lettering.get(offset)
        if info is None or not info.failed:
            return None
        info = replace(info, failed=False)
        self.dead_lettering.set(offset, offset + 1, info)
        return info

    def dead_letter_done(self, offset: int) -> bool:
        info = self.dead_lettering.get(offset)
        if info is None:
            return False
        self.dead_lettering.remove(offset, offset + 1)
        self.finished.add(offset, offset + 1)
        self.dead_letters += 1
        why = "rejected" if reason_kind(info.last_reason) == "reject" else "max_deliveries"
        self.dead_letters_by_reason[why] = self.dead_letters_by_reason.get(why, 0) + 1
        if self.keys is not None:
            self.keys.finish(self, offset, offset + 1)
        self._advance_committed()
        return True

    # -- jumps ----------------------------------------------------------------------

    def skip_to(self, offset: int) -> list[Piece]:
        """Retention deleted everything below `offset`: forget it. Returns dropped leases."""
        dropped = self.leased.remove(0, offset)
        for region in (self.ready, self.delayed, self.dead_lettering):
            region.remove(0, offset)
        self.finished.remove(0, offset)
        self.committed = max(self.committed or 0, offset)
        self.next_new = max(self.next_new, self.committed)
        self._advance_committed()
        if self.keys is not None:
            self.keys.held.remove(0, offset)
            self.keys.reset(self)
        return dropped

    def reset_to(self, offset: int) -> list[Piece]:
        """Operator reset: start over at `offset`, forgetting all progress. Returns dropped leases."""
        dropped = list(self.leased)
        assert self.ahead is None, "the caller ends the ahead lease first (drop_ahead)"
        for region in (self.leased, self.ready, self.delayed, self.dead_lettering):
            region.clear()
        self.finished.clear()
        self.committed = self.next_new = offset
        if self.keys is not None:
            self.keys.held.clear()
            self.keys.parked.clear()
            self.keys.reset(self)
        return dropped

    def _advance_committed(self) -> None:
        # Only the contiguous finished prefix counts: 11 and 13 acked, 12 not -> 12.
        new = self.finished.first_gap_from(self.committed)
        if new != self.committed:
            self.finished.remove(self.committed, new)
            self.committed = new

    # -- reporting ------------------------------------------------------------------

    def holes(self, limit: int) -> tuple[list[list[int]], bool]:
        """The lowest `limit` finished ranges above committed, and whether more exist."""
        out = []
        for start, end in self.finished:
            if len(out) == limit:
                return out, True
            out.append([start, end])
        return out, False

    def blocker(self, log: LogRange | None, now_ms: int) -> dict | None:
        """The record the committed offset waits for, and why it is not finished."""
        offset = self.committed
        if offset is None or (offset >= self.next_new and (log is None or offset >= log.end)):
            return None
        info: dict = {"offset": offset}
        if (lease := self.leased.get(offset)) is not None:
            info.update(state="leased", member=lease.member_id, since_ms=now_ms - lease.since_ms,
                        attempt=lease.attempt, deadline_in_ms=lease.deadline_ms - now_ms)
        elif (ready := self.ready.get(offset) or self.delayed.get(offset)) is not None:
            info.update(state="ready", member=None, since_ms=now_ms - ready.since_ms,
                        attempt=ready.attempts, reason=ready.reason,
                        ready_in_ms=max(0, ready.ready_at_ms - now_ms))
        elif (dead := self.dead_lettering.get(offset)) is not None:
            info.update(state="dead_lettering", member=None, since_ms=now_ms - dead.since_ms,
                        attempt=dead.attempts, reason=dead.last_reason)
        elif self.keys is not None and (held := self.keys.held.get(offset)) is not None:
            # Behind an earlier record of its key, or its key is quarantined.
            parked = self.keys.column.get(offset) in self.keys.parked
            info.update(state="quarantined" if parked else "held", member=None, since_ms=now_ms - held.since_ms,
                        attempt=held.attempts, reason=held.reason)
        else:
            seen = log.first_seen_ms(offset) if log else None
            info.update(state="not_delivered", member=None,
                        since_ms=None if seen is None else now_ms - seen, attempt=0)
        return info

    def range_entries(self) -> dict[str, int]:
        return {"leased": len(self.leased), "ready": len(self.ready), "delayed": len(self.delayed),
                "ahead": 0 if self.ahead is None else 1 + self.ahead.early.len_ranges(),
                "finished": self.finished.len_ranges(), "dead_lettering": len(self.dead_lettering),
                "held": 0 if self.keys is None else len(self.keys.held)}
