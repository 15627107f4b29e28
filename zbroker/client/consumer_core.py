"""The consumer's decisions, without I/O: membership, acks, ahead leases, what to fetch.

Theory of operation
-------------------
A driver (sync or asyncio) sends and receives; `ConsumerCore` holds the state
and decides, with ``now`` passed in where time matters.

* Membership. `joined` applies a Join reply and returns the partitions revoked
  and assigned (for the rebalance callbacks). Records leased but not handed
  out yet (`held`) survive a join only where their lease still stands: the
  same member (not lost by the coordinator) still owning the partition
  (PROTOCOL.md s.14). Dropped elsewhere: their leases went to another member,
  and a record handed out under one would be acked stale and processed twice.
  Both drivers apply this one rule.
* Acks. Records acked in the order they were handed out cost an identity
  check and an index step (`ack`); the run folds into one range per delivery
  when acks are taken (`take_acks`). Any other order goes through the
  `AckAccumulator`. `ack` says when it is worth asking `acks_due(now)`: on the
  first in-order ack and every 64th, so the clock is not read per record.
* Ahead leases (lease-ahead): filed per partition (`take_ahead_leases`), and
  served from the read-ahead's frames as they arrive (`serve_ahead`).
* Planning: the poll's wait clamp (`max_wait_ms`), the fetch size of a lease
  (`fetch_bytes`: sized from the lease, not the 1 MiB default that returned
  thousands of records past its end), and which leases share a request: the
  deliveries of one poll that live on one partition actor go in one
  `fetch_many` (`plan_fetches`), unless that actor predates it
  (`single_fetch_only`, learnt from its UNKNOWN_OP).
"""

from __future__ import annotations

import collections
from typing import Any

from zbroker.client.core import AckAccumulator, ConsumedRecord, ReadAhead
from zbroker.protocol import messages as m
from zbroker.protocol.batch import decode_fetched
from zbroker.protocol.errors import ZBrokerError

MAX_STALE_KEPT = 1000  # stale ack ranges kept in `stale` (the latest)
# After a failed read-ahead fetch under an ahead lease, the pause before the next one
# (an actor that is restarting answers NOT_OWNER at once until its logs are open).
AHEAD_RETRY_S = 0.05
FETCH_BYTES_PER_RECORD, MIN_FETCH_BYTES = 256, 4096


def max_wait_ms(timeout_s: float) -> int:
    """A poll's or fetch's max_wait_ms for a caller's timeout: whole ms, within the protocol's cap."""
    return max(0, min(int(timeout_s * 1000), m.MAX_WAIT_MS))


def fetch_bytes(start: int, end: int) -> int:
    """max_bytes for fetching the leased offsets [start, end): about what they take, no more."""
    return max(MIN_FETCH_BYTES, (end - start) * FETCH_BYTES_PER_RECORD)


def plan_fetches(routed: list[tuple[str, Any]], single_only: set[str]) -> list[tuple[str, list]]:
    """(endpoint, item) pairs as requests: per endpoint in the order first seen, the items
    together (at most MAX_PARTS_PER_REQUEST a request), or one each for an actor in
    `single_only`."""
    by_endpoint: dict[str, list[list]] = {}
    for endpoint, item in routed:
        groups = by_endpoint.setdefault(endpoint, [[]])
        if groups[-1] and (endpoint in single_only or len(groups[-1]) >= m.MAX_PARTS_PER_REQUEST):
            groups.append([])
        groups[-1].append(item)
    return [(endpoint, group) for endpoint, groups in by_endpoint.items() for group in groups]


def fetch_many_request(wanted: list[tuple[str, int, int, int]]) -> m.FetchMany:
    """One `fetch_many` for (topic, partition, start, end) leased ranges of one actor, each
    part sized as `fetch_bytes` sizes a single fetch."""
    parts = [[topic, partition, start, fetch_bytes(start, end)] for topic, partition, start, end in wanted]
    return m.FetchMany(parts=parts, max_bytes=sum(part[3] for part in parts))


def core_field(name: str) -> property:
    """A driver attribute that is its core's: the driver reads and sets it under its own name."""
    return property(lambda self: getattr(self.core, name), lambda self, value: setattr(self.core, name, value))


class ConsumerCore:
    """One group member's state, and the decisions the drivers share."""

    def __init__(self, *, group: str, topics: list[str], member_id: str = "", ack_batch: int = 1000,
                 ack_interval_s: float = 0.005, read_ahead: bool = True, read_ahead_bytes: int = 32 << 20,
                 lease_ahead: bool = False) -> None:
        self.group = group
        self.topics = topics
        self.member_id = member_id
        self.generation = -1
        self.assignment: list = []
        self.mode = ""
        self.ack_timeout_ms = 0
        # Set when the coordinator no longer knows this member: its leases are gone then,
        # and nothing leased before the re-join may be handed out.
        self.member_lost = False
        self.read_ahead = read_ahead
        self.lease_ahead = lease_ahead
        self.ahead = ReadAhead(max_bytes=read_ahead_bytes)
        # Ahead leases held, oldest first: partition key -> [[lease id, next offset to hand out, end], ...].
        # The coordinator grants the next one once the log reached the end of the last, which
        # can be before this consumer handed all of the last one out.
        self.ahead_leases: dict[tuple[str, int], list[list]] = {}
        # Partitions with an ahead lease whose read-ahead fetch failed: when to fetch again.
        self.ahead_retry: dict[tuple[str, int], float] = {}
        self.held: list[list[ConsumedRecord]] = []  # leased, fetched, not handed out yet
        self.acks = AckAccumulator()
        self.ack_batch = ack_batch
        self.ack_interval_s = ack_interval_s
        self.acks_since: float | None = None  # when the oldest held ack was made (None: none held)
        # Acks in delivery order: the last batch handed out, the next record expected, how many
        # were acked in order, how many of those are folded into `acks`, each delivery's span.
        self._delivered: list = [None]
        self._next: ConsumedRecord | None = None
        self._in_order = self._folded = 0
        self._spans: list[tuple[int, int]] = []
        self._ack_check_mask = 63 if ack_batch >= 64 else 0
        # The latest stale ranges, for inspection (stats["stale"] counts them all): a consumer
        # runs for months, and every lease that expired or moved before its ack adds ranges.
        self.stale: collections.deque = collections.deque(maxlen=MAX_STALE_KEPT)
        self.single_fetch_only: set[str] = set()  # endpoints of actors without fetch_many (UNKNOWN_OP)
        self.stats = {"polled": 0, "acked": 0, "stale": 0, "rejoins": 0}

    # -- membership ---------------------------------------------------------------------------

    @property
    def reading_ahead(self) -> bool:
        """Read-ahead only in exclusive groups: shared groups interleave members' leases, so the
        next one need not start where this member's last ended, and guessing would cost fetches."""
        return self.read_ahead and self.mode == "exclusive"

    def join_request(self, session_timeout_ms: int, *, as_new: bool = False) -> m.Join:
        return m.Join(group=self.group, topics=self.topics, session_timeout_ms=session_timeout_ms,
                      **({} if as_new else {"member_id": self.member_id}))

    def lost(self, *, forget_id: bool) -> None:
        """The coordinator answered FENCED without knowing this member, or UNKNOWN_MEMBER
        (``forget_id``: join as a new member): its leases are gone."""
        self.member_lost = True
        if forget_id:
            self.member_id = ""

    def joined(self, reply: m.JoinReply, previous_member: str) -> tuple[list, list, list[tuple[int, int]]]:
        """Apply a Join reply: returns (partitions revoked, partitions assigned, read-ahead id
        ranges to give up on). ``previous_member`` is the id this member had before it joined."""
        old = {tuple(p) for p in self.assignment}
        new = {tuple(p) for p in reply.assignment}
        self.member_id = reply.member_id
        self.generation = reply.generation
        self.assignment = reply.assignment
        self.ack_timeout_ms = reply.ack_timeout_ms
        self.mode = reply.mode
        self.held = [part for part in self.held if part and self.still_leased(part[0], previous_member)]
        self.member_lost = False
        self.ahead_leases.clear()  # an ahead lease ends with its generation
        self.ahead_retry.clear()
        keep = [tuple(p) for p in reply.assignment] if self.reading_ahead else []
        return sorted(old - new), sorted(new - old), self.ahead.retain(keep)

    def still_leased(self, record: Any, previous_member: str) -> bool:
        """After a join: does the lease ``record`` came under still stand? Yes if this is the
        member that got it (a re-sync, not a new member: the coordinator had not lost it) and
        its partition is still assigned to it."""
        return (bool(previous_member) and previous_member == self.member_id and not self.member_lost
                and [record.topic, record.partition] in [list(p) for p in self.assignment])

    def standing_deliveries(self, deliveries: list, previous_member: str, lost: bool) -> list:
        """Of a poll answered before a re-join, the deliveries whose leases still stand.
        Ahead leases end with the generation (PROTOCOL.md, poll): not one of them does."""
        keep = {tuple(p) for p in self.assignment}
        same_member = bool(previous_member) and previous_member == self.member_id and not lost
        return [d for d in deliveries if same_member and d[6] != "ahead" and (d[0], d[1]) in keep]

    # -- acks -----------------------------------------------------------------------------------

    def deliver(self, records: list, sizes: list[int]) -> None:
        """Start tracking in-order acks of a new batch (what was acked of the last is folded first)."""
        self.fold_in_order_acks()
        self._delivered = records + [None]  # the None ends the in-order run
        self._next = records[0] if records else None
        self._in_order = self._folded = 0
        spans, at = [], 0
        for n in sizes:
            if n:
                spans.append((at, at + n))
            at += n
        self._spans = spans

    def fold_in_order_acks(self) -> None:
        """Turn the records acked in delivery order since the last fold into one range per delivery."""
        lo, hi = self._folded, self._in_order
        if hi <= lo:
            return
        records = self._delivered
        for i0, i1 in self._spans:
            a, b = max(i0, lo), min(i1, hi)
            if a >= b:
                continue
            first, last = records[a], records[b - 1]
            if last[4] - first[4] == b - 1 - a:  # offsets are dense within a delivery
                topic, partition, lease_id = first[5][:3]
                self.acks.add_range([topic, partition, lease_id, first[4], last[4] + 1])
            else:  # pragma: no cover - defensive: never fold what was not acked
                for r in records[a:b]:
                    self.acks.add(*r[5][:3], r[4])
        self._folded = hi

    def ack(self, record: ConsumedRecord) -> bool:
        """Note one ack; True when the driver should ask `acks_due` (first in-order ack, every
        64th, a full batch): the clock is read then, not per record."""
        # The usual case: the caller acks the records of the last poll in the order it got them.
        if record is self._next:
            i = self._in_order = self._in_order + 1
            self._next = self._delivered[i]
            return i & self._ack_check_mask == 0 or i == 1
        acks = self.acks
        source = record[5]  # (topic, partition, lease_id, ...), see ConsumedRecord
        acks.add(source[0], source[1], source[2], record[4])
        count = acks.count
        return self.acks_since is None or count >= self.ack_batch or count & 63 == 0

    def held_acks(self) -> int:
        return self.acks.count + self._in_order - self._folded

    def acks_due_at(self, now: float) -> float | None:
        """When the held acks must be sent: now if a batch is full, else when their
        interval is up; None if none are held."""
        held = self.held_acks()
        if not held:
            return None
        if self.acks_since is None:  # in-order acks after a flush start the interval here
            self.acks_since = now
        return 0.0 if held >= self.ack_batch else self.acks_since + self.ack_interval_s

    def acks_due(self, now: float) -> bool:
        due = self.acks_due_at(now)
        return due is not None and due <= now

    def take_acks(self) -> list[list]:
        """The held acks as ranges, taken out (the interval restarts with the next ack)."""
        self.fold_in_order_acks()
        self.acks_since = None
        return self.acks.take() if self.acks else []

    def hold_again(self, ranges: Any, now: float | None = None) -> None:
        """Acks that may not have been applied (fenced, lost, not sent): they go again."""
        added = False
        for r in ranges:
            self.acks.add_range(r)
            added = True
        if added and self.acks_since is None and now is not None:
            self.acks_since = now

    def applied(self, count: int, stale: list) -> None:
        """An ack (or a poll carrying acks) was answered: ``count`` applied, ``stale`` refused."""
        self.stats["acked"] += count
        if stale:
            self.note_stale(stale)

    def note_stale(self, stale: list) -> None:
        """Ack ranges the coordinator refused as not (or no longer) leased to this member."""
        self.stats["stale"] += sum(r[4] - r[3] for r in stale)
        # An ahead lease the coordinator ended (reset, rebalance): hand out nothing more under it.
        ended = {r[2] for r in stale}
        for key, held in list(self.ahead_leases.items()):
            held[:] = [entry for entry in held if entry[0] not in ended]
            if not held:
                del self.ahead_leases[key]
        self.stale.extend(stale)

    # -- handing out ----------------------------------------------------------------------------

    def hand_out(self, max_records: int) -> list[ConsumedRecord]:
        """Up to ``max_records`` of the held records, whole deliveries first, in order."""
        held, taken, sizes, room = self.held, [], [], max_records
        while held and room:
            part = held[0]
            if len(part) <= room:
                held.pop(0)
            else:
                part, held[0] = part[:room], part[room:]
            taken.append(part)
            sizes.append(len(part))
            room -= len(part)
        records = taken[0] if len(taken) == 1 else [r for part in taken for r in part]
        self.stats["polled"] += len(records)
        self.deliver(records, sizes)
        return records

    # -- ahead leases ---------------------------------------------------------------------------

    def ahead_wanted(self, max_records: int) -> int:
        """The poll's ``ahead`` field: ask for an ahead lease only where one can be served."""
        return max_records if self.lease_ahead and self.reading_ahead else 0

    def take_ahead_leases(self, deliveries: list) -> list:
        """File the ahead leases of a poll reply; returns the deliveries to fetch now.

        New records leased the ordinary way after an ahead lease mean the log passed
        that ahead lease's end: what this consumer has not handed out of it yet exists,
        and goes first, as a delivery of its own (read-ahead keeps one position per
        partition, so it has to be handed out in offset order).
        """
        if not self.ahead_leases and not any(d[6] == "ahead" for d in deliveries):
            return deliveries
        rest, first = [], []
        for d in deliveries:
            topic, partition, lease, start, end, _attempt, reason = d
            key = (topic, partition)
            if reason != "ahead":
                held = self.ahead_leases.get(key)
                while reason == "new" and held and held[0][2] <= start:
                    a_lease, a_pos, a_end = held.pop(0)
                    if a_pos < a_end:
                        first.append([topic, partition, a_lease, a_pos, a_end, 1, "new"])
                if held == []:
                    del self.ahead_leases[key]
                rest.append(d)
                continue
            held = self.ahead_leases.setdefault(key, [])
            if not held:
                self.ahead.leased(key, start, start)  # the read-ahead fetch for this partition starts here
            held.append([lease, start, end])
        return first + rest

    def serve_ahead(self, max_records: int) -> tuple[list[list[ConsumedRecord]], list[tuple[tuple, ZBrokerError]]]:
        """Records under the ahead leases that the read-ahead already holds, one part per lease,
        and the partitions whose held frames proved damaged (with the error)."""
        parts, damaged, room = [], [], max_records
        for key, held in list(self.ahead_leases.items()):
            while held and room > 0:
                entry = held[0]
                lease, pos, end = entry
                first, part = pos, []
                while pos < end and room > 0:
                    frame = self.ahead.covering(key, pos)
                    if frame is None:
                        break
                    try:
                        got = decode_fetched(frame, key[0], key[1], from_offset=pos,
                                             until_offset=min(end, pos + room), make=ConsumedRecord,
                                             extra=(lease, 1, "new"))
                    except ZBrokerError as err:
                        damaged.append((key, err))
                        break
                    if not got:
                        break
                    part.extend(got)
                    pos = got[-1].offset + 1
                    room -= len(got)
                entry[1] = pos
                if pos > first:
                    self.ahead.leased(key, first, pos)
                    parts.append(part)
                if pos < end:
                    break  # the rest has not arrived yet
                held.pop(0)
            if not held and key in self.ahead_leases:
                del self.ahead_leases[key]
        return parts, damaged

    def read_ahead_failed(self, key: tuple[str, int], now: float) -> None:
        """The read-ahead gave up on ``key`` (its actor restarted, the partition moved).
        Records under an ahead lease come only through it: fetch again soon, or they
        would wait for the lease to expire."""
        if key in self.ahead_leases:
            self.ahead_retry[key] = now + AHEAD_RETRY_S

    def restart_ahead_reads(self, now: float) -> None:
        for key, at in list(self.ahead_retry.items()):
            if at <= now:
                del self.ahead_retry[key]
                held = self.ahead_leases.get(key)
                if held:
                    self.ahead.leased(key, held[0][1], held[0][1])  # from the next record to hand out
