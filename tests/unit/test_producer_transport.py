"""Producers against stand-in transports: the in-flight window and replies that
arrive while the producer waits for something else."""

import asyncio
import threading
import types

import zmq

from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.batch import decode_fetched
from zbroker.client.aio import AsyncProducer
from zbroker.client.core import MetadataCache
from zbroker.client.sync import Producer
from tests.support.aio_call_stand_in import SendByCall


class _AsyncBroker(SendByCall):
    """Answers every produce after a short while, numbering records per partition (each
    partition an actor of its own: a `produce` per batch)."""

    def __init__(self) -> None:
        self.metadata = MetadataCache()
        self.metadata.update([{"name": "t", "partitions": [{"endpoint": "fake"}] * 3}])
        self.ends: dict[int, int] = {}
        self.stored: dict[int, list] = {}

    async def endpoint(self, topic, partition):
        return f"fake-{partition}"

    async def refresh(self, topics=None):
        pass

    async def call(self, endpoint, msg, frames=(), timeout=None):
        await asyncio.sleep(0.001)
        values = [r.value for r in decode_fetched(_as_stored(frames[0]), msg.topic, msg.partition)]
        base = self.ends.get(msg.partition, 0)
        self.ends[msg.partition] = base + len(values)
        self.stored.setdefault(msg.partition, []).extend(values)
        return types.SimpleNamespace(msg=m.ProduceReply(base_offset=base, count=len(values)), error=None)

    async def close(self):
        pass


def _as_stored(payload: bytes) -> bytes:
    """A produce payload framed as the log stores it, so the test can read its records back."""
    from zbroker.storage.log.partition_log import PartitionLog  # noqa: F401 (the layout lives in storage)
    import tempfile
    from pathlib import Path
    from zbroker.storage.log.partition_log import LogConfig
    from zbroker.protocol.batch import validate_payload
    with tempfile.TemporaryDirectory() as d:
        plog = PartitionLog.open(Path(d), LogConfig(), now_ms=0)
        plog.append(payload, validate_payload(payload), append_time_ms=0, producer_id=0, producer_seq=-1)
        data = plog.read(0, 1 << 30)
        plog.close()
    return data


def test_concurrent_senders_share_the_window_without_deadlock():
    # Taking the window one permit at a time, three senders each held part of what their
    # batch needed with nothing in flight to free the rest, and waited forever.
    async def main():
        producer = AsyncProducer("tcp://127.0.0.1:1", linger_ms=1000, batch_size=3, max_in_flight_records=4)
        await producer.conn.close()
        producer.conn = broker = _AsyncBroker()

        async def sender(partition):
            for i in range(30):
                await producer.send("t", b"%d-%d" % (partition, i), partition=partition)

        await asyncio.wait_for(asyncio.gather(*(sender(p) for p in range(3))), 10)
        await asyncio.wait_for(producer.flush(), 10)
        producer._linger_task.cancel()
        assert producer.in_flight_records == 0
        for p in range(3):
            assert broker.stored[p] == [b"%d-%d" % (p, i) for i in range(30)]  # all of them, in order

    asyncio.run(main())


def test_a_produce_reply_that_arrives_during_a_metadata_refresh_is_not_lost():
    # The refresh waits for its own reply and keeps the others aside; the producer must
    # take its replies back from there, or it resends (and times out) a batch that landed.
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    url = f"tcp://127.0.0.1:{port}"
    produces: list = []
    stop = threading.Event()

    def broker():
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not stop.is_set():
            if not poller.poll(20):
                continue
            identity, *frames = router.recv_multipart()
            env = codec.decode_request(frames)
            if env.op == "produce":
                produces.append(env.msg.topic)
                reply = m.ProduceReply(base_offset=len(produces) - 1, count=1)
            else:  # metadata: answered only after the produce reply, so that one waits aside
                stop.wait(0.1)
                reply = m.MetadataReply(topics=[{"name": t, "partitions": [{"partition": 0, "endpoint": url}]}
                                                for t in (env.msg.topics or ["a", "b"])])
            router.send_multipart([identity, *codec.encode_reply(reply, env.corr_id)])

    thread = threading.Thread(target=broker, daemon=True)
    thread.start()
    try:
        with Producer(url, linger_ms=0, request_timeout=1.0, retries=0) as producer:
            producer.conn.metadata.update([{"name": "a", "partitions": [{"partition": 0, "endpoint": url}]}])
            handle = producer.send("a", b"x", partition=0)
            producer.send("b", b"y")  # an unknown topic: a metadata refresh while "a" is in flight
            producer.flush(timeout=5)  # with retries=0 a lost reply fails here (TIMEOUT)
            assert handle.offset == 0
        assert produces == ["a", "b"]  # each batch sent once
    finally:
        stop.set()
        thread.join(2)
        router.close(linger=0)


def test_a_batch_over_the_frame_limit_fails_with_too_large_without_being_sent(monkeypatch):
    # An actor's socket drops such a frame without a reply: sent, it timed out and was sent
    # again at every retry, and failed minutes later as a TIMEOUT that hid the cause.
    from zbroker.protocol.errors import ErrorCode
    from zbroker.client.sync import ProduceError

    monkeypatch.setattr("zbroker.client.core.MAX_FRAME_BYTES", 1000)
    producer = Producer("tcp://127.0.0.1:1", linger_ms=0)
    try:
        handle = producer.send("t", bytes(2000), partition=0)
        try:
            producer.flush(timeout=1)
        except ProduceError as err:
            assert err.code == ErrorCode.TOO_LARGE
        else:
            raise AssertionError("flush did not report the refused batch")
        assert handle.error.code == ErrorCode.TOO_LARGE and handle.error.data["got"] > 1000
        assert producer.conn.sockets == {}  # nothing was sent anywhere
        assert producer.in_flight_records == 0 and producer.in_flight_bytes == 0
    finally:
        producer.conn.close()


def test_a_send_interrupted_after_its_batch_was_admitted_leaves_the_batch_to_be_retried():
    # Ctrl-C inside the socket send: the batch is in the window but was never filed as sent;
    # left so, it was never sent and its handle never resolved.
    producer = Producer("tcp://127.0.0.1:1", linger_ms=0)
    producer.conn.metadata.update([{"name": "t", "partitions": [{"endpoint": "tcp://127.0.0.1:2"}]}])

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    producer.conn.send = interrupted
    try:
        try:
            producer.send("t", b"v", partition=0)
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("the interrupt was swallowed")
        assert [batch.partition for _at, batch in producer.core.retrying] == [0]
        assert producer.in_flight_records == 1 and producer.core.take_failure() is None
    finally:
        producer.conn.close()
