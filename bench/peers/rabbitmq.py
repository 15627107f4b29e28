"""RabbitMQ through pika: quorum queue, persistent messages, windowed publisher confirms.

pika's BlockingConnection waits for each confirm in turn, which measures
round trips, not the broker. The producer here is a SelectConnection (pika's
callback API) that keeps up to `window` publishes unconfirmed and tops the
window up from the confirm callback, like a Kafka producer's
max.in.flight. RabbitMQ may confirm several tags at once (`multiple`), so
`ConfirmWindow` tracks outstanding tags as a set with a low-water mark.

Durability: a quorum queue appends to its Raft write-ahead log and fsyncs it
before confirming (RabbitMQ has no "fsync on an interval" mode for quorum
queues), so the `produce` and `produce_fsync_always` rows run the same
settings.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any, Callable

from bench.adapter import Adapter, Phase, ProduceSpec, Skipped
from bench.latency import LatencyRecorder, Pacer, PublisherProcess, stamp
from bench.procstat import pids_by_name

HOST, PORT = "127.0.0.1", 5672
PREFETCH = 1000


def _params():
    import pika

    return pika.ConnectionParameters(
        host=HOST,
        port=PORT,
        credentials=pika.PlainCredentials("guest", "guest"),
        connection_attempts=1,
        socket_timeout=5,
        blocked_connection_timeout=60,
    )


class ConfirmWindow:
    """Publisher-confirm bookkeeping: delivery tags start at 1 on a confirm-mode channel."""

    def __init__(self) -> None:
        self.next_tag = 1
        self._unconfirmed: set[int] = set()
        self._low = 1  # every tag below this is confirmed

    def published(self) -> None:
        self._unconfirmed.add(self.next_tag)
        self.next_tag += 1

    def confirm(self, tag: int, multiple: bool) -> int:
        """Record an ack/nack; return how many publishes it settles."""
        if not multiple:
            if tag in self._unconfirmed:
                self._unconfirmed.remove(tag)
                return 1
            return 0
        settled = 0
        for t in range(self._low, tag + 1):
            if t in self._unconfirmed:
                self._unconfirmed.remove(t)
                settled += 1
        self._low = max(self._low, tag + 1)
        return settled

    @property
    def outstanding(self) -> int:
        return len(self._unconfirmed)


class _SelectRun:
    """Run one SelectConnection until stop() or `timeout_s`; re-raise a connection error."""

    def __init__(self, on_channel: Callable[[Any, "_SelectRun"], None], timeout_s: float) -> None:
        self.on_channel = on_channel
        self.timeout_s = timeout_s
        self.error: BaseException | None = None
        self.timed_out = False
        self._stopping = False
        self.connection = None

    def run(self) -> None:
        import pika

        self.connection = pika.SelectConnection(
            _params(),
            on_open_callback=lambda conn: conn.channel(on_open_callback=self._channel_open),
            on_open_error_callback=self._open_failed,
            on_close_callback=lambda conn, reason: conn.ioloop.stop(),
        )
        self.connection.ioloop.call_later(max(0.01, self.timeout_s), self._time_out)
        self.connection.ioloop.start()
        if self.error is not None:
            raise self.error

    def call_later(self, delay: float, callback: Callable[[], None]) -> None:
        self.connection.ioloop.call_later(delay, callback)

    def stop(self) -> None:
        self._stopping = True
        if self.connection.is_open:
            self.connection.close()
        elif not self.connection.is_closing:
            self.connection.ioloop.stop()

    def _channel_open(self, channel) -> None:
        channel.add_on_close_callback(self._channel_closed)
        self.on_channel(channel, self)

    def _channel_closed(self, channel, reason) -> None:
        if not self._stopping:
            self.error = RuntimeError(f"RabbitMQ closed the channel: {reason}")
            self.stop()

    def _open_failed(self, connection, exc) -> None:
        self.error = exc
        connection.ioloop.stop()

    def _time_out(self) -> None:
        self.timed_out = True
        self.stop()


def _properties():
    import pika

    return pika.BasicProperties(delivery_mode=2)


def windowed_publish(queue: str, count: int, payload: bytes, window: int, phase: Phase) -> int:
    """Publish `count` persistent messages with at most `window` unconfirmed; return nacks."""
    import pika

    confirms = ConfirmWindow()
    state = {"published": 0, "settled": 0, "nacked": 0}
    props = _properties()

    def top_up(channel, run: _SelectRun) -> None:
        if phase.expired:
            phase.end()
            run.stop()
            return
        while confirms.outstanding < window and state["published"] < count:
            channel.basic_publish("", queue, payload, props)
            confirms.published()
            state["published"] += 1

    def on_channel(channel, run: _SelectRun) -> None:
        def on_confirm(frame) -> None:
            method = frame.method
            settled = confirms.confirm(method.delivery_tag, method.multiple)
            state["settled"] += settled
            if isinstance(method, pika.spec.Basic.Nack):
                state["nacked"] += settled
            else:
                phase.advance(settled)
            if state["settled"] >= count:
                phase.end()
                run.stop()
            else:
                top_up(channel, run)

        def start(_frame) -> None:
            phase.begin()
            top_up(channel, run)

        channel.confirm_delivery(ack_nack_callback=on_confirm, callback=start)

    run = _SelectRun(on_channel, phase.deadline - time.monotonic() + 5)
    run.run()
    phase.end()
    return state["nacked"]


class RabbitMQ(Adapter):
    name = "rabbitmq"

    def __init__(self) -> None:
        super().__init__()
        self.run_id = uuid.uuid4().hex[:8]
        self.main_queue = f"zbench.{self.run_id}.main"
        self._created: list[str] = []

    # -- admin, through a BlockingConnection ---------------------------------

    def _admin(self, action: Callable[[Any], Any]) -> Any:
        import pika

        connection = pika.BlockingConnection(_params())
        try:
            return action(connection)
        finally:
            connection.close()

    def _declare(self, queue: str) -> None:
        def declare(connection):
            channel = connection.channel()
            channel.queue_declare(queue, durable=True, arguments={"x-queue-type": "quorum"})

        self._admin(declare)
        self._created.append(queue)

    def _delete(self, queue: str) -> None:
        self._admin(lambda connection: connection.channel().queue_delete(queue))
        self._created.remove(queue)

    # -- Adapter -------------------------------------------------------------

    def check(self) -> None:
        try:
            import pika  # noqa: F401
        except ImportError as exc:
            raise Skipped(f"pika not installed ({exc})") from exc
        try:
            props = self._admin(lambda connection: connection._impl.server_properties)
        except Exception as exc:
            raise Skipped(f"RabbitMQ not reachable at {HOST}:{PORT} ({type(exc).__name__}: {exc})")
        version = props.get("version", b"?")
        self.version = version.decode() if isinstance(version, bytes) else str(version)
        major_minor = tuple(int(x) for x in self.version.split(".")[:2] if x.isdigit())
        if major_minor < (3, 8):
            raise Skipped(f"RabbitMQ {self.version} has no quorum queues (needs 3.8+)")
        setting = "quorum queue (Raft WAL fsync before confirm), delivery_mode=2, confirms, window 1,000"
        self.durability = {
            "produce": setting + " (no interval-fsync mode exists: same as fsync always)",
            "produce_1k": setting,
            "produce_fsync_always": setting,
            "consume_ack": f"prefetch {PREFETCH}, basic.ack per message",
            "latency": "paced publisher with confirms; consumer prefetch 1,000, basic.ack per message",
        }

    def setup(self) -> None:
        self._declare(self.main_queue)

    def teardown(self) -> None:
        for queue in list(self._created):
            try:
                self._delete(queue)
            except Exception:
                pass

    def server_pids(self) -> list[int]:
        return pids_by_name("beam.smp")

    def produce(self, spec: ProduceSpec, phase: Phase) -> None:
        if not spec.batched:
            raise Skipped("no multi-record publish: the produce row is already one message per basic.publish")
        queue = self.main_queue if spec.workload == "produce" else f"zbench.{self.run_id}.{spec.workload}"
        if queue != self.main_queue:
            self._declare(queue)
        try:
            nacked = windowed_publish(queue, spec.count, os.urandom(spec.size), spec.window, phase)
            phase.extra["nacked"] = nacked
        finally:
            if queue != self.main_queue:
                self._delete(queue)

    def prefill(self, count: int, size: int) -> None:
        phase = Phase(system=self.name, workload="prefill", target=count, timeout_s=600,
                      server_pids=list)
        windowed_publish(self.main_queue, count, os.urandom(size), 1000, phase)

    def consume_ack(self, count: int, phase: Phase) -> None:
        def on_channel(channel, run: _SelectRun) -> None:
            ending = []

            def ended(_frame) -> None:
                phase.end()
                run.stop()

            def on_message(ch, method, _properties, _body) -> None:
                ch.basic_ack(method.delivery_tag)
                if ending:
                    return  # delivered after the phase's end (a timed-out phase): not counted
                phase.advance()
                if phase.records >= count or phase.expired:
                    ending.append(True)
                    # basic.ack has no reply; the answer to a passive declare sent after the
                    # last one means the server has taken every ack off the channel (zbroker's
                    # phase ends once its acks are applied). If it never comes, the run's
                    # own timeout ends the phase.
                    ch.queue_declare(self.main_queue, passive=True, callback=ended)

            def consume(_frame) -> None:
                phase.begin()
                channel.basic_consume(self.main_queue, on_message, auto_ack=False)

            channel.basic_qos(prefetch_count=PREFETCH, callback=consume)

        run = _SelectRun(on_channel, phase.deadline - time.monotonic() + 5)
        run.run()
        phase.end()

    def latency(self, rate: float, seconds: float, size: int, phase: Phase) -> dict[str, Any]:
        queue = f"zbench.{self.run_id}.latency"
        self._declare(queue)
        recorder = LatencyRecorder()
        publisher = PublisherProcess(paced_publisher, {"queue": queue, "rate": rate, "seconds": seconds,
                                                       "size": size})
        expected = Pacer(rate, seconds, 0.0).total
        try:
            def on_channel(channel, run: _SelectRun) -> None:
                def on_message(ch, method, _properties, body) -> None:
                    recorder.record(body, time.time_ns())
                    ch.basic_ack(method.delivery_tag)
                    phase.advance()
                    if phase.records >= expected:
                        phase.end()
                        run.stop()

                def consuming(_frame) -> None:
                    phase.begin()  # before the publisher, as for every system
                    publisher.start()

                def consume(_frame) -> None:
                    channel.basic_consume(queue, on_message, auto_ack=False, callback=consuming)

                channel.basic_qos(prefetch_count=PREFETCH, callback=consume)

            run = _SelectRun(on_channel, phase.timeout_s + 5)
            run.run()
            phase.end()
            return {**recorder.summary(), "publisher": publisher.finish()}
        finally:
            self._delete(queue)


def paced_publisher(args: dict, ready, go, results) -> None:
    """Child process: publish `rate` stamped messages per second for `seconds`, with confirms."""
    import pika

    queue, rate, seconds, size = args["queue"], args["rate"], args["seconds"], args["size"]
    confirms = ConfirmWindow()
    state: dict[str, Any] = {"settled": 0, "nacked": 0}
    props = _properties()

    def on_channel(channel, run: _SelectRun) -> None:
        def tick() -> None:
            pacer = state["pacer"]
            n = pacer.due(time.monotonic())
            for _ in range(n):
                channel.basic_publish("", queue, stamp(size, time.time_ns()), props)
                confirms.published()
            next_at = pacer.next_due_at()
            if next_at is not None:
                run.call_later(max(0.0, next_at - time.monotonic()), tick)

        def on_confirm(frame) -> None:
            settled = confirms.confirm(frame.method.delivery_tag, frame.method.multiple)
            state["settled"] += settled
            if isinstance(frame.method, pika.spec.Basic.Nack):
                state["nacked"] += settled
            pacer = state.get("pacer")
            if pacer is not None and pacer.done and confirms.outstanding == 0:
                run.stop()

        def start(_frame) -> None:
            ready.set()
            go.wait()
            state["pacer"] = Pacer(rate, seconds, time.monotonic())
            tick()

        channel.confirm_delivery(ack_nack_callback=on_confirm, callback=start)

    run = _SelectRun(on_channel, seconds + 60)
    try:
        run.run()
        pacer = state.get("pacer")
        results.put({"sent": confirms.next_tag - 1, "confirmed": state["settled"] - state["nacked"],
                     "nacked": state["nacked"], "max_lag_ms": pacer.max_lag_s * 1000 if pacer else None})
    except Exception as exc:
        results.put({"error": f"{type(exc).__name__}: {exc}"})
