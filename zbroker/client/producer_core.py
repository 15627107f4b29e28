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
and goes into the failure report that the next flush raises (`take_failure`).

Both drivers use this: the sync one pumps replies in `send`/`poll`/`flush`,
the asyncio one in a task per batch. Time comes in as ``now``.
"""

from __future__ import annotations

from typing import Any

from zbroker.client.core import BatchAccumulator, PendingBatch
from zbroker.protocol.errors import ErrorCode, RequestTimeout, ZBrokerError

RETRIABLE_PRODUCE = {ErrorCode.NOT_OWNER, ErrorCode.NOT_LEADER, ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT,
                     ErrorCode.SHUTTING_DOWN}
RETRY_STEP_S, RETRY_MAX_S = 0.05, 1.0


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
        self.errors: list[ZBrokerError] = []
        self.results: list[tuple[str, int, int, int]] = []  # (topic, partition, base_offset, count)
        self.keep_results = False
        self.stats = {"batches": 0, "records": 0, "retries": 0, "duplicates": 0}
        self.hints: list[tuple[str, int, str]] = []  # (topic, partition, leader endpoint) for the driver's metadata

    # -- the window ------------------------------------------------------------------------

    def busy(self) -> bool:
        return bool(self.in_flight or self.retrying)

    def has_room(self, batch: PendingBatch) -> bool:
        """Whether ``batch`` fits in the window now (an empty window takes any batch)."""
        if not (self.in_flight or self.retrying):
            return True
        return window_has_room(batch.count, len(batch.payload), self.in_flight_records, self.in_flight_bytes,
                               self.max_in_flight_records, self.max_in_flight_bytes)

    def admit(self, batch: PendingBatch) -> None:
        self.in_flight_records += batch.count
        self.in_flight_bytes += len(batch.payload)

    def _release(self, batch: PendingBatch) -> None:
        self.in_flight_records -= batch.count
        self.in_flight_bytes -= len(batch.payload)

    # -- what happened to a batch ----------------------------------------------------------

    def sent(self, corr: int, batch: PendingBatch, now: float) -> None:
        self.in_flight[corr] = (batch, now)

    def failed(self, batch: PendingBatch, err: ZBrokerError, now: float) -> bool:
        """An attempt failed: schedule a retry after a backoff (True), or fail the batch for good."""
        hint = leader_hint(err)
        if hint is not None:
            self.hints.append((batch.topic, batch.partition, hint))
        if should_retry(err, batch.attempts, self.retries):
            self.stats["retries"] += 1
            self.retrying.append((now + retry_delay(batch.attempts), batch))
            return True
        self._release(batch)
        self.errors.append(err)
        batch.failed(err)
        return False

    def replied(self, corr: Any, error: ZBrokerError | None, reply: Any, now: float) -> PendingBatch | None:
        """A produce reply came (ignored if its attempt was given up on already); returns
        its batch if that failed for good now (for the driver to log)."""
        entry = self.in_flight.pop(corr, None)
        if entry is None:
            return None
        batch = entry[0]
        if error is not None:
            return None if self.failed(batch, error, now) else batch
        self._release(batch)
        self.stats["batches"] += 1
        self.stats["records"] += reply.count
        if reply.duplicate:
            self.stats["duplicates"] += 1
        if self.keep_results:
            self.results.append((batch.topic, batch.partition, reply.base_offset, reply.count))
        batch.acknowledged(reply.base_offset)
        return None

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
            batch, _sent = self.in_flight.pop(corr)
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

    def take_hints(self) -> list[tuple[str, int, str]]:
        hints, self.hints = self.hints, []
        return hints

    def take_failure(self) -> ProduceError | None:
        """The report of the batches that failed since the last one (None: none did)."""
        if not self.errors:
            return None
        errors, self.errors = self.errors, []
        return failure_report(errors)
