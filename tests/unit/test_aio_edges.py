"""The asyncio client's edges: close() while records or acks are on their way, a damaged
batch on one partition, and closing twice. Each test failed before its fix."""

from __future__ import annotations

import asyncio

import pytest

from zbroker.protocol import messages as m
from zbroker.protocol.batch import build_batch_header, encode_values
from zbroker.protocol.errors import ErrorCode, Unavailable
from tests.support.aio_coordinator import ScriptedCoordinator, offline_consumer
from tests.unit.test_aio_consumer import consumed
from zbroker.client.aio import AsyncConsumer, AsyncProducer
from zbroker.client.sync import ProduceError
from tests.support.aio_call_stand_in import SendByCall


class GatedConn(SendByCall):
    """Answers each Produce once `gate` is set (a slow partition actor)."""
    request_timeout = 5.0

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.next_offset = 0
        self.metadata = type("Meta", (), {"topics": {"t": [{}]}, "partitions": lambda self, t: 1})()

    async def refresh(self, topics=None) -> None:
        pass

    async def endpoint(self, topic, partition):
        return "actor"

    async def call(self, endpoint, msg, frames=(), timeout=None):
        await self.gate.wait()
        base, self.next_offset = self.next_offset, self.next_offset + 1
        return type("Env", (), {"msg": m.ProduceReply(base_offset=base, count=1), "error": None})()

    async def close(self) -> None:
        pass


def gated_producer() -> AsyncProducer:
    producer = AsyncProducer("tcp://127.0.0.1:1", linger_ms=60_000)
    producer.conn.ctx.term()
    producer.conn = GatedConn()
    return producer


def test_a_record_sent_while_close_waits_for_the_flush_is_refused_at_the_call():
    producer = gated_producer()

    async def main():
        first = await producer.send("t", b"a", partition=0)
        closing = asyncio.create_task(producer.close())
        await asyncio.sleep(0.01)  # close() drained the batch of `first` and waits for its delivery
        with pytest.raises(ProduceError) as refused:
            await producer.send("t", b"b", partition=0)
        producer.conn.gate.set()
        await asyncio.wait_for(closing, 5)
        return first, refused.value

    first, refused = asyncio.run(main())
    assert first.offset == 0
    assert refused.code is ErrorCode.SHUTTING_DOWN


def test_a_send_waiting_for_metadata_when_close_begins_is_refused():
    """Its record would be added after close()'s flush drained the accumulator, and wait forever."""
    producer = gated_producer()
    producer.conn.gate.set()
    producer.conn.metadata.topics.clear()  # the first keyed send asks for the topic's partitions
    refreshing = asyncio.Event()
    release = asyncio.Event()

    async def slow_refresh(topics=None):
        refreshing.set()
        await release.wait()
        producer.conn.metadata.topics["t"] = [{}]

    producer.conn.refresh = slow_refresh

    async def main():
        sending = asyncio.create_task(producer.send("t", b"v", key=b"k"))
        await refreshing.wait()
        await asyncio.wait_for(producer.close(), 5)
        release.set()
        with pytest.raises(ProduceError) as refused:
            await sending
        return refused.value

    assert asyncio.run(main()).code is ErrorCode.SHUTTING_DOWN
    assert not producer.acc.drain()  # nothing left behind


def test_a_record_sent_after_close_is_refused():
    producer = gated_producer()

    async def main():
        producer.conn.gate.set()
        await producer.send("t", b"a", partition=0)
        await producer.close()
        with pytest.raises(ProduceError) as refused:
            await producer.send("t", b"b", partition=0)
        with pytest.raises(ProduceError):
            await producer.flush()
        return refused.value

    assert asyncio.run(main()).code is ErrorCode.SHUTTING_DOWN


# ---- consumer -------------------------------------------------------------------------------


class ParksAcks(ScriptedCoordinator):
    """Parks every Ack: the test answers them."""

    def answer(self, msg):
        if isinstance(msg, m.Ack):
            return None
        return m.LeaveReply()


def test_flush_acks_does_not_return_while_the_interval_request_holding_the_acks_is_unanswered():
    coordinator = ParksAcks()
    consumer = offline_consumer(coordinator, ack_interval_ms=1)

    async def main():
        for offset in range(3):
            await consumer.ack(consumed(offset))
        while not coordinator.parked:  # the interval is up: its Ack request waits at the coordinator
            await asyncio.sleep(0.001)
        flush = asyncio.create_task(consumer.flush_acks())
        done, _ = await asyncio.wait([flush], timeout=0.5)
        returned_early = flush in done and flush.exception() is None
        # The coordinator could not apply that request after all: the acks are held, not applied.
        coordinator.reply_to_parked(Unavailable("coordinator restarting"))
        await asyncio.sleep(0.05)
        held = consumer.acks.take()
        flush.cancel()
        await asyncio.gather(flush, return_exceptions=True)
        return returned_early, held

    returned_early, held = asyncio.run(main())
    assert not returned_early, f"flush_acks() succeeded while these acks were not applied: {held}"


class OneCorruptPartition(ScriptedCoordinator):
    """One poll leases partitions 0 and 1; partition 0's stored batch fails its CRC check."""

    def __init__(self) -> None:
        super().__init__()
        self.metadata.update([{"name": "t", "partitions": [{"partition": p, "endpoint": f"actor-{p}", "actor_id": "a"}
                                                            for p in (0, 1)]}])

    def answer(self, msg):
        if isinstance(msg, m.Poll):
            first = not any(isinstance(e, m.Poll) for e in self.sent[:-1])
            return m.PollReply(generation=1, deliveries=[["t", 0, 7, 0, 2, 1, "new"], ["t", 1, 8, 0, 2, 1, "new"]]
                               if first else [], ack_timeout_ms=30_000, acked=0, stale=[])
        assert isinstance(msg, m.Fetch)
        values = [b"p%d-%d" % (msg.partition, o) for o in range(msg.offset, 2)]
        payload = encode_values(values, 0)
        header = build_batch_header(payload, base_offset=msg.offset, record_count=len(values), append_time_ms=0)
        frame = bytearray(header + payload)
        if msg.partition == 0:
            frame[-1] ^= 0xFF  # bit rot in the segment
        return m.FetchReply(log_start=0, log_end=2), [bytes(frame)]


def test_a_corrupt_batch_on_one_partition_does_not_wedge_every_later_poll():
    coordinator = OneCorruptPartition()
    consumer = offline_consumer(coordinator)

    async def main():
        outcomes = []
        for _ in range(4):
            try:
                outcomes.append(sorted((r.partition, r.offset) for r in await consumer.poll(timeout=0.0)))
            except Exception as exc:  # noqa: BLE001
                outcomes.append(type(exc).__name__)
        return outcomes

    outcomes = asyncio.run(asyncio.wait_for(main(), 10))
    assert [(1, 0), (1, 1)] in outcomes, f"partition 1's records never handed out: {outcomes}"


def test_closing_a_consumer_twice_raises_nothing():
    """`async with consumer:` around code that also calls close() (as the sync Consumer allows)."""
    consumer = AsyncConsumer("tcp://127.0.0.1:1", group="g", topics=["t"], request_timeout=0.2)
    consumer.member_id, consumer.generation = "m", 1  # joined (no coordinator: Leave fails, ignored)

    async def main():
        await consumer.close()
        await consumer.close()

    asyncio.run(asyncio.wait_for(main(), 10))


class _Turns:
    """Just the turn-taking of AsyncConsumer.poll(), without a consumer around it."""
    def __init__(self) -> None:
        self._turn = asyncio.Lock()

    wait_for_turn = AsyncConsumer._wait_for_turn


def test_a_turn_not_taken_in_time_or_cancelled_leaves_the_lock_to_the_others():
    async def main():
        turns = _Turns()
        await turns._turn.acquire()  # a running poll holds the turn
        timed_out = await turns.wait_for_turn(0.01)
        waiting = asyncio.ensure_future(turns.wait_for_turn(10))
        await asyncio.sleep(0)
        waiting.cancel()  # the poll waiting for its turn is cancelled
        with pytest.raises(asyncio.CancelledError):
            await waiting
        # The holder lets go and, in the same step, the next waiter is cancelled before it
        # runs: the lock handed to it must come back rather than stay held for ever.
        racing = asyncio.ensure_future(turns.wait_for_turn(10))
        await asyncio.sleep(0.01)
        turns._turn.release()
        racing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await racing
        free_after = not turns._turn.locked()
        got_it = await turns.wait_for_turn(0)  # a free lock is taken even with no time left
        return timed_out, free_after, got_it, turns._turn.locked()

    assert asyncio.run(main()) == (False, True, True, True)
