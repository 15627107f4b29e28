"""Commit writer core: coalescing, flush decisions, durability replies. Pure.

Theory of operation
-------------------
The coordinator sends ``advance`` requests: lists of
``[group, topic, partition, committed_offset, holes, generation, reset_epoch]``,
and an eighth element, the group's parked keys there, when it has any.
The core keeps, per key ``(group, topic, partition)``, only the newest value
(by the monotonic guard of `storage.offsets.base`: higher reset epoch wins,
then a higher or equal offset), so memory follows the number of keys, never
the number of commits.

Values live in one of three places::

    pending  --flush-->  in flight  --success-->  durable
        ^                    |
        +------failure-------+   (merged back, newest per key wins)

Only one flush is in flight at a time. A flush starts when the store is not
backing off and either ``batch_size`` keys are pending, or the oldest pending
value has waited ``flush_interval_ms``. It takes at most ``batch_size`` keys,
oldest first, so that after an outage the backlog drains in bounded
statements rather than one huge one.

Durability replies use sequence numbers instead of per-advance bookkeeping.
Each request gets the next ``seq``; a key entering ``pending`` remembers the
seq that put it there (``since``; a later, newer value for the same key
replaces the value in place but keeps the older ``since``, because the older
demand is still unmet). ``pending`` is ordered by ``since``, and the in-flight
batch holds only entries older than everything left in ``pending``. So
"every value (or a newer one) of requests up to seq S is durable" is simply
``S < min(since over pending and in flight)``: the *watermark*. Requests wait
in a FIFO and are answered in order once the watermark passes them. A reply
lists, for each key of the request, the durable value now known, which is the
requested one or newer.

Failure: a failed flush goes back into ``pending`` (newest per key wins), the
next attempt waits an exponential backoff capped at ``backoff_max_ms``, and
the writer reports unhealthy until a round trip succeeds. While idle, a
``Probe`` (one cheap round trip) every ``probe_interval_ms`` keeps the health
honest. Waiting requests are capped: beyond ``max_waiting_requests``, or
beyond ``max_waiting_keys`` keys named by them all, the oldest is answered
``UNAVAILABLE`` (its values stay pending and will be written; the
coordinator may resend, which is harmless). The key cap matters during an
outage: each waiting request keeps its key list for the reply, so their
memory follows the advances received, not the keys, and the coordinator
goes on sending every 50 ms (and all it has unconfirmed every 3 s).

Fencing (issue 26): once the coordinator has taken the coordinator lease
through this writer (``coordinator_lease``, see `on_lease`), every flush
carries that epoch and the store writes it only while the epoch is still
the lease's current one, in the same statement. A writer that never saw a
lease writes unfenced, as a single-node broker always has. When the store
refuses a flush (another node took the lease: `on_flush_fenced`), or the
lease comes back at a new epoch (this node lost it and took it again), what
is pending belongs to a term that is over: it is dropped and every waiting
advance is answered STALE_EPOCH. The new term's coordinator reloads the
offsets and redelivers what was not committed, so this loses nothing that
at-least-once promises.

The shell performs the effects (`Flush`, `Probe`, `Load`, `Reply`,
`ReplyError`, `Status`) and reports back with ``on_flush_done`` /
``on_flush_failed`` / ``on_flush_fenced``. Time is always passed in as ``now_ms``.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from typing import Any

from zbroker.protocol import messages as m
from zbroker.protocol.errors import ProtocolError, ShuttingDown, StaleEpoch, Unavailable, ZBrokerError
from zbroker.storage.offsets.base import MAX_STORED_QUARANTINE, OffsetRow
from zbroker.storage.offsets.metadata import LeaseState

Key = tuple[str, str, int]

# Keeps (group, topic, partition) far below PostgreSQL's btree entry limit; the protocol
# refuses longer group names from clients (topic names are shorter still).
MAX_NAME_CHARS = m.MAX_GROUP_NAME_CHARS
MAX_HOLES = 100_000
# Upper bounds (ms) of the flush latency buckets the writer counts into, Prometheus-style.
FLUSH_BUCKETS_MS = (1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, float("inf"))
MAX_INT64 = (1 << 63) - 1
MAX_INT32 = (1 << 31) - 1


@dataclasses.dataclass(slots=True)
class WriterConfig:
    flush_interval_ms: float = 10.0
    batch_size: int = 1000
    backoff_initial_ms: float = 50.0
    backoff_max_ms: float = 2000.0
    status_interval_ms: float = 1000.0
    probe_interval_ms: float = 1000.0
    # A flush or a pending value older than this means the store is slow: unhealthy.
    unhealthy_after_ms: float = 1000.0
    max_waiting_requests: int = 10_000
    # Keys named by all waiting requests together (a key counts once per request naming it).
    max_waiting_keys: int = 1_000_000
    latency_window: int = 1024

    def __post_init__(self) -> None:
        if (self.batch_size < 1 or self.flush_interval_ms < 0 or self.max_waiting_requests < 1
                or self.max_waiting_keys < 1):
            raise ZBrokerError("invalid commit writer config", batch_size=self.batch_size,
                               flush_interval_ms=self.flush_interval_ms,
                               max_waiting_requests=self.max_waiting_requests,
                               max_waiting_keys=self.max_waiting_keys)


# -- effects ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class Flush:
    """Upsert these rows (one statement, fenced by `coordinator_epoch` unless None), then call
    on_flush_done / on_flush_failed / on_flush_fenced."""
    flush_id: int
    rows: list[OffsetRow]
    coordinator_epoch: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Probe:
    """One round trip to the store (ping), reported like a flush."""
    flush_id: int


@dataclasses.dataclass(frozen=True, slots=True)
class Load:
    """Read every row from the store and answer `token` with LoadOffsetsReply."""
    token: Any


@dataclasses.dataclass(frozen=True, slots=True)
class Reply:
    """Answer an advance request: durable = [[group, topic, partition, committed, reset_epoch], ...]."""
    token: Any
    durable: list[list]


@dataclasses.dataclass(frozen=True, slots=True)
class ReplyError:
    token: Any
    error: ZBrokerError


@dataclasses.dataclass(frozen=True, slots=True)
class Status:
    """Send writer_status(healthy, metrics) to the coordinator."""
    healthy: bool
    metrics: dict


Effect = Flush | Probe | Load | Reply | ReplyError | Status


@dataclasses.dataclass(slots=True)
class _Waiter:
    token: Any
    seq: int
    keys: list[Key] | None  # None: a load_offsets request


# -- validation --------------------------------------------------------------------------

def check_advance(a: list, index: int) -> None:
    """Reject values the store would refuse: one bad row must not poison a whole batch forever.

    `protocol` already checked the shape and element types.
    """
    g, t, p, c, holes, gen, ep = a[:7]
    if len(a) == 8:
        check_quarantine(a[7], index, g, t, p)
    if not (0 < len(g) <= MAX_NAME_CHARS and 0 < len(t) <= MAX_NAME_CHARS) or "\x00" in g or "\x00" in t:
        raise ProtocolError(f"group and topic must be 1..{MAX_NAME_CHARS} characters without NUL",
                            op="advance", index=index)
    if not (0 <= p <= MAX_INT32 and 0 <= c <= MAX_INT64 and 0 <= ep <= MAX_INT64
            and -MAX_INT64 <= gen <= MAX_INT64):
        raise ProtocolError("partition, committed_offset, generation or reset_epoch out of range",
                            op="advance", index=index, group=g, topic=t, partition=p)
    if len(holes) > MAX_HOLES:
        raise ProtocolError("too many holes", op="advance", index=index, limit=MAX_HOLES, got=len(holes))
    floor = c
    for h in holes:
        if not (type(h) is list and len(h) == 2 and type(h[0]) is int and type(h[1]) is int
                and floor <= h[0] < h[1] <= MAX_INT64):
            raise ProtocolError("holes must be sorted, disjoint [start, end) ranges above committed_offset",
                                op="advance", index=index, group=g, topic=t, partition=p)
        floor = h[1]


def check_quarantine(quarantine: list, index: int, g: str, t: str, p: int) -> None:
    """The parked keys of an advance: at most MAX_STORED_QUARANTINE [key_hash, failures, reason]."""
    if not (type(quarantine) is list and len(quarantine) <= MAX_STORED_QUARANTINE and all(
            type(q) is list and len(q) == 3 and type(q[0]) is int and 0 < q[0] < 1 << 32
            and type(q[1]) is int and 0 <= q[1] <= MAX_INT64 and type(q[2]) is str and len(q[2]) <= 1000
            for q in quarantine)):
        raise ProtocolError(f"quarantine must be at most {MAX_STORED_QUARANTINE} [key_hash, failures, reason]",
                            op="advance", index=index, group=g, topic=t, partition=p)


def _newer_or_equal(a: list, b: list) -> bool:
    """The monotonic guard on wire lists: would `a` be applied over `b`?"""
    return a[6] > b[6] or (a[6] == b[6] and a[3] >= b[3])


def _to_row(a: list) -> OffsetRow:
    return OffsetRow(a[0], a[1], a[2], a[3], [(h[0], h[1]) for h in a[4]], a[5], a[6], a[7] if len(a) > 7 else [])


# -- the core ----------------------------------------------------------------------------

class CommitWriterCore:
    def __init__(self, config: WriterConfig | None = None) -> None:
        self.config = config or WriterConfig()
        # key -> [wire advance, since_seq, since_ms]; ordered by since_seq (see module doc).
        self._pending: collections.OrderedDict[Key, list] = collections.OrderedDict()
        self._inflight: collections.OrderedDict[Key, list] | None = None
        self._busy_id: int | None = None  # the flush or probe the shell is running
        self._busy_since_ms = 0.0
        self._next_id = 0
        self._durable: dict[Key, tuple[int, int]] = {}  # key -> (reset_epoch, committed_offset)
        self._seq = 0
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._waiting_keys = 0  # sum of len(w.keys) over _waiters
        self._consecutive_failures = 0
        self._retry_at_ms = 0.0
        self._last_contact_ms: float | None = None  # last successful round trip (flush or probe)
        self._last_flush_ok_ms: float | None = None
        self._next_status_ms: float | None = None
        self._closing = False
        # The coordinator epoch flushes are fenced with; None: no lease seen, write unfenced.
        self.coordinator_epoch: int | None = None
        # The flush in flight belongs to an epoch that is over: whatever it ends with, its
        # values are not merged back.
        self._inflight_doomed = False
        self._last_error = ""
        self._latencies: collections.deque[float] = collections.deque(maxlen=self.config.latency_window)
        # Every flush's latency counted into fixed buckets since start (a Prometheus
        # histogram, zbroker_commit_flush_seconds): the deque above forgets, these do not.
        self._flush_buckets = [0] * len(FLUSH_BUCKETS_MS)
        self._flush_ms_sum = 0.0
        self._counts = dict.fromkeys(
            ("advances_received", "advances_coalesced", "advances_stale", "rows_flushed", "flushes",
             "flush_errors", "probes", "requests", "requests_rejected", "requests_shed", "flushes_fenced",
             "advances_fenced"), 0)

    # -- inputs ----------------------------------------------------------------------------

    def on_advance(self, token: Any, advances: list, now_ms: float) -> list[Effect]:
        """An ``advance`` request (already decoded by protocol)."""
        counts = self._counts
        counts["requests"] += 1
        if self._closing:
            return [ReplyError(token, ShuttingDown("commit writer is stopping"))]
        try:
            for i, a in enumerate(advances):
                check_advance(a, i)
        except ProtocolError as exc:
            counts["requests_rejected"] += 1
            return [ReplyError(token, exc)]
        if not advances:
            return [Reply(token, [])]
        self._seq += 1
        seq = self._seq
        pending = self._pending
        durable = self._durable
        keys = []
        coalesced = stale = 0
        for a in advances:
            key = (a[0], a[1], a[2])
            keys.append(key)
            ent = pending.get(key)
            if ent is not None:
                coalesced += 1
                if _newer_or_equal(a, ent[0]):
                    ent[0] = a
                else:
                    stale += 1
                continue
            d = durable.get(key)
            if d is not None and (a[6] < d[0] or (a[6] == d[0] and a[3] < d[1])):
                coalesced += 1  # something newer is already durable: nothing to write
                stale += 1
                continue
            pending[key] = [a, seq, now_ms]
        counts["advances_received"] += len(advances)
        counts["advances_coalesced"] += coalesced
        counts["advances_stale"] += stale
        self._waiters.append(_Waiter(token, seq, keys))
        self._waiting_keys += len(keys)
        effects = self._shed()
        effects += self._release()
        effects += self._maybe_flush(now_ms)
        return effects

    def on_load_offsets(self, token: Any, now_ms: float) -> list[Effect]:
        """``load_offsets``: answered from the store once what is pending now is written."""
        if self._closing:
            return [ReplyError(token, ShuttingDown("commit writer is stopping"))]
        if self._consecutive_failures:
            return [ReplyError(token, self._unavailable())]
        if not self._pending and self._inflight is None:
            return [Load(token)]
        self._seq += 1
        self._waiters.append(_Waiter(token, self._seq, None))
        return self._shed() + self._maybe_flush(now_ms)

    def on_tick(self, now_ms: float) -> list[Effect]:
        """Timers: interval flushes, retries after backoff, probes and status."""
        effects = self._maybe_flush(now_ms)
        if self._next_status_ms is None or now_ms >= self._next_status_ms:
            self._next_status_ms = now_ms + self.config.status_interval_ms
            effects.append(Status(self.healthy(now_ms), self.statistics(now_ms)))
        return effects

    def on_flush_done(self, flush_id: int, now_ms: float) -> list[Effect]:
        if flush_id != self._busy_id:
            return []
        self._busy_id = None
        self._consecutive_failures = 0
        self._retry_at_ms = 0.0
        self._last_contact_ms = now_ms
        inflight, self._inflight = self._inflight, None
        self._inflight_doomed = False
        if inflight is None:
            self._counts["probes"] += 1
            return self._release() + self._maybe_flush(now_ms)
        durable = self._durable
        for key, (a, _seq, _ms) in inflight.items():
            d = durable.get(key)
            if d is None or a[6] > d[0] or (a[6] == d[0] and a[3] >= d[1]):
                durable[key] = (a[6], a[3])
        self._counts["flushes"] += 1
        self._counts["rows_flushed"] += len(inflight)
        took = now_ms - self._busy_since_ms
        self._latencies.append(took)
        self._flush_ms_sum += took
        self._flush_buckets[bisect.bisect_left(FLUSH_BUCKETS_MS, took)] += 1
        self._last_flush_ok_ms = now_ms
        return self._release() + self._maybe_flush(now_ms)

    def on_lease(self, lease: LeaseState, now_ms: float) -> list[Effect]:
        """A ``coordinator_lease`` answer from the store: adopt its epoch if this node holds it."""
        if not lease.held or lease.epoch == self.coordinator_epoch:
            return []
        previous, self.coordinator_epoch = self.coordinator_epoch, lease.epoch
        if previous is None:
            return []  # the first term: what is pending was sent for it
        return self._end_term(StaleEpoch("the coordinator epoch of these advances is over: not written",
                                         epoch=lease.epoch, got=previous))

    def on_flush_fenced(self, flush_id: int, now_ms: float, error: StaleEpoch) -> list[Effect]:
        """The store refused the flush: the lease's epoch is no longer ours."""
        if flush_id != self._busy_id:
            return []
        self._busy_id = None
        if self._inflight is not None and not self._inflight_doomed:
            self._counts["advances_fenced"] += len(self._inflight)
        self._inflight = None
        self._inflight_doomed = False
        self._last_contact_ms = now_ms  # the store answered
        self._consecutive_failures = 0
        self._counts["flushes_fenced"] += 1
        return self._end_term(error) + self._maybe_flush(now_ms)

    def on_flush_failed(self, flush_id: int, now_ms: float, error: str = "") -> list[Effect]:
        if flush_id != self._busy_id:
            return []
        self._busy_id = None
        self._counts["flush_errors"] += 1
        self._consecutive_failures += 1
        self._last_error = error[:500]
        self._retry_at_ms = now_ms + self.backoff_ms()
        inflight, self._inflight = self._inflight, None
        if inflight is not None and not self._inflight_doomed:
            self._merge_back(inflight)
        self._inflight_doomed = False
        effects: list[Effect] = []
        # load_offsets cannot be served while the store fails; the coordinator retries.
        if any(w.keys is None for w in self._waiters):
            kept = collections.deque()
            for w in self._waiters:
                if w.keys is None:
                    effects.append(ReplyError(w.token, self._unavailable()))
                else:
                    kept.append(w)
            self._waiters = kept
        return effects

    def begin_shutdown(self, now_ms: float) -> list[Effect]:
        """Stop taking requests; flush what is pending without waiting for the interval."""
        self._closing = True
        return self._maybe_flush(now_ms)

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def drained(self) -> bool:
        """Nothing left to write and no flush running (after begin_shutdown)."""
        return not self._pending and self._inflight is None

    def abort(self, now_ms: float) -> list[Effect]:
        """Give up: every waiting request gets SHUTTING_DOWN (its values may or may not be durable)."""
        self._closing = True
        stopped = "commit writer stopped before this was durable"
        effects: list[Effect] = [ReplyError(w.token, ShuttingDown(stopped)) for w in self._waiters]
        self._waiters.clear()
        self._waiting_keys = 0
        return effects

    # -- queries ---------------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When on_tick has something to do, in the same clock as now_ms."""
        candidates = [self._next_status_ms] if self._next_status_ms is not None else [0.0]
        if self._busy_id is None:
            if self._pending:
                due = self._oldest_pending_ms() + self.config.flush_interval_ms
                if self._closing or self._consecutive_failures:
                    due = 0.0
                candidates.append(max(due, self._retry_at_ms))
            elif not self._closing:
                last = self._last_contact_ms
                due = 0.0 if last is None else last + self.config.probe_interval_ms
                candidates.append(max(due, self._retry_at_ms))
        return min(candidates)

    def backoff_ms(self) -> float:
        n = max(self._consecutive_failures, 1)
        # min() before the power would be nicer, but the exponent is capped to avoid huge floats.
        return min(self.config.backoff_initial_ms * 2 ** min(n - 1, 32), self.config.backoff_max_ms)

    def healthy(self, now_ms: float) -> bool:
        if self._last_contact_ms is None or self._consecutive_failures:
            return False
        limit = self.config.unhealthy_after_ms
        if self._busy_id is not None and now_ms - self._busy_since_ms > limit:
            return False
        if self._pending and now_ms - self._oldest_pending_ms() > limit:
            return False
        return True

    def statistics(self, now_ms: float) -> dict:
        lat = sorted(self._latencies)

        def pct(q: float) -> float | None:
            return round(lat[min(len(lat) - 1, int(q * len(lat)))], 3) if lat else None

        stats: dict[str, Any] = dict(self._counts)
        stats.update(
            healthy=self.healthy(now_ms),
            pending_keys=len(self._pending),
            inflight_keys=len(self._inflight) if self._inflight is not None else 0,
            durable_keys=len(self._durable),
            waiting_requests=len(self._waiters),
            waiting_keys=self._waiting_keys,
            consecutive_failures=self._consecutive_failures,
            backoff_ms=self.backoff_ms() if self._consecutive_failures else 0,
            flush_latency_ms_last=round(self._latencies[-1], 3) if lat else None,
            flush_latency_ms_p50=pct(0.50),
            flush_latency_ms_p99=pct(0.99),
            flush_latency_ms_max=round(lat[-1], 3) if lat else None,
            ms_since_last_good_flush=(round(now_ms - self._last_flush_ok_ms, 1)
                                      if self._last_flush_ok_ms is not None else None),
            last_error=self._last_error,
            # [[upper bound ms, flushes in that bucket]], the last bound infinite (as None).
            flush_ms_buckets=[[None if b == float("inf") else b, n]
                              for b, n in zip(FLUSH_BUCKETS_MS, self._flush_buckets)],
            flush_ms_sum=round(self._flush_ms_sum, 3),
        )
        return stats

    # -- internals -------------------------------------------------------------------------

    def _maybe_flush(self, now_ms: float) -> list[Effect]:
        if self._busy_id is not None or now_ms < self._retry_at_ms:
            return []
        pending = self._pending
        if pending:
            due = (len(pending) >= self.config.batch_size or self._closing or self._consecutive_failures
                   or now_ms >= self._oldest_pending_ms() + self.config.flush_interval_ms)
            if not due:
                return []
            return [self._start_flush(now_ms)]
        if self._closing:
            return []
        if self._last_contact_ms is None or now_ms >= self._last_contact_ms + self.config.probe_interval_ms \
                or self._consecutive_failures:
            self._next_id += 1
            self._busy_id = self._next_id
            self._busy_since_ms = now_ms
            return [Probe(self._busy_id)]
        return []

    def _start_flush(self, now_ms: float) -> Flush:
        pending = self._pending
        if len(pending) <= self.config.batch_size:
            batch, self._pending = pending, collections.OrderedDict()
        else:
            # Oldest first, so the in-flight batch stays older than all that is left.
            batch = collections.OrderedDict()
            for _ in range(self.config.batch_size):
                key, ent = pending.popitem(last=False)
                batch[key] = ent
        self._inflight = batch
        self._next_id += 1
        self._busy_id = self._next_id
        self._busy_since_ms = now_ms
        return Flush(self._busy_id, [_to_row(ent[0]) for ent in batch.values()], self.coordinator_epoch)

    def _end_term(self, error: StaleEpoch) -> list[Effect]:
        """Drop what is pending and in flight (a term that is over) and answer every advance waiting."""
        dropped = len(self._pending) + (len(self._inflight) if self._inflight else 0)
        self._counts["advances_fenced"] += dropped
        self._pending = collections.OrderedDict()
        if self._inflight is not None:
            self._inflight_doomed = True
        effects: list[Effect] = []
        for w in self._waiters:
            # A load waited only for pending values to be written; there are none left.
            effects.append(Load(w.token) if w.keys is None else ReplyError(w.token, error))
        self._waiters.clear()
        self._waiting_keys = 0
        return effects

    def _merge_back(self, inflight: collections.OrderedDict) -> None:
        # In-flight entries are older than every pending one, so putting them first keeps the order.
        merged = inflight
        for key, ent in self._pending.items():
            old = merged.get(key)
            if old is None:
                merged[key] = ent
            elif _newer_or_equal(ent[0], old[0]):
                old[0] = ent[0]  # newest value, oldest demand
        self._pending = merged

    def _oldest_pending_ms(self) -> float:
        """When the oldest unmet value in pending arrived (pending must not be empty)."""
        return next(iter(self._pending.values()))[2]

    def _watermark(self) -> int:
        low = self._seq + 1
        if self._inflight:
            low = min(low, next(iter(self._inflight.values()))[1])
        if self._pending:
            low = min(low, next(iter(self._pending.values()))[1])
        return low - 1

    def _release(self) -> list[Effect]:
        waiters = self._waiters
        if not waiters:
            return []
        mark = self._watermark()
        effects: list[Effect] = []
        durable = self._durable
        while waiters and waiters[0].seq <= mark:
            w = waiters.popleft()
            if w.keys is None:
                effects.append(Load(w.token))
                continue
            self._waiting_keys -= len(w.keys)
            out = []
            seen = set()
            for key in w.keys:
                if key in seen:
                    continue
                seen.add(key)
                d = durable.get(key)
                if d is not None:
                    out.append([key[0], key[1], key[2], d[1], d[0]])
            effects.append(Reply(w.token, out))
        return effects

    def _shed(self) -> list[Effect]:
        effects: list[Effect] = []
        config = self.config
        # The newest request stays even if it alone names more keys than the cap.
        while len(self._waiters) > config.max_waiting_requests or (
                self._waiting_keys > config.max_waiting_keys and len(self._waiters) > 1):
            w = self._waiters.popleft()
            if w.keys is not None:
                self._waiting_keys -= len(w.keys)
            self._counts["requests_shed"] += 1
            effects.append(ReplyError(w.token, Unavailable(
                "too many requests waiting for the offset store; values are kept and will be written",
                retained=True, waiting=len(self._waiters), waiting_keys=self._waiting_keys)))
        return effects

    def _unavailable(self) -> Unavailable:
        return Unavailable("offset store unavailable", consecutive_failures=self._consecutive_failures,
                           last_error=self._last_error)
