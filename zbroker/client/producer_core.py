"""The producer's decisions, without I/O: the in-flight window, retries, the failure report.

Theory of operation
-------------------
Records are gathered into batches by `core.BatchAccumulator` (per partition,
with the idempotent producer's sequences). A closed batch is *admitted* to the
window when the records and bytes in flight leave room for it (`has_room`),
then sent by the driver, which reports the correlation id (`sent`) and later
the reply (`replied`) or its absence (`timed_out`). A failure is retried with
a capped backoff while the error is retriable and attempts remain
(`failed`); the batch keeps its (producer_id, sequence), so a retry after a
timeout is stored once. A NOT_LEADER or NOT_OWNER answer that names the new
leader (``data.leader.endpoint``) is a hint the driver writes into its
metadata (`leader_hint`) before the retry: a failover is a pause for the
sender, not an error. A batch that fails for good is settled on its handles
and goes into the failure report that the next flush raises (`take_failure`);
it is also kept, with why, for the driver to log (`take_failed`, `failure_fields`):
a core does no I/O, logging included.

Batches that go out together (those a linger expired at once, a flush, the
retries due) are grouped per partition actor (`group_by_actor`): two or more
for one actor travel as one `produce_many` (`produce_many_request`), so a
topic of 1,024 partitions costs a request per actor, not per partition. Its
reply settles each batch by its own part (`settle`); an actor that answers
UNKNOWN_OP predates the op and gets single `produce` requests from then on,
the batches resent at once without counting an attempt.

Both drivers use this: the sync one pumps replies in `send`/`poll`/`flush`,
the asyncio one files each reply as its future resolves and sends from one
task, woken by a reply, a new batch or `next_deadline` (a retry due, a request
overdue). A driver that stops gives up on what is left (`give_up`). Time comes
in as ``now``.
"""

from __future__ import annotations

from typing import Any

from zbroker.client.core import BatchAccumulator, PendingBatch
from zbroker.protocol import messages as m
from zbroker.protocol.errors import ErrorCode, ProtocolError, RequestTimeout, ZBrokerError

RETRIABLE_PRODUCE = {ErrorCode.NOT_OWNER, ErrorCode.NOT_LEADER, ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT,
                     ErrorCode.SHUTTING_DOWN}
RETRY_STEP_S, RETRY_MAX_S = 0.05, 1.0
PUMP_WAIT_S = 0.05  # the sync driver's longest wait for a reply: linger and retries are checked between waits
# One produce_many carries at most this many bytes of payload: well within the actors'
# 64 MiB frame limit, and a request the actor handles in a few milliseconds.
MAX_MANY_BYTES = 8 << 20


class SentTogether:
    """The batches of one `produce_many`, and the actor they went to."""

    __slots__ = ("endpoint", "batches")

    def __init__(self, endpoint: str, batches: list[PendingBatch]) -> None:
        self.endpoint = endpoint
        self.batches = batches


def produce_many_request(batches: list[PendingBatch]) -> tuple[m.ProduceMany, bytes]:
    """The `produce_many` carrying `batches` (of one actor), and its payload frame."""
    parts = [[b.topic, b.partition, b.producer_id, b.sequence, len(b.payload)] for b in batches]
    return m.ProduceMany(parts=parts), b"".join(b.payload for b in batches)


class ProduceError(ZBrokerError):
    """A batch failed for good (not retriable, or out of retries)."""


def retry_delay(attempts: int) -> float:
    """The pause before a batch's next attempt: growing with its attempts, capped at a second."""
    return min(RETRY_STEP_S * attempts, RETRY_MAX_S)


def should_retry(err: ZBrokerError, attempts: int, retries: int) -> bool:
    return (err.retriable or err.code in RETRIABLE_PRODUCE) and attempts <= retries


def leader_hint(err: ZBrokerError) -> str | None:
    """The endpoint a NOT_LEADER or NOT_OWNER error names as the partition's leader now, if any."""
    if err.code not in (ErrorCode.NOT_LEADER, ErrorCode.NOT_OWNER):
        return None
    leader = err.data.get("leader") if isinstance(err.data, dict) else None
    endpoint = leader.get("endpoint") if isinstance(leader, dict) else None
    return endpoint if isinstance(endpoint, str) and endpoint else None


def window_has_room(records: int, size: int, in_flight_records: int, in_flight_bytes: int,
                    max_records: int, max_bytes: int) -> bool:
    """Whether a batch of ``records`` records and ``size`` bytes fits in a window holding the
    others: an empty window takes any batch (one larger than the window would never go)."""
    if not in_flight_records and not in_flight_bytes:
        return True
    return in_flight_records + records <= max_records and in_flight_bytes + size <= max_bytes


def failure_fields(batch: PendingBatch, err: ZBrokerError) -> dict[str, Any]:
    """The context a driver logs ``produce.failed`` with, for a batch that failed for good."""
    return {"topic": batch.topic, "partition": batch.partition, "code": err.code.value, "reason": err.message,
            "attempts": batch.attempts}


def failure_report(errors: list[ZBrokerError], **extra: Any) -> ProduceError:
    first = errors[0]
    return ProduceError(f"{len(errors)} batch(es) failed; first: {first.message}", code=first.code,
                        first=first.to_wire(), failed=len(errors), **extra)


class ProducerCore:
    """Batches, the window they are sent through, and what became of each."""

    def __init__(self, *, batch_size: int = 1000, batch_bytes: int = 1 << 20, max_in_flight_records: int = 10_000,
                 max_in_flight_bytes: int = 32 << 20, retries: int = 20, request_timeout: float = 5.0,
                 producer_id: int | None = None) -> None:
        self.acc = BatchAccumulator(batch_size=batch_size, batch_bytes=batch_bytes, producer_id=producer_id)
        self.max_in_flight_records = max_in_flight_records
        self.max_in_flight_bytes = max_in_flight_bytes
        self.retries = retries
        self.request_timeout = request_timeout
        self.in_flight: dict[int, tuple[PendingBatch, float]] = {}  # corr -> (batch, sent at), in send order
        self.retrying: list[tuple[float, PendingBatch]] = []  # (resend at, batch), after a retriable failure
        self.in_flight_records = 0  # admitted and not yet settled (sent, or waiting to be resent)
        self.in_flight_bytes = 0
        self.errors: list[ZBrokerError] = []  # for the next failure report (`take_failure`)
        self.failed_now: list[tuple[PendingBatch, ZBrokerError]] = []  # for the driver's log (`take_failed`)
        self.results: list[tuple[str, int, int, int]] = []  # (topic, partition, base_offset, count)
        self.keep_results = False
        self.stats = {"batches": 0, "records": 0, "retries": 0, "duplicates": 0}
        self.hints: list[tuple[str, int, str]] = []  # (topic, partition, leader endpoint) for the driver's metadata
        self.single_only: set[str] = set()  # endpoints of actors without produce_many (UNKNOWN_OP)

    # -- the window ------------------------------------------------------------------------

    def busy(self) -> bool:
        return bool(self.in_flight or self.retrying)

    def has_room(self, batch: PendingBatch) -> bool:
        """Whether ``batch`` fits in the window now (an empty window takes any batch). The
        window holds what was admitted and is not settled: sent, waiting to be resent, or
        admitted with others and not sent yet."""
        return window_has_room(batch.count, len(batch.payload), self.in_flight_records, self.in_flight_bytes,
                               self.max_in_flight_records, self.max_in_flight_bytes)

    def admit(self, batch: PendingBatch) -> None:
        self.in_flight_records += batch.count
        self.in_flight_bytes += len(batch.payload)

    def admit_in_order(self, queue: Any) -> list[PendingBatch]:
        """Take from the front of ``queue`` (a deque of closed batches) what the window has room
        for, admitted, stopping at the first that does not fit: the batches of one partition
        leave in the order they were closed, and a large one is not overtaken for ever."""
        admitted = []
        while queue and self.has_room(queue[0]):
            batch = queue.popleft()
            self.admit(batch)
            admitted.append(batch)
        return admitted

    def _release(self, batch: PendingBatch) -> None:
        self.in_flight_records -= batch.count
        self.in_flight_bytes -= len(batch.payload)

    # -- what happened to a batch ----------------------------------------------------------

    def sent(self, corr: int, batch: PendingBatch | SentTogether, now: float) -> None:
        self.in_flight[corr] = (batch, now)

    def produce_request(self, batch: PendingBatch) -> m.Produce | None:
        """One attempt more of ``batch`` alone: its request, or None when it fails now (larger
        than a frame may be: not retriable)."""
        batch.attempts += 1
        refused = batch.over_frame_limit()
        if refused is not None:
            self._failed_for_good(batch, refused)
            return None
        return m.Produce(topic=batch.topic, partition=batch.partition, producer_id=batch.producer_id,
                         sequence=batch.sequence)

    def requests(self, routed: list[tuple[str, PendingBatch]]) -> list[tuple[str, m.Message, tuple, Any]]:
        """The requests that send (or resend) the ``routed`` batches, admitted to the window:
        (endpoint, request, frames, what `sent` files it as). Batches of one actor go
        together as a `produce_many` (`group_by_actor`), one attempt more each."""
        out = []
        for endpoint, group in self.group_by_actor(routed):
            if len(group) == 1:
                msg = self.produce_request(group[0])
                if msg is not None:
                    out.append((endpoint, msg, (group[0].payload,), group[0]))
                continue
            for batch in group:
                batch.attempts += 1
            msg, frame = produce_many_request(group)
            out.append((endpoint, msg, (frame,), SentTogether(endpoint, group)))
        return out

    def unroutable(self, batch: PendingBatch, err: ZBrokerError, now: float) -> None:
        """No owner is known for the batch's partition (or the question failed): an attempt that failed."""
        batch.attempts += 1
        self.failed(batch, err, now)

    def send_failed(self, sent: PendingBatch | SentTogether, err: ZBrokerError, now: float) -> None:
        for batch in (sent.batches if type(sent) is SentTogether else (sent,)):
            self.failed(batch, err, now)

    def group_by_actor(self, routed: list[tuple[str, PendingBatch]]) -> list[tuple[str, list[PendingBatch]]]:
        """(endpoint, batch) pairs as the requests to send: per endpoint in the order first
        seen, a batch alone where its actor takes only `produce`, else as many as one
        `produce_many` carries (MAX_PARTS_PER_REQUEST, MAX_MANY_BYTES)."""
        by_endpoint: dict[str, list[list]] = {}  # endpoint -> [[bytes, batches], ...]
        for endpoint, batch in routed:
            groups = by_endpoint.setdefault(endpoint, [[0, []]])
            group = groups[-1]
            size = len(batch.payload)
            if group[1] and (endpoint in self.single_only or len(group[1]) >= m.MAX_PARTS_PER_REQUEST
                             or group[0] + size > MAX_MANY_BYTES):
                group = [0, []]
                groups.append(group)
            group[0] += size
            group[1].append(batch)
        return [(endpoint, batches) for endpoint, groups in by_endpoint.items() for _size, batches in groups]

    def failed(self, batch: PendingBatch, err: ZBrokerError, now: float) -> bool:
        """An attempt failed: schedule a retry after a backoff (True), or fail the batch for good."""
        hint = leader_hint(err)
        if hint is not None:
            self.hints.append((batch.topic, batch.partition, hint))
        if should_retry(err, batch.attempts, self.retries):
            self.stats["retries"] += 1
            self.retrying.append((now + retry_delay(batch.attempts), batch))
            return True
        self._failed_for_good(batch, err)
        return False

    def _failed_for_good(self, batch: PendingBatch, err: ZBrokerError, admitted: bool = True) -> None:
        if admitted:
            self._release(batch)
        self.errors.append(err)
        self.failed_now.append((batch, err))
        batch.failed(err)

    def give_up(self, err: ZBrokerError, unsent: list[PendingBatch] = ()) -> list[int]:
        """The driver stops (a close that gave up waiting): every batch in flight or waiting
        for a retry fails for good with ``err``, and so do ``unsent`` ones (closed, never
        admitted). Returns the ids of the requests no longer waited for."""
        abandoned = list(self.in_flight)
        sent = [entry[0] for entry in self.in_flight.values()]
        self.in_flight.clear()
        batches = [b for s in sent for b in (s.batches if type(s) is SentTogether else (s,))]
        batches += [b for _at, b in self.retrying]
        self.retrying = []
        for batch in batches:
            self._failed_for_good(batch, err)
        for batch in unsent:
            self._failed_for_good(batch, err, admitted=False)
        return abandoned

    def take_failed(self) -> list[tuple[PendingBatch, ZBrokerError]]:
        """The batches that failed for good since the last call, with why: the driver logs each
        (`failure_fields`). The flush's report is `take_failure`'s, apart from this."""
        failed, self.failed_now = self.failed_now, []
        return failed

    def replied(self, corr: Any, error: ZBrokerError | None, reply: Any, now: float) -> PendingBatch | None:
        """A produce reply came (ignored if its attempt was given up on already); returns
        its batch if that failed for good now."""
        failed = self.settle(corr, error, reply, now)
        return failed[0][0] if failed else None

    def settle(self, corr: Any, error: ZBrokerError | None, reply: Any,
               now: float) -> list[tuple[PendingBatch, ZBrokerError]]:
        """A produce or produce_many reply came (ignored if its attempt was given up on
        already); returns the batches that failed for good now, with why."""
        entry = self.in_flight.pop(corr, None)
        if entry is None:
            return []
        sent = entry[0]
        if type(sent) is not SentTogether:
            if error is not None:
                return [] if self.failed(sent, error, now) else [(sent, error)]
            self._acknowledged(sent, reply.base_offset, reply.count, reply.duplicate)
            return []
        if error is not None and error.code is ErrorCode.UNKNOWN_OP:
            # An actor older than produce_many did nothing: each batch goes again, alone.
            self.single_only.add(sent.endpoint)
            for batch in sent.batches:
                batch.attempts -= 1
                self.retrying.append((now, batch))
            return []
        if error is None and len(reply.results) != len(sent.batches):
            error = ProtocolError("produce_many reply has not one result per part", op="produce_many",
                                  expected=len(sent.batches), got=len(reply.results))
        gave_up = []
        for index, batch in enumerate(sent.batches):
            part_error = error
            if part_error is None:
                base_offset, count, duplicate, wire_error = reply.results[index]
                if wire_error is None:
                    self._acknowledged(batch, base_offset, count, duplicate)
                    continue
                part_error = ZBrokerError.from_wire(wire_error)
            if not self.failed(batch, part_error, now):
                gave_up.append((batch, part_error))
        return gave_up

    def _acknowledged(self, batch: PendingBatch, base_offset: int, count: int, duplicate: bool) -> None:
        self._release(batch)
        self.stats["batches"] += 1
        self.stats["records"] += count
        if duplicate:
            self.stats["duplicates"] += 1
        if self.keep_results:
            self.results.append((batch.topic, batch.partition, base_offset, count))
        batch.acknowledged(base_offset)

    def timed_out(self, now: float) -> list[PendingBatch]:
        """Requests without a reply within the request timeout fail as TIMEOUT (and are
        retried); returns the batches that failed for good now."""
        # `in_flight` is in send order (a resend gets a new id at the end), so the late
        # ones are a prefix: with linger_ms=0 the window holds a thousand requests.
        cutoff = now - self.request_timeout
        late = []
        for corr, (_b, sent) in self.in_flight.items():
            if sent >= cutoff:
                break
            late.append(corr)
        given_up = []
        for corr in late:
            sent, _at = self.in_flight.pop(corr)
            for batch in (sent.batches if type(sent) is SentTogether else (sent,)):
                if not self.failed(batch, RequestTimeout("produce timed out", topic=batch.topic,
                                                         partition=batch.partition), now):
                    given_up.append(batch)
        return given_up

    def due(self, now: float) -> list[PendingBatch]:
        """Batches whose retry backoff is over, in (topic, partition, sequence) order."""
        if not self.retrying:
            return []
        due = [b for at, b in self.retrying if at <= now]
        if due:
            self.retrying = [(at, b) for at, b in self.retrying if at > now]
        return sorted(due, key=lambda b: (b.topic, b.partition, b.sequence))

    def next_retry_at(self) -> float | None:
        return min(at for at, _b in self.retrying) if self.retrying else None

    def next_deadline(self) -> float | None:
        """When the driver must call again even if no reply comes: the next retry, or the
        oldest request's timeout (`timed_out`). None: only a reply or a new batch matters."""
        times = [self.next_retry_at()]
        if self.in_flight:
            times.append(next(iter(self.in_flight.values()))[1] + self.request_timeout)
        times = [t for t in times if t is not None]
        return min(times) if times else None

    def pump_wait(self, timeout_s: float, now: float) -> float:
        """How long the sync driver waits for a reply: ``timeout_s``, at most `PUMP_WAIT_S`,
        and not past the next retry."""
        wait = min(timeout_s, PUMP_WAIT_S)
        retry_at = self.next_retry_at()
        return wait if retry_at is None else max(0.0, min(wait, retry_at - now))

    def resends(self, now: float) -> tuple[list[PendingBatch], list[tuple[str, int, str]], list[str]]:
        """The batches due for a retry, the leader hints to write into the metadata first,
        and the topics to ask the coordinator about again (where do they live now? once each)."""
        due = self.due(now)
        if not due:
            return [], [], []
        return due, self.take_hints(), list(dict.fromkeys(b.topic for b in due))

    def take_hints(self) -> list[tuple[str, int, str]]:
        hints, self.hints = self.hints, []
        return hints

    def take_failure(self) -> ProduceError | None:
        """The report of the batches that failed since the last one (None: none did)."""
        if not self.errors:
            return None
        errors, self.errors = self.errors, []
        return failure_report(errors)
