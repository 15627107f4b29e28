"""The asyncio twin of the client: `AsyncAdmin`, `AsyncProducer`, `AsyncConsumer`.

Same decisions as the sync client (`producer_core.ProducerCore`, `consumer_core`,
`fetch_round.FetchRound`, `transport`, `core`: the same objects, called from
here), with asyncio transport: one reader task per socket resolves the future of
each request by correlation id, the producer lingers in one background task and
sends from another, and the consumer heartbeats in one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
from typing import Any, AsyncIterator, Callable, Iterable

import structlog
import zmq
import zmq.asyncio

from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.errors import ErrorCode, Fenced, RequestTimeout, StaleLease, Unavailable, UnknownMember, ZBrokerError
from zbroker.client.core import (ChunkedSettle, ConsumedRecord,
                                 DeliveryHandle, MetadataCache, PendingBatch, checked_partition, checked_record,
                                 checked_topics, group_by_lease,
                                 in_request_sized_chunks, record_size_estimate)
from zbroker.client.admin_calls import async_method, with_admin_calls
from zbroker.client.keys import ClientKeys
from zbroker.client.consumer_core import (ACK_STALE, FOLLOW, READ_AHEAD_WAIT_S, REJOIN, ConsumerCore, GroupCallRetry,
                                          PollSent, RetryBackoff, connection_field, core_field, failure_reason,
                                          max_wait_ms)
from zbroker.client.fetch_round import FetchRound
from zbroker.client.producer_core import ProduceError, ProducerCore, failure_fields
from zbroker.client.sockets import client_dealer, curve_from_env
from zbroker.client.transport import DEFAULT_URL, Coordinators

log = structlog.get_logger("zbroker.client")


class AsyncConnection:
    """Sockets to the coordinator and the partition actors; a reader task per socket resolves
    each request's future by correlation id. ``url`` may list several coordinators,
    comma-separated: coordinator requests follow NOT_COORDINATOR as the sync `Connection`'s do."""

    def __init__(self, url: str = DEFAULT_URL, *, request_timeout: float = 5.0,
                 curve: ClientKeys | None = None) -> None:
        self.url = url
        self.request_timeout = request_timeout
        self.curve = curve if curve is not None else curve_from_env()
        self.ctx = zmq.asyncio.Context()
        self.sockets: dict[str, zmq.asyncio.Socket] = {}
        self.readers: list[asyncio.Task] = []
        self.waiting: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self.metadata = MetadataCache()
        self.closed = False

    @property
    def url(self) -> str:
        """The coordinator this connection talks to now."""
        return self.coordinators.current

    @url.setter
    def url(self, url: str) -> None:
        self.coordinators = Coordinators(url)

    def socket(self, endpoint: str) -> zmq.asyncio.Socket:
        if self.closed:
            raise Unavailable("the connection is closed", endpoint=endpoint)
        sock = self.sockets.get(endpoint)
        if sock is None:
            sock = client_dealer(self.ctx, endpoint, self.request_timeout, self.curve)
            self.sockets[endpoint] = sock
            self.readers.append(asyncio.get_running_loop().create_task(self._read(sock)))
        return sock

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                env = codec.decode_reply(frames)
            except ZBrokerError:
                continue
            fut = self.waiting.pop(env.corr_id, None) if isinstance(env.corr_id, int) else None
            if fut is not None and not fut.done():
                fut.set_result(env)

    async def send(self, endpoint: str, msg: m.Message, frames: tuple = ()) -> asyncio.Future:
        """Send a request; returns the future of its reply. A fetch with `follow` gets its later
        replies under id + 1 .. id + follow (PROTOCOL.md s.4): each has a future of its own, in
        the returned one's ``later`` list, so they match no other request and none is dropped."""
        corr = next(self._ids)
        loop = asyncio.get_running_loop()
        futures = [loop.create_future()]
        for _ in range(getattr(msg, "follow", 0) or 0):
            futures.append(loop.create_future())
            next(self._ids)
        for i, future in enumerate(futures):
            future.corr_id = corr + i  # type: ignore[attr-defined]
            self.waiting[corr + i] = future
        fut = futures[0]
        fut.later = futures[1:]  # type: ignore[attr-defined]
        try:
            await self.socket(endpoint).send_multipart(codec.encode_request(msg, corr, frames))
        except zmq.Again:
            self.abandon(fut)
            raise Unavailable(f"no connection to {endpoint}", endpoint=endpoint) from None
        except BaseException:
            # Cancelled while the send waited for a connection (it is then dropped unsent), or
            # refused: nobody will wait for this id, and nothing else would ever remove it.
            self.abandon(fut)
            raise
        return fut

    async def wait(self, fut: asyncio.Future, timeout: float | None = None) -> codec.Envelope:
        try:
            return await asyncio.wait_for(fut, self.request_timeout if timeout is None else timeout)
        except asyncio.TimeoutError:
            self.abandon(fut)
            raise RequestTimeout("no reply in time") from None
        except asyncio.CancelledError:
            # The caller gave up (asyncio.wait_for, a TaskGroup): forget the request as a timeout
            # does. Left in `waiting`, it would stay there for good if no reply ever comes (the
            # peer died), one entry per call given up on.
            self.abandon(fut)
            raise

    def abandon(self, fut: asyncio.Future) -> None:
        """Stop waiting for the reply (replies) of ``fut``'s request: if it comes, the reader drops it."""
        for future in [fut, *getattr(fut, "later", ())]:
            self.waiting.pop(getattr(future, "corr_id", None), None)
            future.cancel()

    async def call(self, endpoint: str, msg: m.Message, frames: tuple = (), timeout: float | None = None
                   ) -> codec.Envelope:
        env = await self.wait(await self.send(endpoint, msg, frames), timeout)
        if env.error is not None:
            raise env.error
        return env

    async def coordinator(self, msg: m.Message, timeout: float | None = None) -> m.Message:
        """A request to the coordinator, following NOT_COORDINATOR (and, with several URLs,
        timeouts) to the next one after a capped backoff (`transport.Coordinators`)."""
        coordinators = self.coordinators
        for attempt in range(coordinators.attempts()):
            try:
                reply = (await self.call(self.url, msg, timeout=timeout)).msg
            except ZBrokerError as err:
                wait = coordinators.retry_in(err, attempt)
                if wait is None:
                    raise
                await asyncio.sleep(wait)
                continue
            coordinators.answered()
            return reply
        raise AssertionError("unreachable")

    async def refresh(self, topics: list[str] | None = None) -> None:
        self.metadata.update((await self.coordinator(m.Metadata(topics=topics))).topics)

    async def endpoint(self, topic: str, partition: int) -> str:
        if topic not in self.metadata.topics or self.metadata.endpoint(topic, partition) is None:
            await self.refresh([topic])
        endpoint = self.metadata.endpoint(topic, partition)
        if endpoint is None:
            raise Unavailable(f"partition {topic}/{partition} has no live owner", topic=topic, partition=partition)
        return endpoint

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        readers, self.readers = self.readers, []
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        # Calls still waiting (another task's poll, fetch or admin request) fail with an error
        # they can catch. Cancelled, they raised CancelledError in tasks nobody cancelled: a
        # TaskGroup takes such a task for cancelled and drops it silently, and `await task`
        # passes the cancellation on to whoever awaits it.
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(Unavailable("the connection was closed before the reply came", endpoint=self.url))
        self.waiting.clear()
        for sock in self.sockets.values():
            sock.close(linger=0)
        self.sockets.clear()
        self.ctx.term()


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
            due, hints, topics = core.resends(now)
            for topic, partition, endpoint in hints:  # the new leader, as the error named it
                self.conn.metadata.redirect(topic, partition, endpoint)
            try:
                for topic in topics:
                    with contextlib.suppress(ZBrokerError):
                        await self.conn.refresh([topic])
            except BaseException:
                self._not_sent(due)
                raise
            admitted = core.admit_in_order(self.waiting_for_window)
            if due or admitted:
                await self._send_all(due + admitted)
            self._filed()
            if self._wake.is_set():
                continue
            deadline = core.next_deadline()
            woken = loop.create_task(self._wake.wait())
            try:  # asyncio.wait, not wait_for: under 3.11 wait_for swallowed close()'s cancellation here
                await asyncio.wait([woken], timeout=None if deadline is None else max(0.0, deadline - loop.time()))
            finally:
                woken.cancel()

    async def _send_all(self, batches: list[PendingBatch]) -> None:
        """Send (or resend) batches admitted to the window, as `ProducerCore.requests` says."""
        core, loop, routed = self.core, asyncio.get_running_loop(), []
        for i, batch in enumerate(batches):
            try:
                routed.append((await self.conn.endpoint(batch.topic, batch.partition), batch))
            except ZBrokerError as err:
                core.unroutable(batch, err, loop.time())
            except BaseException:  # cancelled (close gave up), or a bug: none of the rest was sent
                self._not_sent([b for _e, b in routed] + batches[i:])
                raise
        requests = core.requests(routed)
        for i, (endpoint, msg, frames, sent) in enumerate(requests):
            try:
                fut = await self.conn.send(endpoint, msg, frames)
            except ZBrokerError as err:
                core.send_failed(sent, err, loop.time())
                continue
            except asyncio.CancelledError:
                for _e, _m, _f, unsent in requests[i:]:
                    core.send_failed(unsent, _closing("sent"), loop.time())
                raise
            except Exception as exc:  # a bug or a broken socket: flush() must report it, not succeed
                core.send_failed(sent, ProduceError(f"delivery failed: {exc!r}"), loop.time())
                continue
            core.sent(fut.corr_id, sent, loop.time())
            self._replies[fut.corr_id] = fut
            fut.add_done_callback(self._replied)

    def _not_sent(self, batches: list[PendingBatch]) -> None:
        for batch in batches:
            self.core.unroutable(batch, _closing("sent"), asyncio.get_running_loop().time())

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
            for corr in self.core.give_up(_closing("acknowledged"), unsent):
                fut = self._replies.pop(corr, None)
                if fut is not None:
                    self.conn.abandon(fut)
            self._filed()
            await self.conn.close()

    async def __aenter__(self) -> "AsyncProducer":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


def _closing(what: str) -> ProduceError:
    return ProduceError(f"the producer closed before the batch was {what}", code=ErrorCode.SHUTTING_DOWN)


class AsyncConsumer:
    """A member of a consumer group for asyncio: poll leases, fetch their records, ack each one.

    Acks are folded into ranges and ride on the next poll, or leave on their own
    once ``ack_batch`` of them are held or ``ack_interval_ms`` after the first
    (a batch handled slowly must not lose the acks of its early records to the
    ack timeout). A heartbeat task beats every ``session_timeout_ms / 3``.
    """

    def __init__(self, url: str = DEFAULT_URL, *, group: str, topics: list[str], session_timeout_ms: int = 10_000,
                 ack_batch: int = 1000, ack_interval_ms: float = 5.0, request_timeout: float = 5.0,
                 on_assign: Callable[[list], Any] | None = None, on_revoke: Callable[[list], Any] | None = None,
                 curve: ClientKeys | None = None, read_ahead: bool = True, read_ahead_bytes: int = 32 << 20,
                 poll_ahead: bool = False, lease_ahead: bool = False) -> None:
        self.topics = checked_topics(topics)  # before any socket exists: a TypeError leaves nothing open
        # The sync Consumer's ahead modes, with its decisions (`ConsumerCore`): read_ahead fetches
        # where the next lease will start (exclusive groups); poll_ahead sends the next Poll as
        # poll() returns (it is the Poll in flight the next poll() takes); lease_ahead asks for
        # ahead leases, served as the parked read-ahead fetches bring their records.
        # The read-ahead fetch out per partition: the futures of its replies (a followed fetch has many).
        self._ahead_fetches: dict[tuple[str, int], list[asyncio.Future]] = {}
        self.conn = AsyncConnection(url, request_timeout=request_timeout, curve=curve)
        # Membership and the rejoin rule are the core's, shared with the sync Consumer.
        self.core = ConsumerCore(group=group, topics=self.topics, ack_batch=ack_batch,
                                 ack_interval_s=ack_interval_ms / 1000.0, read_ahead=read_ahead,
                                 read_ahead_bytes=read_ahead_bytes, lease_ahead=lease_ahead,
                                 poll_ahead=poll_ahead, metadata=self.conn.metadata)
        self.on_assign = on_assign
        self.on_revoke = on_revoke
        self.group = group
        self.session_timeout_ms = session_timeout_ms
        self.ack_batch = ack_batch
        self.ack_interval_s = ack_interval_ms / 1000.0
        self._heartbeat_task: asyncio.Task | None = None
        self._ack_timer: asyncio.Task | None = None  # sleeping until the held acks are due
        self._ack_timers: set[asyncio.Task] = set()  # sleeping or sending
        # One future per ack send in progress, resolved with its error or None when it ends:
        # flush_acks() waits for the sends other tasks (an interval timer) started.
        self._ack_sends: set[asyncio.Future] = set()
        # One join at a time: the heartbeat task and a poll both refused as an unknown member
        # would otherwise each join as a new one, and the orphan would hold partitions.
        self._join_lock = asyncio.Lock()
        # One poll() at a time: two interleaved at their awaits could each send a Poll (the
        # first one's leases stranded until the ack timeout) or fetch the same delivery.
        self._poll_lock = asyncio.Lock()
        self._poll_in_flight: PollSent | None = None  # its reply is a future; kept when a poll() is cancelled
        # Deliveries of a poll reply not fetched yet, each [topic, partition, lease, next offset, end,
        # attempt, reason]: a poll() cancelled while it fetched leaves them to the next one, instead
        # of stranding their leases until the ack timeout (each strand costs a delivery attempt).
        self._to_fetch: list[list] = []

    member_id = core_field("member_id")
    generation = core_field("generation")
    assignment = core_field("assignment")
    mode = core_field("mode")
    poll_ahead = core_field("poll_ahead")
    stats = core_field("stats")
    acks = core_field("acks")  # the core's accumulator: `poll_refused` and `hold_again` put acks back there

    conn = connection_field()

    async def start(self) -> "AsyncConsumer":
        try:
            async with self._join_lock:
                await self._join()
        except BaseException:
            await self.conn.close()
            raise
        self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeat())
        return self

    async def _join(self) -> None:
        previous_member = self.member_id
        try:
            reply = await self.conn.coordinator(self.core.join_request(self.session_timeout_ms))
        except UnknownMember:
            reply = await self.conn.coordinator(self.core.join_as_new(self.session_timeout_ms))
        # The core's rule, the sync Consumer's too: records leased (fetched, `core.held`, or not)
        # survive the join only where their lease still stands (same member, partition kept);
        # the others' leases went to another member. A Poll of the old generation already
        # answered is kept.
        was_lost = self.core.member_lost
        revoked, assigned, _given_up = self.core.joined(reply, previous_member)
        self._prune_ahead_fetches()  # the read-ahead of partitions not kept
        self._to_fetch = self.core.standing_deliveries(self._to_fetch, previous_member, was_lost)
        in_flight = self._poll_in_flight
        if in_flight is not None and in_flight.generation != self.generation:
            if not in_flight.reply.done():
                self._abandon_poll_in_flight()  # it will be answered FENCED, leasing nothing
            elif in_flight.reply.result().error is None:
                # Answered before the rebalance (sent ahead, or by a cancelled poll()): of its
                # deliveries, only those whose leases still stand are handed out (the core's rule).
                answered = in_flight.reply.result().msg
                answered.deliveries = self.core.standing_deliveries(answered.deliveries, previous_member, was_lost)
        await self._connect_to_assigned()
        for callback, partitions in ((self.on_revoke, revoked), (self.on_assign, assigned)):
            if callback is not None and partitions:
                outcome = callback(partitions)
                if asyncio.iscoroutine(outcome):
                    await outcome

    async def _connect_to_assigned(self) -> None:
        """As the synchronous Consumer does: connect to the assigned partitions' actors
        now, so the first fetch waits for neither a metadata request nor a handshake."""
        topics = sorted({topic for topic, _partition in self.assignment})
        if not topics:
            return
        try:
            await self.conn.refresh(topics)
            for endpoint in self.conn.metadata.endpoints(self.assignment):
                self.conn.socket(endpoint)  # connects in the background
        except (ZBrokerError, zmq.ZMQError):
            pass  # the fetch finds the owner again when it needs it

    async def _join_settled(self) -> None:
        """Wait for a join in progress: a request sent meanwhile would carry the old generation."""
        if self._join_lock.locked():
            async with self._join_lock:
                pass

    async def _rejoin_unless_done(self, err: ZBrokerError, member_id: str, generation: int) -> None:
        """Re-join after ``err`` (FENCED or UNKNOWN_MEMBER) refused a request sent as
        ``member_id`` in ``generation``, unless another task re-joined since it was sent."""
        async with self._join_lock:
            if self.core.rejoin_after(err, member_id, generation):
                await self._join()

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.session_timeout_ms / 3000.0)
            await self.beat()

    async def beat(self) -> None:
        """One heartbeat (the heartbeat task sends one every ``session_timeout_ms / 3``); refused,
        it re-joins, unless another task did since it was sent."""
        await self._join_settled()
        member_id, generation = self.member_id, self.generation
        try:
            await self.conn.coordinator(self.core.member_request(m.Heartbeat))
        except (Fenced, UnknownMember) as err:
            try:
                await self._rejoin_unless_done(err, member_id, generation)
            except ZBrokerError:
                pass  # the coordinator is away: the next beat (or poll) joins again
        except ZBrokerError:
            pass

    async def _group_call(self, make: Any, timeout: float | None = None) -> codec.Envelope:
        """A group request, sent again after a re-join or a move as `GroupCallRetry` decides."""
        retry = GroupCallRetry(self.conn.coordinators)
        while True:
            await self._join_settled()
            member_id, generation = self.member_id, self.generation  # what make() puts in the request
            try:
                return await self.conn.call(self.conn.url, make(), timeout=timeout)
            except ZBrokerError as err:
                decision = retry.after(err)
                if decision == REJOIN:
                    await self._rejoin_unless_done(err, member_id, generation)
                elif decision == FOLLOW:
                    log.info("coordinator.redirected", group=self.group, code=err.code.value, to=self.conn.url)
                    await asyncio.sleep(self.conn.coordinators.backoff())
                    async with self._join_lock:  # the new coordinator learns of this member by its join
                        await self._join()
                else:
                    raise

    async def poll(self, max_records: int = 1000, timeout: float = 1.0) -> list[ConsumedRecord]:
        """Lease up to ``max_records`` and return their records (possibly none).

        The held acks ride on the Poll (`Poll.acks`): applied before it leases, no
        round trip of their own. A poll() cancelled while its Poll waits at the
        coordinator leaves that Poll in flight (see `consumer_core.PollSent`): the next poll()
        takes its reply first, waiting for it at most its own ``timeout``.

        Tasks sharing one consumer may all call poll(): the calls take turns, and
        each record is handed to one of them. The wait for a turn counts against
        ``timeout``: a call whose time is up before its turn comes returns [].
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if not await self._wait_for_turn(timeout):
            return []
        try:
            if not self.core.held and not self._to_fetch and self.core.ahead_leases:
                await self._records_ahead(max_records, deadline)
            if not self.core.held and not self._to_fetch:
                reply = await self._poll_reply(max_records, max(0.0, deadline - loop.time()))
                if reply is None:
                    return []
                self._to_fetch = [list(delivery) for delivery in self.core.take_ahead_leases(reply.deliveries)]
            if self._to_fetch:
                await self._fetch()
            if not self.core.held and self.core.ahead_leases:
                await self._records_ahead(max_records, deadline)
            records = self.core.hand_out(max_records)
            if self.core.poll_ahead_now(self._poll_in_flight is not None):
                with contextlib.suppress(ZBrokerError):  # not sent: the next poll() asks the usual way
                    await self._send_poll(max_records, timeout)
            if self.core.reading_ahead:
                await self._send_read_ahead(timeout)
            return records
        finally:
            self._poll_lock.release()

    async def _wait_for_turn(self, timeout: float) -> bool:
        """Take `_poll_lock` within `timeout`; False if the time ran out first.

        Not asyncio.wait_for: from 3.12 on it can raise TimeoutError after the
        lock was taken, which would leave it held for ever. An acquire cancelled
        before it ran never takes the lock; one that did is released here if this
        call is leaving (cancelled) rather than taking its turn.
        """
        acquire = asyncio.ensure_future(self._poll_lock.acquire())
        taken = False
        try:
            await asyncio.wait([acquire], timeout=max(0.0, timeout))
            taken = acquire.done()
        finally:
            if not acquire.done():
                acquire.cancel()
            elif not taken:
                self._poll_lock.release()
        return taken

    async def _poll_reply(self, max_records: int, timeout: float) -> m.PollReply | None:
        """The reply of the Poll in flight, or of a new one; None if the one in flight
        is still waiting at the coordinator when ``timeout`` is up."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for attempt in range(3):
            fresh = self._poll_in_flight is None
            if fresh:
                await self._send_poll(max_records, max(0.0, deadline - loop.time()))
            sent = self._poll_in_flight
            until = sent.give_up_at if fresh else min(deadline, sent.give_up_at)
            # asyncio.wait, unlike wait_for, leaves the reply's future alone when this call is cancelled.
            await asyncio.wait([sent.reply], timeout=max(0.0, until - loop.time()))
            if self._poll_in_flight is not sent:
                return None  # another poll() call took the reply
            if not sent.reply.done():
                if loop.time() < sent.give_up_at:
                    return None  # still waiting at the coordinator: the next poll() takes it
                self._abandon_poll_in_flight()
                if fresh:
                    raise RequestTimeout("no reply to the poll in time")
                continue  # an old one given up: a new poll, with what is left of this call's timeout
            self._poll_in_flight = None
            env = sent.reply.result()
            reply = self.core.poll_replied(sent, env, loop.time())
            if reply is not None:
                return reply
            if attempt == 2:
                raise env.error
            await self._rejoin_unless_done(env.error, sent.member_id, sent.generation)
        raise AssertionError("unreachable")

    async def _send_poll(self, max_records: int, timeout: float) -> None:
        acks = await self._acks_for_poll()
        try:
            await self._join_settled()
            poll = self.core.poll_request(max_records, max_wait_ms(timeout), acks)
            reply = await self.conn.send(self.conn.url, poll)
        except BaseException:
            self._hold_again(acks)  # not known to be sent: they go again (a repeated ack is harmless)
            raise
        self._poll_in_flight = self.core.poll_sent(reply, poll, asyncio.get_running_loop().time(),
                                                   self.conn.request_timeout)

    async def _acks_for_poll(self) -> list:
        """The held acks for the Poll to carry (`ConsumerCore.acks_for_poll`); the rest go first, on their own."""
        riding, rest = self.core.acks_for_poll()
        if rest:
            self._hold_again(rest)
            try:
                await self._send_held_acks()
            except BaseException:
                self._hold_again(riding)
                raise
        return riding

    def _abandon_poll_in_flight(self) -> None:
        """Stop waiting for the Poll in flight; the acks riding on it are held again."""
        sent, self._poll_in_flight = self._poll_in_flight, None
        if sent is not None:
            self.conn.abandon(sent.reply)
            self._hold_again(sent.acks)

    async def _fetch(self) -> None:
        """Fetch the records of `_to_fetch` into `core.held`, as `fetch_round.FetchRound` plans
        and folds them (the sync Consumer's way: read-ahead first, a `fetch_many` per actor,
        the rest of a lease max_bytes cut short). Cancelled, what was filed is handed out and
        the rest fetched by the next poll(); a delivery a re-join dropped meanwhile (no longer
        in `_to_fetch`) is handed out by neither."""
        loop = asyncio.get_running_loop()
        fetches = FetchRound(self.core, list(self._to_fetch))
        replies: dict[int, asyncio.Future] = {}
        try:
            ahead_deadline = loop.time() + READ_AHEAD_WAIT_S
            for i, d in enumerate(fetches.deliveries):
                if self.core.reading_ahead:
                    await self._serve_from_read_ahead(fetches, i, ahead_deadline)
                if fetches.lacking[i] is not None:
                    await self._route(fetches, (i, d, fetches.lacking[i]))
            await self._send_fetches(fetches, replies)
            while (corr := fetches.next_awaited()) is not None:
                env, err = None, None
                try:
                    env = await self.conn.wait(replies.pop(corr))
                except ZBrokerError as failed:
                    err = failed
                for item in fetches.replied(corr, env, err, loop.time()):
                    await self._route(fetches, item, alone=True)
                await self._send_fetches(fetches, replies)
        finally:
            for fut in replies.values():
                self.conn.abandon(fut)
            standing = {id(d) for d in self._to_fetch}
            self.core.held.extend(part for d, part in zip(fetches.deliveries, fetches.parts)
                                  if part and id(d) in standing)
            self._to_fetch = [d for d in fetches.unfinished() if id(d) in standing]

    async def _route(self, fetches: FetchRound, item: tuple, alone: bool = False) -> None:
        try:
            fetches.route(item, await self.conn.endpoint(item[1][0], item[1][1]), alone=alone)
        except ZBrokerError as err:
            fetches.unroutable(item, err, asyncio.get_running_loop().time())

    async def _send_fetches(self, fetches: FetchRound, replies: dict[int, asyncio.Future]) -> None:
        for request in fetches.requests():
            try:
                fut = await self.conn.send(request[0], request[1])
            except ZBrokerError as err:
                fetches.send_failed(request, err, asyncio.get_running_loop().time())
                continue
            fetches.sent(fut.corr_id, request)
            replies[fut.corr_id] = fut
        if fetches.take_given_up():
            self._prune_ahead_fetches()  # read-ahead fetches the core gave up on

    # -- read-ahead and lease-ahead: the core decides, this sends and waits ----------------------

    async def _serve_from_read_ahead(self, fetches: FetchRound, i: int, deadline: float) -> None:
        """Hand what the read-ahead holds of delivery ``i`` to its part of ``fetches``, waiting
        until ``deadline`` (one for the poll) for the fetch out that may bring it (the lease
        proves the records exist: a live actor answers at once)."""
        loop = asyncio.get_running_loop()
        delivery = fetches.deliveries[i]
        key = (delivery[0], delivery[1])
        while True:
            pos, awaited, _given_up = self.core.serve_lease_from_read_ahead(delivery, fetches.lacking[i],
                                                                            fetches.parts[i], loop.time())
            fetches.served(i, pos)
            if awaited is None:
                break
            fut = next((f for f in self._ahead_fetches.get(key, ()) if f.corr_id == awaited), None)
            if fut is not None:
                await asyncio.wait([fut], timeout=max(0.005, deadline - loop.time()))
            if fut is not None and fut.done() and not fut.cancelled() and fut.exception() is None:
                self.core.read_ahead_replied(key, awaited, fut.result(), loop.time())
            else:  # its actor died with the fetch parked, or hangs: fetch the rest the usual way
                self.core.give_up_read_ahead(key, loop.time())
                self._prune_ahead_fetches()
        self.core.lease_served(delivery)

    def _collect_read_ahead(self) -> None:
        arrived = {f.corr_id: f.result() for futures in self._ahead_fetches.values() for f in futures
                   if f.done() and not f.cancelled() and f.exception() is None}
        self.core.collect_read_ahead(arrived, asyncio.get_running_loop().time())
        self._prune_ahead_fetches()

    def _prune_ahead_fetches(self) -> None:
        """Forget the futures of replies the core no longer awaits (filed, or their fetch given up:
        their replies are dropped when they come)."""
        in_flight = dict(self.core.ahead.in_flight())
        for key, futures in list(self._ahead_fetches.items()):
            corr = in_flight.get(key)
            if corr is None or all(f.corr_id != corr for f in futures):
                for fut in futures:
                    self.conn.abandon(fut)
                del self._ahead_fetches[key]
            else:
                self._ahead_fetches[key] = [f for f in futures if f.corr_id >= corr]

    async def _send_read_ahead(self, timeout: float, collected: bool = False) -> None:
        """Send the read-ahead fetches the core wants (``collected``: the replies were just filed)."""
        if not collected:
            self._collect_read_ahead()
        loop = asyncio.get_running_loop()
        for key, fetch in self.core.read_ahead_fetches(max_wait_ms(timeout), loop.time()):
            fut = None
            with contextlib.suppress(ZBrokerError):  # not reachable now: the next lease is fetched the usual way
                fut = await self.conn.send(await self.conn.endpoint(*key), fetch)
            self.core.read_ahead_sent(key, None if fut is None else fut.corr_id, fetch, loop.time(),
                                      self.conn.request_timeout)
            if fut is not None:
                self._ahead_fetches[key] = [fut, *fut.later]

    async def _records_ahead(self, max_records: int, deadline: float) -> None:
        """Put what the parked fetches brought under the ahead leases in `core.held`, waiting until
        ``deadline`` for some; returns early when the Poll in flight is answered (the caller takes it)."""
        loop = asyncio.get_running_loop()
        while True:
            self._collect_read_ahead()
            parts, _given_up = self.core.ahead_records(max_records, loop.time())  # dropped: `_prune_ahead_fetches`
            if parts:
                self.core.held.extend(parts)
                return
            if not self.core.ahead_leases or (self._poll_in_flight is not None and self._poll_in_flight.reply.done()):
                return  # all used up, or the coordinator answered
            if self._poll_in_flight is None:
                # Redeliveries, and the next ahead lease once this one is used up, come from a poll.
                with contextlib.suppress(ZBrokerError):  # not sent: the caller's poll asks the usual way
                    await self._send_poll(max_records, max(0.0, deadline - loop.time()))
            await self._send_read_ahead(max(0.0, deadline - loop.time()), collected=True)
            remaining = deadline - loop.time()
            waits = [f for futures in self._ahead_fetches.values() for f in futures]
            if self._poll_in_flight is not None:
                waits.append(self._poll_in_flight.reply)
            if remaining <= 0 or not waits:
                return
            await asyncio.wait(waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)

    async def ack(self, record: ConsumedRecord) -> None:
        self.acks.add(record.topic, record.partition, record.lease_id, record.offset)
        if self.acks.count >= self.ack_batch:
            await self._send_held_acks()
        elif self._ack_timer is None:
            self._ack_timer = asyncio.get_running_loop().create_task(self._send_acks_when_due())
            self._ack_timers.add(self._ack_timer)
            self._ack_timer.add_done_callback(self._ack_timers.discard)

    async def ack_many(self, records: Iterable[ConsumedRecord]) -> None:
        for record in records:
            await self.ack(record)

    async def _send_acks_when_due(self) -> None:
        try:
            await asyncio.sleep(self.ack_interval_s)
        finally:
            self._ack_timer = None  # acks from now on wait for an interval of their own
        try:
            await self._send_held_acks()
        except ZBrokerError as err:  # retriable ones are held again: they go with the next poll or interval
            log.warning("ack.deferred", group=self.group, code=err.code.value, reason=err.message)

    async def _stop_ack_timers(self) -> None:
        """Cancelled mid-send, a timer holds its acks again (see flush_acks): nothing is lost."""
        timers = list(self._ack_timers)
        for timer in timers:
            timer.cancel()
        await asyncio.gather(*timers, return_exceptions=True)

    async def flush_acks(self) -> None:
        """Send the held acks and wait for those already on their way; on return every ack
        made before the call was applied (or its lease was gone), as with the sync Consumer.

        An interval timer's request takes its acks out of `acks` while it waits for the
        reply: until it is answered they are neither applied nor held, and if it fails
        they are held again and sent here."""
        others = list(self._ack_sends)
        riding = self._poll_in_flight is not None and bool(self._poll_in_flight.acks)
        if riding and not self.acks:
            # Acks riding on a poll still parked at the coordinator were applied when it
            # arrived: an Ack sent after it on the same socket, answered, proves it.
            await self._group_call(lambda: self.core.member_request(m.Ack, ranges=[]))
        await self._send_held_acks()
        if not others:
            return
        outcomes = await asyncio.gather(*(asyncio.shield(sending) for sending in others))
        await self._send_held_acks()  # what a failed one held again
        refused = next((err for err in outcomes if err is not None and not err.retriable), None)
        if refused is not None:
            raise refused

    async def _send_held_acks(self) -> None:
        """Send the held acks, in requests of at most RANGES_PER_REQUEST ranges: a larger
        header is answered TOO_LARGE with no id, so the call would only time out."""
        if not self.acks:
            return
        ended = asyncio.get_running_loop().create_future()
        self._ack_sends.add(ended)
        outcome: ZBrokerError | None = None
        chunks = in_request_sized_chunks(self.acks.take())
        try:
            for i, chunk in enumerate(chunks):
                try:
                    await self._group_call(lambda chunk=chunk: self.core.member_request(m.Ack, ranges=chunk))
                except ZBrokerError as err:
                    # The core's rule, the sync Consumer's too: stale ones are noted, retriable ones
                    # held again (a re-join was `_group_call`'s already). Then the unsent go again.
                    if self.core.ack_refused(err, chunk, asyncio.get_running_loop().time()) == ACK_STALE:
                        continue
                    self._hold_again(itertools.chain.from_iterable(chunks[i + 1:]))
                    outcome = err
                    raise
                except BaseException:  # cancelled mid-call: sent or not, sending again is harmless
                    self._hold_again(itertools.chain.from_iterable(chunks[i:]))
                    raise
        finally:
            self._ack_sends.discard(ended)
            ended.set_result(outcome)

    def _hold_again(self, ranges: Iterable[list]) -> None:
        self.core.hold_again(ranges)

    async def _lease_call(self, op: type, records: Iterable[ConsumedRecord], **fields: Any) -> int:
        """Records applied, over as many requests as the ranges need."""
        await self.flush_acks()
        settled = ChunkedSettle()
        for chunk in in_request_sized_chunks(group_by_lease(records)):
            try:
                env = await self._group_call(lambda chunk=chunk: self.core.member_request(op, ranges=chunk,
                                                                                            **fields))
            except StaleLease as err:  # its valid ranges were applied: the next chunks go all the same
                settled.refused(err)
            else:
                settled.replied(env.msg)
        return settled.outcome()

    async def nack(self, records: Iterable[ConsumedRecord], *, delay_ms: int = 0, reason: str = "") -> int:
        return await self._lease_call(m.Nack, records, delay_ms=delay_ms, reason=reason)

    async def extend(self, records: Iterable[ConsumedRecord], *, extend_ms: int = 0) -> int:
        return await self._lease_call(m.Extend, records, extend_ms=extend_ms)

    async def reject(self, records: Iterable[ConsumedRecord], *, reason: str = "") -> int:
        return await self._lease_call(m.Reject, records, reason=reason)

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
        application must know they were not applied), then leave the group."""
        if self.conn.closed:
            return
        try:
            await self._stop_ack_timers()
            for key in list(self._ahead_fetches):
                self.core.give_up_read_ahead(key, asyncio.get_running_loop().time())
            self._prune_ahead_fetches()
            self._abandon_poll_in_flight()  # applied or not, its acks go again now (a repeat is harmless)
            await self.flush_acks()
            try:
                await self.conn.call(self.conn.url, self.core.member_request(m.Leave), timeout=2.0)
            except ZBrokerError:
                pass  # not leaving costs only a session timeout before a rebalance
        finally:
            if self._heartbeat_task is not None:
                self._heartbeat_task.cancel()
                await asyncio.gather(self._heartbeat_task, return_exceptions=True)
            await self.conn.close()

    async def __aenter__(self) -> "AsyncConsumer":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
