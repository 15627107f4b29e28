"""The asyncio client against real processes: what cancellation (`asyncio.wait_for`) must not lose.

A partition actor stopped with SIGSTOP holds the producer's requests without
answering, so a flush or send is still waiting when the caller gives up on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import pytest

from zbroker.client import Admin
from zbroker.client.aio import AsyncProducer
from zbroker.client.sync import Connection, fetch

pytestmark = pytest.mark.processes


def records_in_log(url: str, topic: str, partitions: int) -> int:
    conn = Connection(url)
    try:
        return sum(fetch(conn, topic, p, 0)[2] for p in range(partitions))
    finally:
        conn.close()


@contextlib.contextmanager
def paused(broker, actor: str = "partition-0"):
    """The actor's process stopped: requests to it wait until the block ends."""
    pid = broker.pids()[actor]
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def give_up_after(awaitable, seconds: float) -> None:
    """What an application with a deadline does: cancel the call and carry on."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(awaitable, seconds)


@pytest.mark.parametrize("partitions, window", [
    (5, 10),  # five full batches, a window for one: four wait for permits when flush is cancelled
    (1, 10_000),  # the one batch is in flight when flush is cancelled
], ids=["batches-waiting-for-the-window", "deliveries-in-flight"])
def test_a_cancelled_flush_loses_nothing_and_the_next_flush_waits_for_it_all(broker, partitions, window):
    with Admin(broker.url) as admin:
        admin.create_topic("t", partitions=partitions)

    async def main():
        producer = AsyncProducer(broker.url, linger_ms=60_000, batch_size=100, max_in_flight_records=window)
        await producer.conn.refresh(["t"])
        handles = [await producer.send("t", b"v%d" % i, partition=p) for p in range(partitions) for i in range(10)]
        with paused(broker):
            await give_up_after(producer.flush(), 0.5)
        await producer.flush()
        undone = [h for h in handles if not h.done]
        await producer.close()
        return handles, undone

    handles, undone = asyncio.run(main())
    assert undone == []
    assert sorted(h.offset for h in handles) == sorted(list(range(10)) * partitions)
    assert records_in_log(broker.url, "t", partitions) == 10 * partitions


def test_a_send_cancelled_while_its_batch_waits_for_the_window_loses_no_record(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("t", partitions=2)

    async def main():
        producer = AsyncProducer(broker.url, linger_ms=60_000, batch_size=5, max_in_flight_records=5)
        await producer.conn.refresh(["t"])
        first = [await producer.send("t", b"a%d" % i, partition=0) for i in range(5)]  # a full batch: in flight
        with paused(broker):
            buffered = [await producer.send("t", b"b%d" % i, partition=1) for i in range(4)]
            # The fifth closes the batch, which waits for the window: the caller gives up.
            await give_up_after(producer.send("t", b"b4", partition=1), 0.3)
        await producer.flush()
        undone = [h for h in first + buffered if not h.done]
        await producer.close()
        return undone

    undone = asyncio.run(main())
    assert undone == []
    assert records_in_log(broker.url, "t", 2) == 10  # b4 included: its send was cancelled after it was taken
