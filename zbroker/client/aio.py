"""The asyncio client: `AsyncAdmin`, `AsyncProducer` and `AsyncConsumer`.

A driver, the sync client's twin: what each call does is written once, for
both drivers, in `consumer_flow` and `producer_flow` (the decisions under them
in `consumer_core`, `producer_core` and `fetch_round`); this module performs
their steps by awaiting, on a `connections.AsyncConnection`. The producer
lingers in one background task and sends from another; the consumer runs one
flow at a time (its turn) and heartbeats in a task of its own.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from typing import Any, AsyncIterator, Callable, Iterable

import structlog
import zmq
import zmq.asyncio

from zbroker.client.admin_calls import async_method, with_admin_calls
from zbroker.client.connections import AsyncConnection
from zbroker.client.consumer_core import ConsumerCore, RetryBackoff, core_field, failure_reason
from zbroker.client.consumer_flow import ConsumerDriver, ConsumerFlow
from zbroker.client.core import (ConsumedRecord, DeliveryHandle, PendingBatch, checked_partition, checked_record,
                                 checked_topics, record_size_estimate)
from zbroker.client.keys import ClientKeys
from zbroker.client.producer_core import ProduceError, ProducerCore, failure_fields
from zbroker.client.producer_flow import ProducerFlow, not_sent
from zbroker.client.steps import Connect, Coordinator, Endpoint, Notify, Send, Sleep, Wait, WaitAny, run_awaiting
from zbroker.client.transport import DEFAULT_URL
from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.errors import ErrorCode, Fenced, UnknownMember, ZBrokerError

log = structlog.get_logger("zbroker.client")


@with_admin_calls(async_method)
class AsyncAdmin:
    """The sync `Admin`'s calls (`admin_calls`), each a coroutine method here."""

    def __init__(self, url: str = DEFAULT_URL, *, request_timeout: float = 5.0,
                 curve: ClientKeys | None = None) -> None:
        self.conn = AsyncConnection(url, request_timeout=request_timeout, curve=curve)

    async def close(self) -> None:
        await self.conn.close()

    async def __aenter__(self) -> "AsyncAdmin":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class AsyncProducer:
    """Batching, pipelined, idempotent producer for asyncio.

    The window, the requests (`produce_many` per actor), retries and the failure
    report are `producer_core.ProducerCore`'s, as for the sync `Producer`. Closed
    batches wait in one FIFO queue that the producer owns; one sender task admits
    them to the window in order and sends them, with the retries due, and files
    each reply as its future resolves. `send` and `flush` only put batches in the
    queue and then wait for progress, so cancelling them (`asyncio.wait_for`)
    never drops a batch: whatever was handed over is sent, its handles resolve,
    and a failure is raised by the next `flush` or `close`.
    """

    def __init__(self, url: str = DEFAULT_URL, *, linger_ms: float = 5.0, batch_size: int = 1000,
                 batch_bytes: int = 1 << 20, max_in_flight_records: int = 10_000,
                 max_in_flight_bytes: int = 32 << 20, request_timeout: float = 5.0,
                 retries: int = 20, curve: ClientKeys | None = None) -> None:
        self.conn = AsyncConnection(url, request_timeout=request_timeout, curve=curve)
        self.core = ProducerCore(batch_size=batch_size, batch_bytes=batch_bytes,
                                 max_in_flight_records=max_in_flight_records,
                                 max_in_flight_bytes=max_in_flight_bytes, retries=retries,
                                 request_timeout=request_timeout)
        self.linger_s = linger_ms / 1000.0
        self.acc = self.core.acc
        self.flow = ProducerFlow(self.core, self.conn.metadata, time.monotonic)  # = the event loop's clock
        self._steps = {Endpoint: lambda step: self.conn.endpoint(step.topic, step.partition),
                       Send: self._send_request, Coordinator: lambda step: self.conn.coordinator(step.msg, step.timeout)}
        self.waiting_for_window: collections.deque[PendingBatch] = collections.deque()
        self._replies: dict[int, asyncio.Future] = {}  # corr -> the future of a request in flight
        # Every batch failure so far, and the last one: a flush() raises if any failed while
        # it waited, even when a concurrent flush() took the report first.
        self._failures = 0
        self._last_failure: ZBrokerError | None = None
        # Set when a batch leaves the queue or a reply is filed; whoever waits re-checks what it waits for.
        self._progress = asyncio.Event()
        self._wake = asyncio.Event()  # the sender's own: a batch queued, a reply filed
        self._linger_task: asyncio.Task | None = None
        self._sender: asyncio.Task | None = None
        self._closed = False  # set when close() starts: nothing sent after it could be delivered
        self._close_ended: asyncio.Future | None = None  # resolved when the close() that began it ends

    retries = core_field("retries")
    max_in_flight_records = core_field("max_in_flight_records")
    max_in_flight_bytes = core_field("max_in_flight_bytes")
    in_flight_records = core_field("in_flight_records")
    in_flight_bytes = core_field("in_flight_bytes")
    errors = core_field("errors")

    async def send(self, topic: str, value: bytes, key: bytes | None = None, headers: dict | None = None,
                   partition: int | None = None) -> DeliveryHandle:
        if self._closed:
            raise ProduceError("the producer is closed", code=ErrorCode.SHUTTING_DOWN)
        added = None
        if key is None and headers is None and partition is None and value.__class__ is bytes:
            # The usual record: appended to the sticky partition's open batch, if it has one.
            added = self.acc.add_keyless(topic, value, time.time_ns() // 1_000_000)
        if added is None:
            value, key, headers = checked_record(value, key, headers)
            self._start_background_tasks()
            if partition is not None:
                checked_partition(partition)
            else:
                if topic not in self.conn.metadata.topics:
                    await self.conn.refresh([topic])
                    if self._closed:  # close() began meanwhile: its flush would not see this record
                        raise ProduceError("the producer is closed", code=ErrorCode.SHUTTING_DOWN)
                partition = self.acc.choose_partition(topic, self.conn.metadata.partitions(topic), key)
            added = self.acc.add(topic, partition, [time.time_ns() // 1_000_000, key, value, headers],
                                 record_size_estimate(value, key, headers), time.monotonic())
        handle, batch = added
        if batch is not None:
            self._enqueue([batch])
        if self.waiting_for_window:
            # Backpressure: a caller that closes batches (or lets the linger timer close them)
            # faster than the window frees waits here. Cancelled, it loses nothing: the record
            # is in a batch already, and a closed batch is the sender's.
            await self._wait_until(lambda: not self.waiting_for_window)
        return handle

    def _start_background_tasks(self) -> None:
        loop = asyncio.get_running_loop()
        if self._linger_task is None:
            self._linger_task = loop.create_task(self._linger())
        if self._sender is None:
            self._sender = loop.create_task(self._send_in_order())
            self._sender.add_done_callback(lambda _task: self._progress.set())  # waiters must not hang

    def _enqueue(self, batches: list[PendingBatch]) -> None:
        if batches:
            self.waiting_for_window.extend(batches)
            self._wake.set()

    async def _wait_until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            if self._sender is not None and self._sender.done():
                raise ProduceError("the producer is closed", code=ErrorCode.SHUTTING_DOWN)
            self._progress.clear()
            await self._progress.wait()

    async def _linger(self) -> None:
        while True:
            await asyncio.sleep(max(self.linger_s, 0.001))
            self._enqueue(self.acc.due(time.monotonic(), self.linger_s))

    async def _send_in_order(self) -> None:
        """The only sender: admits the queued batches to the window in the order they were
        closed and sends them with the retries due, then sleeps until a batch is queued, a
        reply is filed or the core's next deadline (a retry, a request overdue)."""
        core, loop = self.core, asyncio.get_running_loop()
        while True:
            self._wake.clear()
            now = loop.time()
            if core.in_flight:
                waiting = len(core.in_flight)
                core.timed_out(now)  # retried, or failed for good
                if len(core.in_flight) < waiting:
                    for corr in [c for c in self._replies if c not in core.in_flight]:
                        self.conn.abandon(self._replies.pop(corr))  # a reply that comes after all is dropped
            await run_awaiting(self.flow.resend_due(also=lambda: core.admit_in_order(self.waiting_for_window)),
                               self._steps)
            self._filed()
            if self._wake.is_set():
                continue
            deadline = core.next_deadline()
            woken = loop.create_task(self._wake.wait())
            try:  # asyncio.wait, not wait_for: under 3.11 wait_for swallowed close()'s cancellation here
                await asyncio.wait([woken], timeout=None if deadline is None else max(0.0, deadline - loop.time()))
            finally:
                woken.cancel()

    async def _send_request(self, step: Send) -> int:
        """`ProducerFlow`'s Send: the reply's future files it with the core when it resolves."""
        fut = await self.conn.send(step.endpoint, step.msg, step.frames)
        self._replies[fut.corr_id] = fut
        fut.add_done_callback(self._replied)
        return fut.corr_id

    def _replied(self, fut: asyncio.Future) -> None:
        """A produce reply came (or the connection closed under it): the core files it."""
        corr = fut.corr_id  # type: ignore[attr-defined]
        self._replies.pop(corr, None)
        if fut.cancelled():
            return  # given up on (timed out, or close): the core knows already
        error, reply = fut.exception(), None
        if error is None:
            env = fut.result()
            error, reply = env.error, env.msg
        elif not isinstance(error, ZBrokerError):
            error = ProduceError(f"delivery failed: {error!r}")
        self.core.settle(corr, error, reply, asyncio.get_running_loop().time())
        self._filed()
        self._wake.set()

    def _filed(self) -> None:
        """Log the batches that failed for good (the core's record) and wake whoever waits."""
        for batch, err in self.core.take_failed():
            log.error("produce.failed", **failure_fields(batch, err))
            self._failures += 1
            self._last_failure = err
        self._progress.set()

    async def flush(self) -> None:
        """Wait until every batch, buffered or in flight, is acknowledged; raise what failed.

        Cancelled, it leaves the batches it drained in the queue and the requests in
        flight: the next flush() waits for them and reports their failures."""
        if self._closed:
            raise ProduceError("the producer is closed", code=ErrorCode.SHUTTING_DOWN)
        await self._flush()

    async def _flush(self) -> None:
        failures_before = self._failures
        self._start_background_tasks()
        self._enqueue(self.acc.drain())
        await self._wait_until(lambda: not self.waiting_for_window and not self.core.in_flight_records)
        self._filed()
        failure = self.core.take_failure()
        if failure is not None:
            raise failure
        if self._failures > failures_before and self._last_failure is not None:
            # Tasks flushing at once all wait for the same batches; the first to wake took the
            # report. The others must not return as if everything they sent was acknowledged.
            raise ProduceError(f"{self._failures - failures_before} batch(es) failed while this flush waited "
                               f"(raised by a concurrent flush too); last: {self._last_failure.message}",
                               code=self._last_failure.code)

    async def close(self) -> None:
        if self._close_ended is not None:
            # Another task is closing (a shutdown hook beside an `async with`): returning now,
            # before its flush, would let the caller exit with records not yet sent.
            await asyncio.shield(self._close_ended)
            return
        self._close_ended = asyncio.get_running_loop().create_future()
        try:
            await self._close()
        finally:
            self._close_ended.set_result(None)

    async def _close(self) -> None:
        self._closed = True
        try:
            await self._flush()
        finally:
            background = [t for t in (self._linger_task, self._sender) if t is not None]
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            # Left only if flush() failed or was cancelled, or a send() that was waiting for
            # metadata when close() began added its record after the flush drained: each
            # batch resolves its handles with an error rather than wait forever.
            unsent = [*self.waiting_for_window, *self.acc.drain()]
            self.waiting_for_window.clear()
            for corr in self.core.give_up(not_sent("acknowledged"), unsent):
                fut = self._replies.pop(corr, None)
                if fut is not None:
                    self.conn.abandon(fut)
            self._filed()
            await self.conn.close()

    async def __aenter__(self) -> "AsyncProducer":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class AsyncConsumer(ConsumerDriver):
    """A member of a consumer group for asyncio: poll leases, fetch their records, ack each one.

    What each call does is `consumer_flow.ConsumerFlow`'s, the sync `Consumer`'s flows
    (its docstring describes the options: read-ahead, poll-ahead, lease-ahead, acks
    riding on polls); this class performs their steps by awaiting. One flow runs at a
    time: tasks sharing a consumer take turns, and each record goes to one of them.
    Held acks leave on their own once ``ack_batch`` of them are held or
    ``ack_interval_ms`` after the first (a batch handled slowly must not lose the acks
    of its early records to the ack timeout). A heartbeat task beats every
    ``session_timeout_ms / 3``; refused, it re-joins (or, while a call runs, that call does).
    """

    def __init__(self, url: str = DEFAULT_URL, *, group: str, topics: list[str], member_id: str = "",
                 session_timeout_ms: int = 10_000, ack_batch: int = 1000, ack_interval_ms: float = 5.0,
                 request_timeout: float = 5.0,
                 on_assign: Callable[[list], Any] | None = None, on_revoke: Callable[[list], Any] | None = None,
                 curve: ClientKeys | None = None, read_ahead: bool = True, read_ahead_bytes: int = 32 << 20,
                 poll_ahead: bool = False, lease_ahead: bool = False, max_in_flight: int | None = None) -> None:
        topics = checked_topics(topics)  # before any socket exists: a TypeError leaves nothing open
        self.conn = AsyncConnection(url, request_timeout=request_timeout, curve=curve)
        self.core = ConsumerCore(group=group, topics=topics, member_id=member_id, ack_batch=ack_batch,
                                 ack_interval_s=ack_interval_ms / 1000.0, read_ahead=read_ahead,
                                 read_ahead_bytes=read_ahead_bytes, lease_ahead=lease_ahead,
                                 poll_ahead=poll_ahead, metadata=self.conn.metadata)
        # The loop's clock is time.monotonic (asyncio's default), and a flow may be made before the loop runs.
        self.flow = ConsumerFlow(self.core, self.conn, time.monotonic, session_timeout_ms=session_timeout_ms,
                                 on_assign=on_assign, on_revoke=on_revoke)
        self.max_in_flight = max_in_flight
        self._core_ack = self.core.ack
        self._steps = self.step_methods()
        # One flow at a time: two interleaved at their awaits could each send a Poll (the first
        # one's leases stranded until the ack timeout), fetch the same delivery, or both join.
        self._turn = asyncio.Lock()
        self._heartbeat_task: asyncio.Task | None = None
        self._ack_timer: asyncio.Task | None = None  # sleeping until the held acks are due


    async def start(self) -> "AsyncConsumer":
        try:
            if self.max_in_flight is not None:
                await self.conn.coordinator(m.ConfigureGroup(group=self.group, max_in_flight=self.max_in_flight))
            async with self._turn:
                await self._run(self.flow.join())
        except BaseException:
            await self.conn.close()
            raise
        self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeat())
        return self

    # -- the steps of a flow, performed by awaiting ----------------------------------------------

    async def _run(self, flow: Any) -> Any:
        return await run_awaiting(flow, self._steps)  # the caller holds the turn

    async def _send(self, step: Send) -> int:
        return await self.conn.send_request(self.conn.url if step.endpoint is None else step.endpoint, step.msg)

    async def _wait(self, step: Wait) -> codec.Envelope:
        return await self.conn.wait_reply(step.corr, step.timeout)

    async def _wait_any(self, step: WaitAny) -> None:
        await self.conn.wait_any(step.timeout)

    async def _endpoint(self, step: Endpoint) -> str:
        return await self.conn.endpoint(step.topic, step.partition)

    async def _coordinator(self, step: Coordinator) -> m.Message:
        return await self.conn.coordinator(step.msg, step.timeout)

    async def _sleep(self, step: Sleep) -> None:
        await asyncio.sleep(step.seconds)

    async def _notify(self, step: Notify) -> None:
        outcome = step.callback(step.partitions)
        if asyncio.iscoroutine(outcome):
            await outcome

    async def _connect(self, step: Connect) -> None:
        try:
            await self.conn.refresh(step.topics)
            for endpoint in self.conn.metadata.endpoints(step.assignment):
                self.conn.socket(endpoint)  # connects in the background
        except (ZBrokerError, zmq.ZMQError) as err:  # the fetch finds the owner again when it needs it
            log.info("consumer.connect_deferred", group=self.group, error=str(getattr(err, "code", err)))

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.session_timeout_ms / 3000.0)
            await self.beat()

    async def beat(self) -> None:
        """One heartbeat (the heartbeat task sends one every ``session_timeout_ms / 3``). Refused,
        the member re-joins now, or, while a call runs, that call re-joins at its next request."""
        member_id, generation = self.member_id, self.generation
        try:
            await self.conn.coordinator(self.core.member_request(m.Heartbeat))
        except (Fenced, UnknownMember) as err:
            if not self.core.rejoin_after(err, member_id, generation):
                return  # re-joined since it was sent
            self.flow.needs_rejoin = True
            if not self._turn.locked():
                async with self._turn:
                    if self.flow.needs_rejoin:
                        with contextlib.suppress(ZBrokerError):  # the coordinator is away: the next call joins
                            await self._run(self.flow.rejoin())
        except ZBrokerError:
            pass

    # -- the calls --------------------------------------------------------------------------------

    async def poll(self, max_records: int = 1000, timeout: float = 1.0) -> list[ConsumedRecord]:
        """Lease up to ``max_records`` and return their records (possibly none).

        The held acks ride on the Poll (`Poll.acks`). A poll() cancelled while its Poll
        waits at the coordinator leaves that Poll in flight: the next poll() takes its
        reply first, waiting for it at most its own ``timeout``. Tasks sharing one consumer
        may all call poll(): the calls take turns, and the wait for a turn counts against
        ``timeout`` (a call whose time is up before its turn comes returns []).
        """
        deadline = time.monotonic() + timeout
        if not await self._wait_for_turn(timeout):
            return []
        try:
            return await self._run(self.flow.poll(max_records, max(0.0, deadline - time.monotonic())))
        finally:
            self._turn.release()

    async def _wait_for_turn(self, timeout: float) -> bool:
        """Take `_turn` within `timeout`; False if the time ran out first.

        Not asyncio.wait_for: from 3.12 on it can raise TimeoutError after the
        lock was taken, which would leave it held for ever. An acquire cancelled
        before it ran never takes the lock; one that did is released here if this
        call is leaving (cancelled) rather than taking its turn.
        """
        acquire = asyncio.ensure_future(self._turn.acquire())
        taken = False
        try:
            await asyncio.wait([acquire], timeout=max(0.0, timeout))
            taken = acquire.done()
        finally:
            if not acquire.done():
                acquire.cancel()
            elif not taken:
                self._turn.release()
        return taken

    async def _in_turn(self, flow: Any) -> Any:
        async with self._turn:
            return await self._run(flow)

    async def ack(self, record: ConsumedRecord) -> None:
        # The clock is read only when the core says the held acks may be due (a full batch).
        if self._core_ack(record) and self.core.acks_due(time.monotonic()) and not self._turn.locked():
            await self._in_turn(self.flow.flush_acks(wait=False))
        elif self._ack_timer is None:  # the held acks go at their interval, polled or not
            self._ack_timer = asyncio.get_running_loop().create_task(self._flush_acks_when_due())

    async def ack_many(self, records: Iterable[ConsumedRecord]) -> None:
        for record in records:
            await self.ack(record)

    async def _flush_acks_when_due(self) -> None:
        """Send the held acks when they are due (a call holding the turn meanwhile sends them itself)."""
        try:
            while (due := self.core.acks_due_at(time.monotonic())) is not None:
                if due > time.monotonic():
                    await asyncio.sleep(due - time.monotonic())
                else:
                    await self._in_turn(self.flow.flush_acks_if_due())
                    if self.core.acks_due(time.monotonic()):
                        return  # not sent (held again after an error): the next call takes them
        except ZBrokerError as err:  # retriable ones are held again: they go with the next poll or interval
            log.warning("ack.deferred", group=self.group, code=err.code.value, reason=err.message)
        finally:
            self._ack_timer = None

    async def flush_acks(self) -> None:
        """Send the held acks and wait until every ack made before the call is applied (or its
        lease was gone); a failure is raised."""
        await self._in_turn(self.flow.flush_acks(wait=True))

    async def nack(self, records: Iterable[ConsumedRecord], *, delay_ms: int = 0, reason: str = "") -> int:
        return await self._in_turn(self.flow.lease_call(m.Nack, records, delay_ms=delay_ms, reason=reason))

    async def extend(self, records: Iterable[ConsumedRecord], *, extend_ms: int = 0) -> int:
        return await self._in_turn(self.flow.lease_call(m.Extend, records, extend_ms=extend_ms))

    async def reject(self, records: Iterable[ConsumedRecord], *, reason: str = "") -> int:
        return await self._in_turn(self.flow.lease_call(m.Reject, records, reason=reason))

    async def run(self, handler: Callable[[ConsumedRecord], Any], *, max_records: int = 1000,
                  stop: Callable[[], bool] = lambda: False) -> None:
        """Call ``handler`` per record (a coroutine function or a plain one): ack when it returns,
        nack (with the error) when it raises; until ``stop()`` says so, asked before each poll.
        Retriable errors are logged and retried with a backoff, any other is raised: the sync
        `Consumer.run`'s rules (`consumer_core.RetryBackoff`)."""
        backoff = RetryBackoff()
        while not stop():
            try:
                records = await self.poll(max_records)
            except ZBrokerError as err:
                await asyncio.sleep(backoff.next_delay(err, "poll", group=self.group))
                continue
            backoff.reset()
            for record in records:
                try:
                    outcome = handler(record)
                    if asyncio.iscoroutine(outcome):
                        await outcome
                except Exception as exc:  # the handler's failure is the record's nack reason
                    try:
                        await self.nack([record], reason=failure_reason(exc))
                    except ZBrokerError as err:  # not settled: its lease expires and it comes back
                        backoff.log_or_raise(err, "nack", group=self.group)
                else:
                    try:
                        await self.ack(record)
                    except ZBrokerError as err:  # the acks are held and go with the next request
                        backoff.log_or_raise(err, "ack", group=self.group)

    async def __aiter__(self) -> AsyncIterator[ConsumedRecord]:
        while True:
            for record in await self.poll():
                yield record
                await self.ack(record)

    async def close(self) -> None:
        """Flush the held acks (their failure is raised, as by the sync consumer: the
        application must know they were not applied), then leave the group. A call another
        task is making (a poll waiting at the coordinator) ends first: its records are handed
        out to it, not stranded."""
        if self.conn.closed:
            return
        try:
            if self._ack_timer is not None:
                self._ack_timer.cancel()
                await asyncio.gather(self._ack_timer, return_exceptions=True)
            await self._in_turn(self.flow.close(leave=True))
        finally:
            if self._heartbeat_task is not None:
                self._heartbeat_task.cancel()
                await asyncio.gather(self._heartbeat_task, return_exceptions=True)
            await self.conn.close()

    async def __aenter__(self) -> "AsyncConsumer":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
