"""The synchronous Python client: `Admin`, `Producer` and `Consumer`.

A driver: what each call does is written once, for both drivers, in
`consumer_flow` and `producer_flow` (the decisions under them in
`consumer_core`, `producer_core` and `fetch_round`); this module performs
their steps by blocking, on a `connections.Connection`, and reads the clock.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable, Iterable, Iterator

import structlog
import zmq

from zbroker.client import consumer_core
from zbroker.client.admin_calls import sync_method, with_admin_calls
from zbroker.client.connections import Connection
from zbroker.client.consumer_core import AHEAD_RETRY_S, ConsumerCore, core_field, failure_reason, membership_lost
from zbroker.client.consumer_flow import ConsumerDriver, ConsumerFlow
from zbroker.client.core import (ConsumedRecord, DeliveryHandle, PendingBatch, checked_partition, checked_record,
                                 checked_timestamp, checked_topics, record_size_estimate)
from zbroker.client.keys import ClientKeys
from zbroker.client.producer_core import RETRIABLE_PRODUCE, ProduceError, ProducerCore, failure_fields
from zbroker.client.producer_flow import ProducerFlow, not_sent
from zbroker.client.sockets import client_dealer, curve_from_env, poll_timeout_ms
from zbroker.client.steps import Connect, Coordinator, Endpoint, Notify, Send, Sleep, Wait, WaitAny, run_blocking
from zbroker.client.transport import DEFAULT_URL, MAX_ORPHAN_RANGES, MAX_ORPHANS
from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.batch import decode_fetched
from zbroker.protocol.errors import ErrorCode, RequestTimeout, ZBrokerError

__all__ = ["Admin", "Connection", "Consumer", "DEFAULT_URL", "MAX_ORPHANS", "MAX_ORPHAN_RANGES", "ProduceError",
           "Producer", "RETRIABLE_PRODUCE", "AHEAD_RETRY_S", "client_dealer", "curve_from_env", "fetch", "poll_timeout_ms"]

log = structlog.get_logger("zbroker.client")
_time_ns, _monotonic = time.time_ns, time.monotonic  # module globals: read once per record sent


@with_admin_calls(sync_method)
class Admin:
    """Topics, groups and status: the calls of `admin_calls`, each a method here."""

    def __init__(self, url: str = DEFAULT_URL, *, request_timeout: float = 5.0,
                 curve: ClientKeys | None = None) -> None:
        self.conn = Connection(url, request_timeout=request_timeout, curve=curve)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "Admin":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()



class Producer:
    """Batching, pipelined, idempotent producer.

    ``send`` buffers a record; a batch goes out when it holds ``batch_size``
    records or ``batch_bytes``, when its first record has waited ``linger_ms``
    (checked on every ``send`` and ``poll``), or on ``flush``. At most
    ``max_in_flight_records`` are unacknowledged at once. Retries keep the
    batch's (producer_id, sequence), so the partition actor stores it once.
    The window and retry decisions are `producer_core.ProducerCore`'s.
    """

    def __init__(self, url: str = DEFAULT_URL, *, linger_ms: float = 5.0, batch_size: int = 1000,
                 batch_bytes: int = 1 << 20, max_in_flight_records: int = 10_000,
                 max_in_flight_bytes: int = 32 << 20, request_timeout: float = 5.0,
                 retries: int = 20, producer_id: int | None = None, curve: ClientKeys | None = None) -> None:
        self.conn = Connection(url, request_timeout=request_timeout, curve=curve)
        self.core = ProducerCore(batch_size=batch_size, batch_bytes=batch_bytes,
                                 max_in_flight_records=max_in_flight_records,
                                 max_in_flight_bytes=max_in_flight_bytes, retries=retries,
                                 request_timeout=request_timeout, producer_id=producer_id)
        self.linger_s = linger_ms / 1000.0
        self.acc = self.core.acc
        self.stats = self.core.stats
        self._oldest_open: float | None = None  # first-record time of the longest-waiting open batch
        self._last_index = batch_size - 1  # a record at this index fills its batch
        self._batch_bytes = batch_bytes
        self._keyless_open = self.acc.keyless_open  # the accumulator's own dict, updated in place
        self._dispatches = 0
        self._topic_partitions = self.conn.metadata.topics  # the cache's own dict, updated in place
        self.flow = ProducerFlow(self.core, self.conn.metadata, time.monotonic)
        self._steps = {Endpoint: lambda step: self.conn.endpoint(step.topic, step.partition),
                       Send: lambda step: self.conn.send(step.endpoint, step.msg, step.frames),
                       Coordinator: lambda step: self.conn.coordinator(step.msg, step.timeout)}
        # Asked while a batch waits for room in a full window: True sends it at once instead
        # (the CLI's Ctrl-C, which must not wait for a hung partition's retries to run out).
        self.stop_waiting: Callable[[], bool] = lambda: False

    producer_id = property(lambda self: self.acc.producer_id)
    in_flight = core_field("in_flight")
    retrying = core_field("retrying")
    in_flight_records = core_field("in_flight_records")
    in_flight_bytes = core_field("in_flight_bytes")
    max_in_flight_records = core_field("max_in_flight_records")
    max_in_flight_bytes = core_field("max_in_flight_bytes")
    errors = core_field("errors")
    results = core_field("results")
    keep_results = core_field("keep_results")

    def send(self, topic: str, value: bytes, key: bytes | None = None, headers: dict | None = None,
             partition: int | None = None, timestamp_ms: int | None = None) -> DeliveryHandle:
        # This runs once per record. The usual record (bytes, no key, headers,
        # partition or timestamp) goes to the open batch of the topic's sticky
        # partition with one lookup and one append; everything else takes
        # `_send_record` (bench/PROFILE.md, ninth and tenth passes).
        if (key is None and headers is None and partition is None and timestamp_ms is None
                and value.__class__ is bytes):
            batch = self._keyless_open.get(topic)
            # A record that would take the batch past batch_bytes starts the next one (`acc.add`).
            if batch is not None and (size := batch.size + len(value) + 16) <= self._batch_bytes:
                values = batch.values
                index = len(values)
                values.append(value)
                stamp = _time_ns() // 1_000_000
                if stamp != batch.last_stamp:
                    batch.stamp(stamp)
                batch.size = size
                handle = DeliveryHandle(batch.outcome, index)
                if index >= self._last_index or size >= self._batch_bytes:
                    self._dispatch(self.acc.close((topic, batch.outcome.partition)))
                    self._oldest_open = self.acc.oldest_opened_at()
                elif _monotonic() >= self._oldest_open + self.linger_s:  # open batch: _oldest_open is set
                    self._dispatch_lingered(_monotonic())
                return handle
        return self._send_record(topic, value, key, headers, partition, timestamp_ms)

    def _send_record(self, topic: str, value: bytes, key: bytes | None, headers: dict | None,
                     partition: int | None, timestamp_ms: int | None) -> DeliveryHandle:
        value, key, headers = checked_record(value, key, headers)
        if timestamp_ms is not None:
            checked_timestamp(timestamp_ms)
        if partition is not None:
            checked_partition(partition)
        else:
            partitions = self._topic_partitions.get(topic)
            if partitions is None:
                self.conn.refresh([topic])
                partitions = self.conn.metadata.topics[topic]
            partition = self.acc.choose_partition(topic, len(partitions), key)
        ts = _time_ns() // 1_000_000 if timestamp_ms is None else timestamp_ms
        now = _monotonic()
        handle, batch = self.acc.add(topic, partition, [ts, key, value, headers],
                                     record_size_estimate(value, key, headers), now)
        if batch is not None:
            self._dispatch(batch)
            self._oldest_open = self.acc.oldest_opened_at()
        elif self.linger_s == 0:
            for b in self.acc.drain():
                self._dispatch(b)
            self._oldest_open = None
        elif self._oldest_open is None:
            self._oldest_open = now
        elif now >= self._oldest_open + self.linger_s:  # the form of linger_deadline() and acc.due()
            self._dispatch_lingered(now)
        return handle

    def linger_deadline(self) -> float | None:
        """When (``time.monotonic()``) the longest-waiting buffered batch is due to go out; None if none is."""
        return None if self._oldest_open is None else self._oldest_open + self.linger_s

    def poll(self, timeout: float = 0.0) -> None:
        """Send the batches whose linger has run out and take in the replies that have arrived.

        A synchronous producer has no background thread: ``send`` checks the
        linger only when it is called. An application that sends in bursts
        with pauses longer than ``linger_ms`` calls ``poll`` at
        ``linger_deadline()`` (or from its idle loop) so that the last records
        of a burst do not wait for the next one.

        When requests are in flight it waits for a reply, up to ``timeout``
        seconds but at most 50 ms, and resends what is due for a retry.
        Sending a batch can itself wait, even with ``timeout=0``, while
        ``max_in_flight_records`` or ``max_in_flight_bytes`` are reached, as
        ``send`` does. A batch that fails for good is reported on its records'
        handles and by the next ``flush``.
        """
        now = time.monotonic()
        if self._oldest_open is not None and now >= self._oldest_open + self.linger_s:
            self._dispatch_lingered(now)
        if self.core.busy():
            self._pump(timeout)

    def _dispatch_lingered(self, now: float) -> None:
        self._dispatch_all(self.acc.due(now, self.linger_s))
        self._oldest_open = self.acc.oldest_opened_at()

    def _dispatch_all(self, batches: list[PendingBatch]) -> None:
        """Admit `batches` to the window and send them, one request per partition actor
        for those admitted together (`ProducerCore.group_by_actor`)."""
        core, admitted = self.core, []
        for batch in batches:
            if admitted and not core.has_room(batch):
                self._send_all(admitted)  # what fits goes now; the replies make room for the rest
                admitted = []
            while not core.has_room(batch) and not self.stop_waiting():
                self._pump(self.conn.request_timeout)
            core.admit(batch)
            admitted.append(batch)
        self._send_all(admitted)

    def _send_all(self, batches: list[PendingBatch]) -> None:
        run_blocking(self.flow.send(batches), self._steps)

    def send_many(self, topic: str, values: list[bytes], partition: int | None = None) -> None:
        """Fast path for key-less, header-less values: whole batches at once."""
        if partition is not None:
            checked_partition(partition)
        if topic not in self.conn.metadata.topics:
            self.conn.refresh([topic])
        if partition is None:
            partition = self.acc.choose_partition(topic, self.conn.metadata.partitions(topic), None)
            self.acc._rotate(topic, partition)
        for batch in self.acc.add_many_values(topic, partition, values, time.time_ns() // 1_000_000):
            self._dispatch(batch)
        self._oldest_open = self.acc.oldest_opened_at()  # a batch send() held open may have gone first

    def produce(self, topic: str, records: Iterable, partition: int | None = None) -> list[DeliveryHandle]:
        """Send and wait: returns a handle per record with its assigned offset."""
        handles = []
        for rec in records:
            if isinstance(rec, (bytes, bytearray, memoryview)):
                handles.append(self.send(topic, bytes(rec), partition=partition))
            else:
                key, value, *rest = rec
                handles.append(self.send(topic, value, key=key, headers=rest[0] if rest else None,
                                         partition=partition))
        self.flush()
        return handles

    def _dispatch(self, batch: PendingBatch) -> None:
        # The window is bounded in records and in bytes: large records would otherwise
        # put max_in_flight_records x their size in memory here and in the actor.
        core = self.core
        self._dispatches += 1
        if core.in_flight and self._dispatches & 15 == 0:
            # Take in the replies that are here now and then, so the window moves between
            # batches (a synchronous producer has no thread that would). Not on every
            # batch: with linger_ms=0 each record is one, and a receive that finds
            # nothing costs a few microseconds (bench/PROFILE.md, tenth pass).
            for env in self.conn.recv_nowait_all():
                self._on_reply(env)
        while not core.has_room(batch) and not self.stop_waiting():
            self._pump(self.conn.request_timeout)
        core.admit(batch)
        self._send(batch)

    def _send(self, batch: PendingBatch) -> None:
        """Send a batch admitted to the window, alone: `ProducerFlow.send` for one batch, without
        its grouping and steps (with linger_ms=0 this runs once per record)."""
        msg = self.core.produce_request(batch)
        if msg is None:
            return  # failed for good, now
        try:
            corr = self.conn.send(self.conn.endpoint(batch.topic, batch.partition), msg, (batch.payload,))
        except ZBrokerError as err:
            self.core.failed(batch, err, time.monotonic())
            return
        except BaseException:  # Ctrl-C mid-send: retried by the next pump, as `ProducerFlow.send` does
            self.core.failed(batch, not_sent(), time.monotonic())
            raise
        self.core.sent(corr, batch, time.monotonic())

    def _pump(self, timeout_s: float) -> None:
        stashed = self.conn.take_stashed()  # produce replies that came during a metadata refresh
        for env in stashed:
            self._on_reply(env)
        env = self.conn.recv(0.0 if stashed else self.core.pump_wait(timeout_s, time.monotonic()))
        if env is not None:
            self._on_reply(env)
        for env in self.conn.recv_nowait_all():
            self._on_reply(env)
        self.core.timed_out(time.monotonic())  # retried, or failed for good
        if self.core.retrying:
            run_blocking(self.flow.resend_due(), self._steps)
        self._log_failed()

    def _log_failed(self) -> None:
        for batch, err in self.core.take_failed():
            log.error("produce.failed", **failure_fields(batch, err))

    def _on_reply(self, env: codec.Envelope) -> None:
        self.core.settle(env.corr_id, env.error, env.msg, time.monotonic())

    def flush(self, timeout: float | None = None) -> None:
        """Send everything buffered and wait until all of it is acknowledged."""
        self._dispatch_all(self.acc.drain())
        self._oldest_open = None
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.core.busy():
            if deadline is not None and time.monotonic() > deadline:
                raise RequestTimeout("flush timed out",
                                     in_flight_batches=len(self.core.in_flight) + len(self.core.retrying))
            self._pump(0.05)
        self._log_failed()
        failure = self.core.take_failure()
        if failure is not None:
            raise failure

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.conn.close()

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.conn.close()


def fetch(conn: Connection, topic: str, partition: int, offset: int, *, max_bytes: int = 1 << 20,
          max_wait_ms: int = 0, max_records: int | None = None, retries: int = 20) -> tuple[list, int, int]:
    """One fetch. Returns (records at or after ``offset``, log_start, log_end).

    A partition that moved (NOT_OWNER) or whose actor is restarting is retried
    after a metadata refresh, with a short backoff, for at most ``retries``
    attempts and twice the request timeout (a broker that is down is reported
    in seconds, not after every retry has timed out).
    """
    give_up_at = time.monotonic() + 2 * conn.request_timeout + max_wait_ms / 1000.0
    for attempt in range(retries + 1):
        try:
            env = conn.call(conn.endpoint(topic, partition),
                            m.Fetch(topic=topic, partition=partition, offset=offset, max_bytes=max_bytes,
                                    max_wait_ms=max_wait_ms),
                            timeout=conn.request_timeout + max_wait_ms / 1000.0)
            break
        except ZBrokerError as err:
            if not err.retriable or attempt == retries or time.monotonic() >= give_up_at:
                raise
            time.sleep(min(0.05 * (attempt + 1), 1.0))
            conn.metadata.forget(topic)
    until = None if max_records is None else offset + max_records
    records = decode_fetched(env.frames[0] if env.frames else b"", topic, partition, from_offset=offset,
                             until_offset=until)
    return records, env.msg.log_start, env.msg.log_end


class RetryBackoff(consumer_core.RetryBackoff):
    """`consumer_core.RetryBackoff`, waiting with ``time.sleep`` unless told otherwise."""

    def __init__(self, sleep: Callable[[float], None] = time.sleep) -> None:
        super().__init__(sleep)


class Consumer(ConsumerDriver):
    """A member of a consumer group: poll leases, fetch their records, ack each one.

    What each call does is `consumer_flow.ConsumerFlow`'s (the asyncio consumer runs the
    same flows): this class performs their steps by blocking. The options:

    Acks are folded into ranges and sent every ``ack_batch`` records or
    ``ack_interval_ms``, and ride on a poll that goes to the coordinator (with
    ``poll_ahead`` the next lease is already asked for, so acks then wait for
    their batch or interval, never longer). A background thread heartbeats every
    ``session_timeout_ms / 3`` on its own socket; a FENCED or UNKNOWN_MEMBER answer
    makes the next call re-join (same member id first), after which acks that
    were refused are sent again under the new generation. Rebalance callbacks
    get the partitions assigned and revoked.

    In an exclusive group the consumer reads ahead (``read_ahead=True``): it
    fetches the records its next lease will cover while it waits for the
    coordinator or while the caller handles the last batch (see `ReadAhead`).
    It leases nothing early; ``read_ahead_bytes`` bounds the memory it takes.

    ``poll_ahead=True`` goes further: when ``poll`` returns, the next poll is
    already sent, so the coordinator leases the next batch while the caller
    handles this one. Those leases' ack timers run from then, and records
    leased ahead but never handed out (the consumer closed or died) count a
    delivery attempt when they come back. Use it when a batch is handled well
    within the ack timeout.

    ``lease_ahead=True`` (exclusive groups with read-ahead; implies
    ``poll_ahead``) asks the coordinator, when there is nothing to lease, for
    an *ahead lease* on the partition's next offsets (docs/PROTOCOL.md, poll).
    The consumer then hands out records as its parked fetch brings them, with
    no poll round trip between a record's arrival and the caller: the lowest
    latency at a trickle. The ahead range counts against ``max_in_flight``.

    ``max_in_flight`` is not this member's own setting: it configures the
    *group* (`configure_group`) before joining, so it holds for every member,
    and stays, across restarts of the broker, until it is configured again.
    """

    def __init__(self, url: str = DEFAULT_URL, *, group: str, topics: list[str], member_id: str = "",
                 session_timeout_ms: int = 10_000, ack_batch: int = 1000, ack_interval_ms: float = 5.0,
                 request_timeout: float = 5.0, max_in_flight: int | None = None,
                 on_assign: Callable[[list], None] | None = None,
                 on_revoke: Callable[[list], None] | None = None, heartbeat: bool = True,
                 curve: ClientKeys | None = None, read_ahead: bool = True,
                 read_ahead_bytes: int = 32 << 20, poll_ahead: bool = False, lease_ahead: bool = False,
                 conn: Connection | None = None) -> None:
        topics = checked_topics(topics)  # before any socket exists: a TypeError leaves nothing open
        self.conn = conn if conn is not None else Connection(url, request_timeout=request_timeout, curve=curve)
        self.core = ConsumerCore(group=group, topics=topics, member_id=member_id, ack_batch=ack_batch,
                                 ack_interval_s=ack_interval_ms / 1000.0, read_ahead=read_ahead,
                                 read_ahead_bytes=read_ahead_bytes, lease_ahead=lease_ahead,
                                 poll_ahead=poll_ahead, metadata=self.conn.metadata)
        self.flow = ConsumerFlow(self.core, self.conn, time.monotonic, session_timeout_ms=session_timeout_ms,
                                 on_assign=on_assign, on_revoke=on_revoke)
        self._core_ack = self.core.ack  # bound once: ack() runs per record
        self._steps = self.step_methods()
        self._stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        try:
            if max_in_flight is not None:
                self.conn.coordinator(m.ConfigureGroup(group=group, max_in_flight=max_in_flight))
            self._run(self.flow.join())
        except BaseException:
            self.conn.close()  # a consumer that never joined owns no sockets afterwards
            raise
        if heartbeat:
            self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="zbroker-heartbeat",
                                                      daemon=True)
            self._heartbeat_thread.start()


    # -- the steps of a flow, performed by blocking ----------------------------------------------

    def _run(self, flow: Any) -> Any:
        return run_blocking(flow, self._steps)

    def _send(self, step: Send) -> int:
        return self.conn.send(self.conn.url if step.endpoint is None else step.endpoint, step.msg)

    def _wait(self, step: Wait) -> codec.Envelope:
        return self.conn.wait_for(step.corr, step.timeout)

    def _wait_any(self, step: WaitAny) -> None:
        env = self.conn.recv(step.timeout)
        if env is not None:
            self.conn.correlation.keep(env)

    def _endpoint(self, step: Endpoint) -> str:
        return self.conn.endpoint(step.topic, step.partition)

    def _coordinator(self, step: Coordinator) -> m.Message:
        return self.conn.coordinator(step.msg, step.timeout)

    def _sleep(self, step: Sleep) -> None:
        time.sleep(step.seconds)

    def _notify(self, step: Notify) -> None:
        step.callback(step.partitions)

    def _connect(self, step: Connect) -> None:
        try:
            self.conn.refresh(step.topics)
            for endpoint in self.conn.metadata.endpoints(step.assignment):
                self.conn.socket(endpoint)  # connects in the background
        except ZBrokerError as err:  # the fetch finds the owner again when it needs it
            log.info("consumer.connect_deferred", group=self.group, error=str(getattr(err.code, "value", err.code)))
        except zmq.ZMQError as err:  # e.g. a bad endpoint in the metadata: the fetch reports it
            log.info("consumer.connect_deferred", group=self.group, error=str(err))

    def _heartbeat_loop(self) -> None:
        """Beat on a socket of its own; refused (FENCED, UNKNOWN_MEMBER), the next call re-joins."""
        sock = self.conn.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.conn.curve is not None:
            self.conn.curve.apply(sock)
        connected_to = self.conn.url
        sock.connect(connected_to)
        interval = self.session_timeout_ms / 3000.0
        ids = itertools.count(1)
        try:
            while not self._stop.wait(interval):
                if self.conn.url != connected_to:  # the coordinator moved (NOT_COORDINATOR): beat there
                    sock.disconnect(connected_to)
                    connected_to = self.conn.url
                    sock.connect(connected_to)
                try:
                    sock.send_multipart(codec.encode_request(self.core.member_request(m.Heartbeat), next(ids)),
                                        zmq.NOBLOCK)
                except zmq.Again:
                    continue
                if sock.poll(poll_timeout_ms(interval)):
                    env = codec.decode_reply(sock.recv_multipart())
                    if env.error is not None and env.error.code in (ErrorCode.FENCED, ErrorCode.UNKNOWN_MEMBER):
                        if membership_lost(env.error)[0]:
                            self.core.member_lost = True
                        self.flow.needs_rejoin = True
        except zmq.ZMQError:
            pass  # the context is being closed
        finally:
            sock.close(linger=0)

    # -- the calls --------------------------------------------------------------------------------

    def poll(self, max_records: int = 1000, timeout: float = 1.0) -> list[ConsumedRecord]:
        """Lease up to ``max_records`` and return their records (possibly fewer, possibly none).

        The acks held when a poll goes to the coordinator ride on it (`Poll.acks`):
        one message instead of two, and the capacity they free counts for that poll.
        Acks that no poll takes along leave on their own once ``ack_batch`` or
        ``ack_interval_ms`` says so.
        """
        return self._run(self.flow.poll(max_records, timeout))

    def __iter__(self) -> Iterator[ConsumedRecord]:
        """Yields records forever; each is acked when the loop body returns for it."""
        while True:
            for record in self.poll():
                yield record
                self.ack(record)

    def run(self, handler: Callable[[ConsumedRecord], Any], *, max_records: int = 1000,
            stop: Callable[[], bool] = lambda: False) -> None:
        """Call ``handler`` per record: ack when it returns, nack (with the error) when it raises.

        Runs until ``stop()`` says so. It is asked before each poll, so the records a
        poll returned (up to ``max_records``) are all handled first. A retriable error
        (the coordinator restarting or reloading offsets, a request timeout) is logged
        and retried with a backoff of up to a few seconds, as the protocol says to; any
        other error is raised.
        """
        backoff = RetryBackoff()
        while not stop():
            try:
                records = self.poll(max_records)
            except ZBrokerError as err:
                backoff.wait_or_raise(err, "poll", group=self.group)
                continue
            backoff.reset()
            for record in records:
                try:
                    handler(record)
                except Exception as exc:  # the handler's failure is the record's nack reason
                    try:
                        self.nack([record], reason=failure_reason(exc))
                    except ZBrokerError as err:  # not settled: its lease expires and it comes back
                        backoff.log_or_raise(err, "nack", group=self.group)
                else:
                    try:
                        self.ack(record)
                    except ZBrokerError as err:  # the acks are held and go with the next request
                        backoff.log_or_raise(err, "ack", group=self.group)

    def ack(self, record: ConsumedRecord) -> None:
        # Once per record: the core's identity check and index step; the clock is read
        # only when the core says the held acks may be due (bench/PROFILE.md).
        if self._core_ack(record) and self.core.acks_due(time.monotonic()):
            self._run(self.flow.flush_acks(wait=False))

    def ack_many(self, records: Iterable[ConsumedRecord]) -> None:
        for record in records:
            self.ack(record)

    def flush_acks(self, wait: bool = True) -> None:
        """Send the held acks; with ``wait``, until every ack sent is applied."""
        self._run(self.flow.flush_acks(wait))

    def nack(self, records: Iterable[ConsumedRecord], *, delay_ms: int = 0, reason: str = "") -> int:
        return self._run(self.flow.lease_call(m.Nack, records, delay_ms=delay_ms, reason=reason))

    def extend(self, records: Iterable[ConsumedRecord], *, extend_ms: int = 0) -> int:
        return self._run(self.flow.lease_call(m.Extend, records, extend_ms=extend_ms))

    def reject(self, records: Iterable[ConsumedRecord], *, reason: str = "") -> int:
        return self._run(self.flow.lease_call(m.Reject, records, reason=reason))

    def close(self, leave: bool = True) -> None:
        """Send the held acks, leave the group (its leases go to the others at once) and
        close. Closing again does nothing: a `with` block and a shutdown hook may both."""
        if self._stop.is_set():
            return
        try:
            self._run(self.flow.close(leave))
        finally:
            self._stop.set()
            if self._heartbeat_thread is not None:
                self._heartbeat_thread.join(5)
            self.conn.close()

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
