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
* Fetching (both drivers send what these say and report what came back): a
  lease's fetch (`lease_fetch`, `lease_fetch_replied`, which asks for the rest
  when max_bytes cut the lease short), the read-ahead's fetches
  (`read_ahead_fetches`, `read_ahead_sent`), their replies (`collect_read_ahead`:
  filed, overtaken, overdue), and a lease served from what the read-ahead holds
  (`serve_lease_from_read_ahead`). Each returns the correlation id ranges it gave
  up on, for the driver to drop (sync: `Correlation`; asyncio: the futures).
* Planning: the poll's wait clamp (`max_wait_ms`), the fetch size of a lease
  (`FetchSizer`: the records in the lease times the bytes a record took in the
  fetches before, bounded; the 1 MiB default returned thousands of records past
  the lease end, PROTOCOL.md item 1), and which leases share a request: the
  deliveries of one poll that live on one partition actor go in one
  `fetch_many` (`plan_fetches`), unless that actor predates it
  (`single_fetch_only`, learnt from its UNKNOWN_OP).
* Requests: every group request names this member and generation
  (`member_request`); a Poll carries the held acks one header holds, the rest
  going first on their own (`acks_for_poll`, `poll_request`), and the next Poll
  goes ahead of the caller only with nothing leased left to hand out and none
  on its way (`poll_ahead_now`).
* Group calls (`GroupCallRetry`): FENCED or UNKNOWN_MEMBER re-joins and sends
  again (twice at most), NOT_COORDINATOR (or a timeout, with several URLs)
  follows the coordinator and re-joins there, anything else is the caller's.
* Loops (`RetryBackoff`): what `run()` does with an error, in both drivers.
"""

from __future__ import annotations

import collections
from typing import Any

import structlog

from zbroker.client.core import (RANGES_PER_REQUEST, AckAccumulator, ConsumedRecord, MetadataCache, ReadAhead,
                                 in_request_sized_chunks)
from zbroker.protocol import messages as m
from zbroker.protocol.batch import decode_fetched, stored_range
from zbroker.protocol.errors import ErrorCode, ZBrokerError
from zbroker.protocol.codec import Envelope

log = structlog.get_logger("zbroker.client")
READ_AHEAD_WAIT_S = 1.0  # how long a poll waits for a read-ahead fetch that may bring its lease's records
# Replies a read-ahead fetch may get after its first, one per append while it waits at
# the log end. Its bytes stay within the one fetch's max_bytes, so the read-ahead's
# memory bound is what it was; this bounds the ids reserved for them.
READ_AHEAD_FOLLOW = 64
MAX_STALE_KEPT = 1000  # stale ack ranges kept in `stale` (the latest)
# After a failed read-ahead fetch under an ahead lease, the pause before the next one
# (an actor that is restarting answers NOT_OWNER at once until its logs are open).
AHEAD_RETRY_S = 0.05
FETCH_BYTES_PER_RECORD, MIN_FETCH_BYTES = 256, 4096


def max_wait_ms(timeout_s: float) -> int:
    """A poll's or fetch's max_wait_ms for a caller's timeout: whole ms, within the protocol's cap."""
    return max(0, min(int(timeout_s * 1000), m.MAX_WAIT_MS))


def fetch_bytes(start: int, end: int, per_record: int = FETCH_BYTES_PER_RECORD) -> int:
    """max_bytes for fetching the leased offsets [start, end): about what they take, no more."""
    return min(MAX_FETCH_BYTES, max(MIN_FETCH_BYTES, (end - start) * per_record))


MAX_FETCH_BYTES = 8 << 20  # a lease of many large records is fetched in several replies, not one huge one


class FetchSizer:
    """The max_bytes of a lease fetch: its records times a per-record size learnt from earlier fetches.

    A fetch returns whole stored batches from ``offset`` up to max_bytes, so a guess
    too small costs one more fetch for the rest of the lease, and one too large
    brings records past the lease end that are thrown away (with the 1 MiB default,
    thousands: consume+ack five times slower). The estimate starts at
    `FETCH_BYTES_PER_RECORD` and follows what fetches brought back (bytes over
    records, a moving average with a 25% margin), so 4 KiB records are fetched in
    one reply instead of one fetch per stored batch. It never goes below its start:
    a lease rarely begins at a batch boundary, and the first batch comes whole, so
    the records before the lease's start take bytes too; below 256 bytes a record
    the rest of a lease more often needs a second fetch.
    """

    def __init__(self, per_record: int = FETCH_BYTES_PER_RECORD) -> None:
        self.per_record = self.floor = per_record

    def max_bytes(self, start: int, end: int) -> int:
        return fetch_bytes(start, end, self.per_record)

    def learn(self, frame_bytes: int, records: int) -> None:
        """A fetch brought ``records`` records (at or after its offset) in ``frame_bytes``."""
        if records <= 0 or frame_bytes <= 0:
            return
        seen = frame_bytes * 5 // (records * 4) + 1  # the 25% margin: batch headers, uneven sizes
        self.per_record = max(self.floor, (self.per_record + seen) // 2 if seen < self.per_record else seen)


RAISE, REJOIN, FOLLOW = "raise", "rejoin", "follow"
ACK_STALE, ACK_REJOIN, ACK_FAILED = "stale", "rejoin", "failed"  # what `ConsumerCore.ack_refused` found


def membership_lost(err: ZBrokerError) -> tuple[bool, bool]:
    """(this member's leases are gone, join as a new member) after a FENCED or UNKNOWN_MEMBER ``err``."""
    unknown = err.code is ErrorCode.UNKNOWN_MEMBER
    return unknown or not err.data.get("member_known", True), unknown


class GroupCallRetry:
    """What one group request (ack, poll, nack, ...) does after each error it gets.

    `REJOIN`: fenced, join again (the driver applies `membership_lost` first) and send
    again, at most twice. `FOLLOW`: the coordinator moved (`Coordinators.redirected`):
    wait `coordinators.backoff()`, then re-join at the new one (it learns of this member
    by its join, and its redeliveries follow) and send again. `RAISE`: the caller's.
    """

    MAX_FENCED = 3

    def __init__(self, coordinators: Any) -> None:
        self.coordinators = coordinators
        self.fenced = self.moved = 0

    def after(self, err: ZBrokerError) -> str:
        if err.code in (ErrorCode.FENCED, ErrorCode.UNKNOWN_MEMBER):
            self.fenced += 1
            return RAISE if self.fenced >= self.MAX_FENCED else REJOIN
        self.moved += 1
        if self.moved >= self.coordinators.attempts() or not self.coordinators.redirected(err):
            return RAISE
        return FOLLOW


class RetryBackoff:
    """What a consumer loop (`run()`) does with an error: a retriable one is logged and waited
    out (0.1 s, doubling up to 5 s, back to 0.1 after a success), any other is raised.
    The waiting is the driver's: `next_delay` says how long."""

    START_S, MAX_S = 0.1, 5.0

    def __init__(self, sleep: Any = None) -> None:
        self.delay = self.START_S
        self._sleep = sleep  # the sync driver's time.sleep, for `wait_or_raise`

    def reset(self) -> None:
        self.delay = self.START_S

    def log_or_raise(self, err: ZBrokerError, what: str, **context: Any) -> None:
        if not err.retriable:
            raise err
        log.warning(f"{what}.retrying", error=str(getattr(err.code, "value", err.code)), reason=err.message,
                    retry_in_s=self.delay, **context)

    def next_delay(self, err: ZBrokerError, what: str, **context: Any) -> float:
        """Raise ``err`` unless it is retriable; else how long to wait before trying again."""
        self.log_or_raise(err, what, **context)
        delay, self.delay = self.delay, min(self.MAX_S, self.delay * 2)
        return delay

    def wait_or_raise(self, err: ZBrokerError, what: str, **context: Any) -> None:
        self._sleep(self.next_delay(err, what, **context))


def failure_reason(exc: BaseException) -> str:
    """The nack reason `run()` gives when its handler raised ``exc`` (the protocol's 200 characters)."""
    return f"{type(exc).__name__}: {exc}"[:200]


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


def fetch_many_request(wanted: list[tuple[str, int, int, int]],
                       per_record: int = FETCH_BYTES_PER_RECORD) -> m.FetchMany:
    """One `fetch_many` for (topic, partition, start, end) leased ranges of one actor, each
    part sized as `fetch_bytes` sizes a single fetch."""
    parts = [[topic, partition, start, fetch_bytes(start, end, per_record)] for topic, partition, start, end in wanted]
    return m.FetchMany(parts=parts, max_bytes=sum(part[3] for part in parts))


class PollSent:
    """A Poll sent and not answered yet: the sync driver's poll sent ahead, the asyncio
    driver's Poll in flight (``reply`` is what the driver waits on: a correlation id, a future).

    The coordinator may lease records to it at any time until it answers, so its
    reply is kept even when the poll() that sent it returns (or is cancelled) first:
    thrown away, those records would stay leased to this member, out of every poll's
    reach, until their ack timeout (each such strand costs them a delivery attempt).
    """

    __slots__ = ("reply", "acks", "member_id", "generation", "give_up_at")

    def __init__(self, reply: Any, acks: list, member_id: str, generation: int, give_up_at: float) -> None:
        self.reply = reply
        self.acks = acks  # riding on it: held again if it is refused on arrival or given up
        self.member_id = member_id
        self.generation = generation
        self.give_up_at = give_up_at  # its max wait and the request timeout after it was sent

    def take_acks(self) -> list:
        acks, self.acks = self.acks, []
        return acks


class AckRequests:
    """Ack requests sent and not answered yet (the sync driver's; the asyncio one awaits each
    call), with what each stands for: its ranges and, for the last request of a flush, the
    acks that rode on the poll sent before it (`before`: applied if it was, since the
    coordinator serves one connection's requests in order). A request without a reply within
    the request timeout (lost with a coordinator that died, say) is given up on, and all it
    stood for goes again (a repeated ack is harmless, a lost one is not)."""

    __slots__ = ("_sent",)

    def __init__(self) -> None:
        self._sent: dict[int, tuple[list, list, float]] = {}  # corr -> (ranges, before, sent at)

    def __bool__(self) -> bool:
        return bool(self._sent)

    @staticmethod
    def requests(ranges: list, before: list) -> list[tuple[list, list]]:
        """(ranges, before) per request: RANGES_PER_REQUEST ranges each (a larger header is
        answered TOO_LARGE with no id), the last one also standing for ``before``."""
        chunks = in_request_sized_chunks(ranges)
        return [(chunk, before if i == len(chunks) - 1 else []) for i, chunk in enumerate(chunks)]

    def sent(self, corr: int, ranges: list, before: list, now: float) -> None:
        self._sent[corr] = (ranges, before, now)

    def waiting(self) -> list[int]:
        return list(self._sent)

    def overdue(self, corr: int, now: float, request_timeout: float) -> bool:
        return now - self._sent[corr][2] > request_timeout

    def answered(self, corr: int) -> tuple[list, list]:
        """The request's (ranges, before), no longer waited for."""
        ranges, before, _at = self._sent.pop(corr)
        return ranges, before

    def lost(self, corr: int) -> list:
        """Given up on: every range it stood for, to hold again."""
        ranges, before = self.answered(corr)
        return [*before, *ranges]


def core_field(name: str) -> property:
    """A driver attribute that is its core's: the driver reads and sets it under its own name."""
    return property(lambda self: getattr(self.core, name), lambda self, value: setattr(self.core, name, value))


def connection_field() -> property:
    """A driver's ``conn``: set (at start, or by a test's stand-in), its metadata cache becomes the
    core's, where a fetch refused as NOT_OWNER forgets the moved partition's owner, and its flow's."""
    def set_conn(self: Any, conn: Any) -> None:
        self._conn = conn
        if hasattr(self, "core") and getattr(conn, "metadata", None) is not None:
            self.core.metadata = conn.metadata
        if hasattr(self, "flow"):
            self.flow.conn = conn
    return property(lambda self: self._conn, set_conn)


class ConsumerCore:
    """One group member's state, and the decisions the drivers share."""

    def __init__(self, *, group: str, topics: list[str], member_id: str = "", ack_batch: int = 1000,
                 ack_interval_s: float = 0.005, read_ahead: bool = True, read_ahead_bytes: int = 32 << 20,
                 lease_ahead: bool = False, poll_ahead: bool = False,
                 metadata: MetadataCache | None = None) -> None:
        self.group = group
        # The driver's connection's cache: a fetch refused as NOT_OWNER forgets the topic's owners.
        self.metadata = metadata if metadata is not None else MetadataCache()
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
        self.poll_ahead = poll_ahead or lease_ahead  # lease-ahead's next lease comes from the poll sent ahead
        self.ahead = ReadAhead(max_bytes=read_ahead_bytes)
        self.fetch_sizer = FetchSizer()
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

    def member_request(self, op: type, **fields: Any) -> m.Message:
        """A group request (poll, ack, nack, extend, reject, heartbeat, leave) as this member,
        in this generation."""
        return op(group=self.group, member_id=self.member_id, generation=self.generation, **fields)

    def poll_request(self, max_records: int, wait_ms: int, acks: list) -> m.Poll:
        """The Poll to send now, carrying ``acks`` (`acks_for_poll`), asking for an ahead lease
        where one can be served."""
        return self.member_request(m.Poll, max_records=max_records, max_wait_ms=wait_ms, acks=acks,
                                   ahead=self.ahead_wanted(max_records))

    def poll_ahead_now(self, poll_in_flight: bool) -> bool:
        """After a poll() handed records out: send the next Poll now (poll-ahead), so the coordinator
        leases while the caller handles these? Not while leased records are left to hand out (the
        next poll() takes those), nor with a Poll already on its way."""
        return self.poll_ahead and not self.held and not poll_in_flight

    def join_as_new(self, session_timeout_ms: int) -> m.Join:
        """The Join answered UNKNOWN_MEMBER: the coordinator forgot this member, and its leases
        with it. It joins again as a new member."""
        self.lost(forget_id=True)
        return self.join_request(session_timeout_ms, as_new=True)

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

    def rejoin_after(self, err: ZBrokerError, member_id: str, generation: int) -> bool:
        """``err`` (FENCED or UNKNOWN_MEMBER) refused a request sent as ``member_id`` in
        ``generation``: True if this member must re-join now (it has not since that request
        was sent), with its leases counted gone if the coordinator lost it (`membership_lost`)."""
        if (self.member_id, self.generation) != (member_id, generation):
            return False  # re-joined already: the caller just sends again
        lost, forget_id = membership_lost(err)
        if lost:
            self.lost(forget_id=forget_id)
        return True

    @staticmethod
    def poll_sent(reply: Any, poll: m.Poll, now: float, request_timeout: float) -> PollSent:
        """The record of ``poll``, sent at ``now``; ``reply`` is what the driver waits on."""
        return PollSent(reply, poll.acks, poll.member_id, poll.generation,
                        now + poll.max_wait_ms / 1000.0 + request_timeout)

    def poll_replied(self, sent: PollSent, env: Envelope, now: float) -> m.PollReply | None:
        """The answer to ``sent``: its reply (the acks it carried counted as applied, stale
        ones noted), or None when the member must re-join before polling again (FENCED,
        UNKNOWN_MEMBER; the acks are held again unless the error says they were applied).
        Any other error is raised."""
        err = env.error
        if err is None:
            return self.poll_answered(env.msg)
        if self.poll_refused(err, sent.acks, now):
            return None
        raise err

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

    def acks_for_poll(self) -> tuple[list[list], list[list]]:
        """The held acks, taken, for a Poll about to be sent: (those it carries, at most what one
        request's header holds; the rest, which the driver sends first on their own)."""
        ranges = self.take_acks()
        return ranges[:RANGES_PER_REQUEST], ranges[RANGES_PER_REQUEST:]

    def hold_again(self, ranges: Any, now: float | None = None) -> None:
        """Acks that may not have been applied (fenced, lost, not sent): they go again."""
        added = False
        for r in ranges:
            self.acks.add_range(r)
            added = True
        if added and self.acks_since is None and now is not None:
            self.acks_since = now

    def poll_answered(self, reply: m.PollReply) -> m.PollReply:
        """A poll was answered: the acks it carried count as applied, the stale ones are noted."""
        self.applied(reply.acked, reply.stale)
        if reply.stale:
            log.warning("ack.stale", group=self.group, ranges=len(reply.stale))
        return reply

    def poll_refused(self, err: ZBrokerError, acks: list, now: float | None = None) -> bool:
        """A poll carrying ``acks`` was answered with ``err``. Answered after it waited (the error
        carries ``acked``), its acks were applied; refused on arrival, none were, and they go again.
        True when the member must re-join before polling again (FENCED, UNKNOWN_MEMBER)."""
        if "acked" in err.data:
            self.stats["acked"] += int(err.data["acked"])
        else:
            self.hold_again(acks, now)
        return err.code in (ErrorCode.FENCED, ErrorCode.UNKNOWN_MEMBER)

    def ack_refused(self, err: ZBrokerError, ranges: list, now: float) -> str:
        """An ack request carrying ``ranges`` was answered with ``err``. `ACK_STALE`: its valid
        ranges were applied, the stale ones are noted (sending them again cannot help).
        Otherwise a retriable error means not applied, or not known to be: they are held again
        (a repeated ack is harmless, a lost one is not). `ACK_REJOIN` (FENCED, UNKNOWN_MEMBER,
        the latter joining as a new member): re-join, then send the held acks; `ACK_FAILED`:
        the caller raises ``err``."""
        if err.code is ErrorCode.STALE_LEASE:
            stale = err.data.get("stale", [])
            self.applied(int(err.data.get("applied", 0)), stale)
            log.warning("ack.stale", group=self.group, ranges=len(stale))
            return ACK_STALE
        if err.retriable:
            self.hold_again(ranges, now)
        if err.code in (ErrorCode.FENCED, ErrorCode.UNKNOWN_MEMBER):
            if err.code is ErrorCode.UNKNOWN_MEMBER:
                self.member_id = ""
            return ACK_REJOIN
        return ACK_FAILED

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

    def fetched(self, frame: Any) -> None:
        """A lease fetch came back with ``frame``: what its records took teaches the next fetch's size."""
        span = stored_range(frame) if frame else None
        if span is not None:
            self.fetch_sizer.learn(len(frame), span[1] - span[0])

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

    def ahead_records(self, max_records: int, now: float) -> tuple[list[list[ConsumedRecord]], list[tuple[int, int]]]:
        """`serve_ahead`, with a partition whose held frames proved damaged dropped
        (`damaged_read_ahead`): (parts, the id ranges given up on)."""
        parts, damaged = self.serve_ahead(max_records)
        given_up: list[tuple[int, int]] = []
        for key, err in damaged:
            given_up += self.damaged_read_ahead(key, err, now)
        return parts, given_up

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

    # -- fetching -------------------------------------------------------------------------------

    def lease_fetch(self, delivery: list, start: int) -> m.Fetch:
        """The fetch of a delivery's records from ``start`` on, sized from the lease (`FetchSizer`)."""
        topic, partition, _lease, _start, end = delivery[:5]
        return m.Fetch(topic=topic, partition=partition, offset=start, max_bytes=self.fetch_sizer.max_bytes(start, end))

    def lease_fetch_replied(self, delivery: list, start: int, env: Envelope | None, err: ZBrokerError | None,
                            now: float) -> tuple[list[ConsumedRecord], int | None, list[tuple[int, int]]]:
        """A lease fetch from ``start`` was answered (``env``) or failed (``err``): (its records,
        the offset to fetch the rest from if max_bytes cut the lease short, id ranges given up).
        A partition that cannot be fetched costs only its own deliveries: their leases expire
        and come back, and the other partitions' records are handed out."""
        if err is None and env is not None:
            err = env.error
        if err is not None:
            return [], None, self.fetch_failed((delivery[0], delivery[1]), err, now)
        return self.lease_part_fetched(delivery, start, env.frames[0] if env.frames else b"", now)

    def lease_part_fetched(self, delivery: list, start: int, frame: Any, now: float,
                           in_many: bool = False) -> tuple[list[ConsumedRecord], int | None, list[tuple[int, int]]]:
        """What one fetch (``in_many``: one part of a fetch_many) brought of ``delivery`` from
        ``start``: as `lease_fetch_replied`."""
        topic, partition, lease, _start, end, attempt, reason = delivery
        try:
            self.fetched(frame)
            got = decode_fetched(frame, topic, partition, from_offset=start, until_offset=end, make=ConsumedRecord,
                                 extra=(lease, attempt, reason))
        except ZBrokerError as damaged:  # a damaged batch: its lease expires, the other deliveries go on
            return [], None, self.fetch_failed((topic, partition), damaged, now)
        if got:
            rest = got[-1].offset + 1 if got[-1].offset + 1 < end else None
        else:  # a fetch_many's byte budget may not reach a part: it is fetched alone
            rest = start if in_many else None
        return got, rest, []

    def lease_fetch_many(self, group: list[tuple[int, list, int]]) -> m.FetchMany:
        """One fetch_many for the (index, delivery, start) items `plan_fetches` put together."""
        return fetch_many_request([(d[0], d[1], start, d[4]) for _i, d, start in group], self.fetch_sizer.per_record)

    def lease_fetch_many_replied(self, endpoint: str, group: list[tuple[int, list, int]], env: Envelope | None,
                                 err: ZBrokerError | None) -> list[tuple[int, list, int, Any, ZBrokerError | None]]:
        """(index, delivery, start, frame, error) per part of a fetch_many's answer; frame None
        and no error for all of them when the actor predates fetch_many (fetch them alone:
        it is remembered in `single_fetch_only`)."""
        if err is None and env is not None:
            err = env.error
        if err is not None:
            if err.code is ErrorCode.UNKNOWN_OP:
                self.single_fetch_only.add(endpoint)
                err = None
            return [(i, d, start, None, err) for i, d, start in group]
        try:
            frames = m.split_fetched(env.msg, env.frames[0] if env.frames else b"")
        except ZBrokerError as damaged:
            return [(i, d, start, None, damaged) for i, d, start in group]
        return [(i, d, start, frame, None if row[3] is None else ZBrokerError.from_wire(row[3]))
                for (i, d, start), frame, row in zip(group, frames, env.msg.parts)]

    def fetch_failed(self, key: tuple[str, int], err: ZBrokerError, now: float) -> list[tuple[int, int]]:
        log.warning("fetch.failed", topic=key[0], partition=key[1], code=err.code.value, reason=err.message)
        if not err.retriable:
            return []
        # The partition moved or its actor restarted: the next fetch asks the coordinator
        # where it lives now. These leases expire and come back.
        self.metadata.forget(key[0])
        return self.give_up_read_ahead(key, now)

    def give_up_read_ahead(self, key: tuple[str, int], now: float) -> list[tuple[int, int]]:
        """Forget what the read-ahead holds or awaits for ``key``; returns the id ranges its fetch
        may still get replies under (dropped when they come)."""
        ranges = self.ahead.drop(key)
        self.read_ahead_failed(key, now)
        return ranges

    def read_ahead_fetches(self, wait_ms: int, now: float) -> list[tuple[tuple[str, int], m.Fetch]]:
        """Fetches to send where the next leases will start; one parks at its actor until records come.
        It follows the log end: each append reaches this consumer in a reply of its own, without a
        fetch sent again after each (bench/PROFILE.md, fifteenth pass)."""
        if self.ahead_retry:
            self.restart_ahead_reads(now)
        follow = READ_AHEAD_FOLLOW if wait_ms else 0
        return [(key, m.Fetch(topic=key[0], partition=key[1], offset=offset, max_bytes=max_bytes,
                              max_wait_ms=wait_ms, follow=follow))
                for key, offset, max_bytes in self.ahead.wanted()]

    def read_ahead_sent(self, key: tuple[str, int], corr: int | None, fetch: m.Fetch, now: float,
                        request_timeout: float) -> None:
        """The driver sent ``fetch`` as ``corr`` (None: it could not reach the actor; the next lease
        is fetched the usual way). A live actor answers within the wait (a followed fetch: of its
        last reply); one killed with the fetch parked never does, and under an ahead lease nothing
        else would fetch those records: they would wait for the ack timeout."""
        if corr is None:
            self.give_up_read_ahead(key, now)
            return
        self.ahead.sent(key, corr, fetch.offset, fetch.follow,
                        patience=fetch.max_wait_ms / 1000.0 + request_timeout, now=now)

    def read_ahead_replied(self, key: tuple[str, int], corr: int, env: Envelope, now: float) -> int | None:
        """File one read-ahead reply; returns the id of the fetch's next reply, if it stays out."""
        ok = env.error is None
        if not ok and env.error.retriable:
            self.metadata.forget(key[0])
        following = self.ahead.arrived(key, corr, (env.frames[0] if env.frames else b"") if ok else None,
                                       more=ok and env.msg.more, now=now)
        if not ok:
            self.read_ahead_failed(key, now)
        return following

    def collect_read_ahead(self, arrived: dict, now: float) -> list[tuple[int, int]]:
        """File the read-ahead replies in ``arrived`` (corr id -> envelope; those filed are taken
        out), so that a partition whose parked fetch ended empty gets a new one. Returns the id
        ranges given up on: fetches overtaken (a later reply of the same fetch came and the one
        awaited did not: a full queue at the actor dropped it) or overdue (no reply within the
        wait and the request timeout: the actor died with the fetch parked, or hangs)."""
        given_up: list[tuple[int, int]] = []
        for key, corr in self.ahead.in_flight():
            while corr is not None:
                env = arrived.pop(corr, None)
                if env is None:
                    if self.ahead.overtaken(key, arrived):
                        given_up += self.give_up_read_ahead(key, now)
                    break
                corr = self.read_ahead_replied(key, corr, env, now)
        for key in self.ahead.overdue(now):
            log.info("read_ahead.overdue", topic=key[0], partition=key[1])
            given_up += self.give_up_read_ahead(key, now)
        return given_up

    def serve_lease_from_read_ahead(self, delivery: list, pos: int, out: list, now: float
                                    ) -> tuple[int, int | None, list[tuple[int, int]]]:
        """Append what the read-ahead holds of ``delivery`` from ``pos`` to ``out``: (the first
        offset it lacks, the id of the fetch out that may bring it (the driver waits for that
        reply, files it, and asks again) or None, id ranges given up on). With None the driver
        calls `lease_served` and fetches the rest itself."""
        topic, partition, lease, _start, end, attempt, reason = delivery
        key = (topic, partition)
        while pos < end:
            frame = self.ahead.covering(key, pos)
            if frame is None:
                return pos, self.ahead.awaited(key, pos), []
            try:
                got = decode_fetched(frame, topic, partition, from_offset=pos, until_offset=end,
                                     make=ConsumedRecord, extra=(lease, attempt, reason))
            except ZBrokerError as err:  # dropped, or every poll would raise it again: the caller skips it
                return pos, None, self.damaged_read_ahead(key, err, now)
            if not got:
                break
            out.extend(got)
            pos = got[-1].offset + 1
        return pos, None, []

    def lease_served(self, delivery: list) -> None:
        """A delivery was served (from the read-ahead, and fetched for the rest): the next lease starts after it."""
        self.ahead.leased((delivery[0], delivery[1]), delivery[3], delivery[4])

    def damaged_read_ahead(self, key: tuple[str, int], err: ZBrokerError, now: float) -> list[tuple[int, int]]:
        """A damaged batch in what the read-ahead holds: dropped, or every poll would raise it
        again and no other partition would be served. Its lease expires and comes back."""
        return self.fetch_failed(key, err, now) + self.give_up_read_ahead(key, now)
