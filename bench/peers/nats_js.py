"""NATS JetStream through nats-py: file-storage stream, windowed publish_async, durable pull consumer.

nats-py is asyncio-only; each workload is one `asyncio.run` with its own
connection. `js.publish_async` keeps at most `publish_async_max_pending`
publishes waiting for their PubAck, which is the 1,000-record window.

Durability: a file-storage stream with one replica acknowledges a publish
once the server has written it to its block file; it does not fsync per
message, and nats-server 2.9 takes the sync policy from server configuration
only. This harness never reconfigures the shared server, so the
`produce_fsync_always` row is skipped for NATS.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Any

from bench.adapter import Adapter, Phase, ProduceSpec, Skipped
from bench.latency import LatencyRecorder, Pacer, PublisherProcess, stamp
from bench.procstat import pids_by_name

URL = "nats://127.0.0.1:4222"
FETCH_BATCH = 1000


async def _connect():
    import nats

    return await nats.connect(URL, connect_timeout=3, allow_reconnect=False, max_reconnect_attempts=0)


async def _add_stream(js, stream: str) -> None:
    from nats.js.api import StorageType

    await js.add_stream(name=stream, subjects=[stream], storage=StorageType.FILE, num_replicas=1)


async def _publish_window(stream: str, count: int, payload: bytes, window: int, phase: Phase) -> int:
    """Publish with at most `window` PubAcks outstanding; return how many failed."""
    nc = await _connect()
    failed = 0

    def settled(future: asyncio.Future) -> None:
        nonlocal failed
        if future.cancelled() or future.exception() is not None:
            failed += 1
        else:
            phase.advance()

    try:
        # publish_async blocks on the library's semaphore once `window` acks are outstanding.
        js = nc.jetstream(publish_async_max_pending=window)
        phase.begin()
        for _ in range(count):
            (await js.publish_async(stream, payload)).add_done_callback(settled)
            if phase.expired:
                break
        await asyncio.wait_for(js.publish_async_completed(), timeout=max(1.0, phase.deadline - time.monotonic()))
        phase.end()
        return failed
    finally:
        await nc.close()


async def _consume(stream: str, durable: str, count: int, phase: Phase) -> None:
    """Bulk consumption: fetch batches of FETCH_BATCH from a durable pull consumer, ack each."""
    from nats.errors import TimeoutError as NatsTimeout

    nc = await _connect()
    try:
        js = nc.jetstream()
        sub = await js.pull_subscribe(stream, durable=durable, stream=stream, config=_consumer_config(durable))
        phase.begin()
        while phase.records < count and not phase.expired:
            try:
                msgs = await sub.fetch(FETCH_BATCH, timeout=2.0)
            except (asyncio.TimeoutError, NatsTimeout):
                continue
            for msg in msgs:
                await msg.ack()
            phase.advance(len(msgs))
        await nc.flush()
        phase.end()
    finally:
        await nc.close()


def _consumer_config(durable: str):
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    return ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT,
                          deliver_policy=DeliverPolicy.ALL, max_ack_pending=10 * FETCH_BATCH, ack_wait=60)


async def _consume_stamped(stream: str, durable: str, count: int, phase: Phase,
                           recorder: LatencyRecorder, publisher: PublisherProcess) -> None:
    """Streaming consumption for the latency workload: a continuous pull.

    nats-py's `fetch(n)` waits for n messages or its timeout once it has to
    linger, which would add up to the timeout to every latency figure. So the
    consumer keeps pull requests outstanding itself (as the NATS clients'
    `Consume()` does): it asks for PULL_BATCH more whenever half of the last
    request has arrived, or when it has expired, and handles each message in
    the subscription callback as it arrives.
    """
    import json

    from nats.js.client import JetStreamContext

    pull_batch, pull_expires_s = 1000, 1.0
    nc = await _connect()
    try:
        js = nc.jetstream()
        await js.add_consumer(stream, _consumer_config(durable))
        inbox = nc.new_inbox()
        request = json.dumps({"batch": pull_batch, "expires": int(pull_expires_s * 1e9)}).encode()
        next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        done = asyncio.Event()
        state = {"pulled_at": 0.0, "since_pull": 0}

        async def pull() -> None:
            state["pulled_at"], state["since_pull"] = time.monotonic(), 0
            await nc.publish(next_subject, request, reply=inbox)

        async def on_message(msg) -> None:
            if JetStreamContext.is_status_msg(msg):
                return  # 408 expired request, 100 heartbeat, ...
            recorder.record(msg.data, time.time_ns())
            await msg.ack()
            phase.advance()
            state["since_pull"] += 1
            if phase.records >= count:
                done.set()
            elif state["since_pull"] >= pull_batch // 2:
                await pull()

        await nc.subscribe(inbox, cb=on_message)
        # The phase (its /proc scan) begins before the publisher: every system's clock
        # and the stamps of its first records start the same way (zbroker_adapter._consume).
        phase.begin()
        publisher.start()
        await pull()
        while not done.is_set() and not phase.expired:
            try:
                await asyncio.wait_for(done.wait(), timeout=pull_expires_s / 4)
            except asyncio.TimeoutError:
                if time.monotonic() - state["pulled_at"] >= pull_expires_s:
                    await pull()
        await nc.flush()
        phase.end()
    finally:
        await nc.close()


class NatsJetStream(Adapter):
    name = "nats"

    def __init__(self) -> None:
        super().__init__()
        self.run_id = uuid.uuid4().hex[:8].upper()
        self.main_stream = f"ZBENCH_{self.run_id}_MAIN"
        self._streams: list[str] = []

    def _admin(self, op: str, stream: str) -> None:
        async def run() -> None:
            nc = await _connect()
            try:
                js = nc.jetstream()
                if op == "add":
                    await _add_stream(js, stream)
                else:
                    await js.delete_stream(stream)
            finally:
                await nc.close()

        asyncio.run(run())
        if op == "add":
            self._streams.append(stream)
        else:
            self._streams.remove(stream)

    def check(self) -> None:
        try:
            import nats  # noqa: F401
        except ImportError as exc:
            raise Skipped(f"nats-py not installed ({exc})") from exc

        async def probe() -> tuple[str, bool]:
            nc = await _connect()
            try:
                version = nc._server_info.get("version", "?")
                try:
                    await nc.jetstream().account_info()
                    return version, True
                except Exception:
                    return version, False
            finally:
                await nc.close()

        try:
            self.version, has_js = asyncio.run(probe())
        except Exception as exc:
            raise Skipped(f"NATS not reachable at {URL} ({type(exc).__name__}: {exc})")
        if not has_js:
            raise Skipped(f"NATS {self.version} at {URL} has JetStream disabled")
        setting = "file storage, R1, ack after write (no per-message fsync; server-side sync policy), window 1,000"
        self.durability = {
            "produce": setting,
            "produce_1k": setting,
            "consume_ack": f"durable pull consumer, fetch {FETCH_BATCH}, explicit ack per message",
            "latency": "paced publish_async; durable pull consumer, explicit ack per message",
        }

    def setup(self) -> None:
        self._admin("add", self.main_stream)

    def teardown(self) -> None:
        for stream in list(self._streams):
            try:
                self._admin("delete", stream)
            except Exception:
                pass

    def server_pids(self) -> list[int]:
        return pids_by_name("nats-server")

    def produce(self, spec: ProduceSpec, phase: Phase) -> None:
        if spec.fsync == "always":
            raise Skipped("fsync per message is nats-server configuration, not a stream or client "
                          "setting; the shared server is not reconfigured")
        if not spec.batched:
            raise Skipped("no multi-record publish: the produce row is already one message per publish")
        stream = self.main_stream if spec.workload == "produce" else f"ZBENCH_{self.run_id}_{spec.workload.upper()}"
        if stream != self.main_stream:
            self._admin("add", stream)
        try:
            phase.extra["failed"] = asyncio.run(
                _publish_window(stream, spec.count, os.urandom(spec.size), spec.window, phase))
        finally:
            if stream != self.main_stream:
                self._admin("delete", stream)

    def prefill(self, count: int, size: int) -> None:
        phase = Phase(system=self.name, workload="prefill", target=count, timeout_s=600, server_pids=list)
        asyncio.run(_publish_window(self.main_stream, count, os.urandom(size), 1000, phase))

    def consume_ack(self, count: int, phase: Phase) -> None:
        asyncio.run(_consume(self.main_stream, "bench", count, phase))

    def latency(self, rate: float, seconds: float, size: int, phase: Phase) -> dict[str, Any]:
        stream = f"ZBENCH_{self.run_id}_LATENCY"
        self._admin("add", stream)
        try:
            recorder = LatencyRecorder()
            publisher = PublisherProcess(paced_publisher, {"stream": stream, "rate": rate,
                                                           "seconds": seconds, "size": size})
            expected = Pacer(rate, seconds, 0.0).total
            asyncio.run(_consume_stamped(stream, "latency", expected, phase, recorder, publisher))
            return {**recorder.summary(), "publisher": publisher.finish()}
        finally:
            self._admin("delete", stream)


def paced_publisher(args: dict, ready, go, results) -> None:
    """Child process: publish_async stamped messages at `rate` per second for `seconds`."""

    async def run() -> dict:
        nc = await _connect()
        try:
            js = nc.jetstream(publish_async_max_pending=1000)
            futures = []
            ready.set()
            while not go.wait(0.05):
                await asyncio.sleep(0)
            pacer = Pacer(args["rate"], args["seconds"], time.monotonic())
            while not pacer.done:
                for _ in range(pacer.due(time.monotonic())):
                    futures.append(await js.publish_async(args["stream"], stamp(args["size"], time.time_ns())))
                next_at = pacer.next_due_at()
                if next_at is not None:
                    await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            acks = await asyncio.gather(*futures, return_exceptions=True)
            failed = sum(1 for a in acks if isinstance(a, BaseException))
            return {"sent": pacer.sent, "failed": failed, "max_lag_ms": pacer.max_lag_s * 1000}
        finally:
            await nc.close()

    try:
        results.put(asyncio.run(run()))
    except Exception as exc:
        results.put({"error": f"{type(exc).__name__}: {exc}"})
