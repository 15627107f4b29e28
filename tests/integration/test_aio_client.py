"""The asyncio client against real processes: what cancellation (`asyncio.wait_for`) must not lose.

A partition actor stopped with SIGSTOP holds the producer's requests without
answering, so a flush or send is still waiting when the caller gives up on it;
a poll with nothing to lease waits at the coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest

from zbroker.protocol.errors import ZBrokerError
from zbroker.client import Admin, Producer
from zbroker.client.aio import AsyncAdmin, AsyncConsumer, AsyncProducer
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
        with contextlib.suppress(ProcessLookupError):  # killed inside the block, and already reaped
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



def test_a_sender_waits_when_batches_closed_by_linger_wait_for_the_window(broker):
    """Batches closed by the linger timer, not by a send that fills them, hold the
    caller back too: a slow trickle of sends to a stalled broker must not queue
    batches without bound."""
    with Admin(broker.url) as admin:
        admin.create_topic("trickle", partitions=1)

    async def main():
        producer = AsyncProducer(broker.url, linger_ms=1, batch_size=1000, max_in_flight_records=1)
        await producer.conn.refresh(["trickle"])
        sent, queued, attempted = [], [], [0]

        async def trickle():
            for i in range(200):
                attempted[0] += 1  # a send cancelled while it waits has its record taken already
                sent.append(await producer.send("trickle", b"%d" % i))
                queued.append(len(producer.waiting_for_window))
                await asyncio.sleep(0.005)  # the linger timer closes each one-record batch

        with paused(broker):
            await give_up_after(trickle(), 1.0)
        await producer.flush()
        undone = [h for h in sent if not h.done]
        await producer.close()
        return attempted[0], max(queued), undone

    count, most_queued, undone = asyncio.run(main())
    assert most_queued <= 1 and count < 10, (count, most_queued)
    assert undone == []
    assert records_in_log(broker.url, "trickle", 1) == count

def test_records_leased_to_a_cancelled_poll_go_to_the_next_poll(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("t", partitions=1)
        admin.configure_group("g", ack_timeout_ms=60_000)  # stranded records would come back only after this

    async def main():
        async with AsyncConsumer(broker.url, group="g", topics=["t"]) as consumer:
            await give_up_after(consumer.poll(max_records=100, timeout=5.0), 0.3)  # nothing to lease yet
            with Producer(broker.url) as producer:  # leased to the poll still waiting at the coordinator
                for i in range(10):
                    producer.send("t", b"%d" % i, partition=0)
            got, deadline = [], time.monotonic() + 30
            while len(got) < 10 and time.monotonic() < deadline:
                for record in await consumer.poll(max_records=100, timeout=1.0):
                    got.append(record)
                    await consumer.ack(record)
            return got

    got = asyncio.run(main())
    assert sorted(r.offset for r in got) == list(range(10))
    assert {r.attempt for r in got} == {1}


def test_acks_leave_after_the_ack_interval_without_waiting_for_a_poll(broker):
    """A batch handled slowly: the acks of its first records must reach the coordinator
    while the rest is still handled, or the ack timeout redelivers the whole batch."""
    with Admin(broker.url) as admin:
        admin.create_topic("t", partitions=1)
    with Producer(broker.url) as producer:
        for i in range(10):
            producer.send("t", b"%d" % i, partition=0)

    async def in_flight(admin: AsyncAdmin) -> int:  # leased and neither acked nor expired
        return (await admin.describe_group("g"))["partitions"][0]["in_flight"]

    async def main():
        async with AsyncAdmin(broker.url) as admin, \
                AsyncConsumer(broker.url, group="g", topics=["t"], ack_interval_ms=5) as consumer:
            records = []
            while len(records) < 10:
                records += await consumer.poll(max_records=10, timeout=1.0)
            for record in records[:5]:
                await consumer.ack(record)
            deadline = time.monotonic() + 10  # liveness only: the interval is 5 ms
            while await in_flight(admin) > 5 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)  # the handler at work on the sixth record; no poll meanwhile
            return await in_flight(admin)

    assert asyncio.run(main()) == 5


def test_records_being_fetched_when_the_heartbeat_re_joins_are_still_handed_out(broker):
    """A rebalance revokes only the leases of partitions that move: in a shared group this
    member keeps its lease, and dropping its records at the re-join stranded them until
    the ack timeout (a delivery attempt each). The heartbeat hears of the rebalance while
    the poll fetches; the poll hands its records out, and their acks, sent after the
    re-join, are applied."""
    with Admin(broker.url) as admin:
        admin.create_topic("rejoin", partitions=1)
        admin.configure_group("rejoin", mode="shared", ack_timeout_ms=60_000)
    with Producer(broker.url) as producer:
        producer.produce("rejoin", [b"%d" % i for i in range(10)], partition=0)

    async def main():
        a = AsyncConsumer(broker.url, group="rejoin", topics=["rejoin"], session_timeout_ms=1500)
        await a.start()
        await a.conn.refresh(["rejoin"])
        try:
            with paused(broker):
                poll = asyncio.ensure_future(a.poll(max_records=100, timeout=1.0))
                await asyncio.sleep(0.3)  # the Poll is answered; the fetch waits on the paused actor
                generation = a.generation
                b = AsyncConsumer(broker.url, group="rejoin", topics=["rejoin"])
                await b.start()  # a new generation: a's heartbeat (every 0.5 s) is fenced
                while not a.flow.needs_rejoin:
                    await asyncio.sleep(0.05)
            got = await asyncio.wait_for(poll, 30)
            await a.ack_many(got)
            await a.flush_acks()  # refused in the old generation: re-joins, then sent again
            await b.close()
            return [r.offset for r in got], a.generation > generation, a.stats["acked"], a.stats["stale"]
        finally:
            await a.close()

    assert asyncio.run(main()) == (list(range(10)), True, 10, 0)


def test_key_less_and_key_ed_records_keep_their_order_and_a_wrong_type_fails_alone(broker):
    """Key-less records take the producer's fast path (the sticky partition's open
    batch), the rest the general one: one partition keeps the order they were sent in."""
    with Admin(broker.url) as admin:
        admin.create_topic("mixed", partitions=1)

    async def main():
        producer = AsyncProducer(broker.url, linger_ms=50, batch_size=7)
        sent, handles = [], []
        for i in range(40):
            key = b"key-%d" % i if i % 4 == 1 else None
            headers = {"n": b"%d" % i} if i % 4 == 2 else None
            handles.append(await producer.send("mixed", b"v%d" % i, key=key, headers=headers))
            sent.append((key, b"v%d" % i, headers))
            if i == 20:
                with pytest.raises(TypeError, match="value must be bytes"):
                    await producer.send("mixed", "text")
        await producer.flush()
        await producer.close()
        return sent, handles

    sent, handles = asyncio.run(main())
    assert [h.offset for h in handles] == list(range(40)) and {h.partition for h in handles} == {0}
    conn = Connection(broker.url)
    try:
        records, _start, _end = fetch(conn, "mixed", 0, 0)
    finally:
        conn.close()
    assert [(r.key, r.value, r.headers) for r in records] == sent



def test_two_tasks_polling_one_consumer_never_get_the_same_record(broker):
    """A second poll() while the first is fetching: it must not fetch the same
    delivery beside it. The delivery spans two stored batches, larger than the
    fetch's byte estimate, so it takes two fetches; the actor is paused so that
    both polls are waiting on the first one."""
    with Admin(broker.url) as admin:
        admin.create_topic("turns", partitions=1)
        admin.configure_group("turns", ack_timeout_ms=60_000)
    with Producer(broker.url) as producer:
        for first in (0, 10):  # two batches of 10 records, 20 KB each
            producer.produce("turns", [b"%d-" % i + b"x" * 2000 for i in range(first, first + 10)], partition=0)

    async def main():
        consumer = AsyncConsumer(broker.url, group="turns", topics=["turns"])
        await consumer.start()
        await consumer.conn.refresh(["turns"])
        try:
            with paused(broker):
                first = asyncio.ensure_future(consumer.poll(max_records=20, timeout=2.0))
                await asyncio.sleep(0.3)  # the Poll is answered; its fetch waits on the paused actor
                second = asyncio.ensure_future(consumer.poll(max_records=20, timeout=2.0))
                await asyncio.sleep(0.1)
            got = await asyncio.wait_for(first, 30) + await asyncio.wait_for(second, 30)
            return [r.offset for r in got]
        finally:
            await consumer.close()

    assert sorted(asyncio.run(main())) == list(range(20))


def test_a_poll_waiting_for_its_turn_returns_when_its_own_timeout_is_up(broker):
    """The wait for a turn counts against the waiting call's timeout: a short
    poll() behind a long one on an empty topic returns [] while the long one is
    still waiting at the coordinator, and the long one still gets a record
    produced after that."""
    with Admin(broker.url) as admin:
        admin.create_topic("turn-timeout", partitions=1)

    async def main():
        consumer = AsyncConsumer(broker.url, group="turn-timeout", topics=["turn-timeout"])
        await consumer.start()
        try:
            long_poll = asyncio.ensure_future(consumer.poll(max_records=10, timeout=5.0))
            await asyncio.sleep(0.2)  # the long poll holds the turn, its Poll parked at the coordinator
            short = await asyncio.wait_for(consumer.poll(max_records=10, timeout=0.1), 4.0)
            long_was_waiting = not long_poll.done()
            with Producer(broker.url) as producer:
                producer.produce("turn-timeout", [b"late"], partition=0)
            got = await asyncio.wait_for(long_poll, 10)
            again = await consumer.poll(max_records=10, timeout=0.1)  # the lock was given back
            return short, long_was_waiting, [r.value for r in got], again
        finally:
            await consumer.close()

    short, long_was_waiting, got, again = asyncio.run(main())
    assert short == [] and long_was_waiting
    assert got == [b"late"] and again == []


def test_calls_given_up_on_while_the_coordinator_hung_and_died_are_forgotten(broker):
    """A call cancelled by its caller (asyncio.wait_for) must not leave its reply slot
    behind: the coordinator that would have answered is killed, so nothing else ever
    removes it, and an application that bounds its calls leaked one per call."""
    from zbroker.supervisor import wait_ready

    async def main():
        admin = AsyncAdmin(broker.url)
        await admin.status()  # connected
        try:
            with paused(broker, "coordinator"):
                for _ in range(5):
                    await give_up_after(admin.status(), 0.1)  # sent, never answered
                broker.kill("coordinator", signal.SIGKILL)
            for _ in range(5):  # while it restarts: given up on while sent, or while waiting to be sent
                await give_up_after(admin.status(), 0.05)
            wait_ready(broker.url)
            await admin.status()  # and the connection works again
            return len(admin.conn.waiting)
        finally:
            await admin.close()

    assert asyncio.run(main()) == 0


def test_a_call_pending_when_the_client_closes_fails_with_an_error_not_a_cancellation(broker):
    """Another task's request still waiting when close() runs must fail with a
    ZBrokerError. A CancelledError in a task nobody cancelled is taken for a
    cancellation: a TaskGroup drops such a task silently, and awaiting it
    cancels the awaiting task in turn."""
    async def main():
        admin = AsyncAdmin(broker.url)
        await admin.status()
        with paused(broker, "coordinator"):
            pending = asyncio.ensure_future(admin.status())
            await asyncio.sleep(0.2)  # sent; the reply cannot come
            await admin.close()
            await asyncio.wait([pending], timeout=5)
        if not pending.done():
            pending.cancel()
            return "still waiting"
        return "cancelled" if pending.cancelled() else pending.exception()

    error = asyncio.run(main())
    assert isinstance(error, ZBrokerError) and "closed" in error.message, error


def test_every_flush_waiting_for_a_failed_batch_raises(broker):
    """Two tasks flushing one producer wait for the same batches: a batch that
    fails must be raised to both. Before, the first to wake took the error and the
    other returned, telling its caller that its records were acknowledged."""
    with Admin(broker.url) as admin:
        admin.create_topic("t", partitions=1)

    async def main():
        producer = AsyncProducer(broker.url, linger_ms=60_000, retries=0, request_timeout=0.5)
        await producer.conn.refresh(["t"])
        handles = [await producer.send("t", b"from task %d" % i, partition=0) for i in range(2)]  # one batch

        async def flush() -> str:
            try:
                await producer.flush()
            except ZBrokerError as err:
                return err.code.value
            return "returned"

        with paused(broker):  # no retries: the batch fails
            outcomes = await asyncio.gather(flush(), flush())
        await producer.close()
        return outcomes, [h.offset for h in handles]

    outcomes, offsets = asyncio.run(main())
    assert offsets == [None, None]  # neither record was acknowledged...
    assert "returned" not in outcomes  # ...so neither flush may say they were


def test_a_second_close_waits_for_the_first_one_to_deliver(broker):
    """close() from a shutdown hook while another task's `async with` closes too:
    the second call returned at once, and a caller that exits after it loses the
    records the first close is still delivering."""
    with Admin(broker.url) as admin:
        admin.create_topic("t", partitions=1)

    async def main():
        producer = AsyncProducer(broker.url, linger_ms=60_000)
        await producer.conn.refresh(["t"])
        handles = [await producer.send("t", b"v%d" % i, partition=0) for i in range(3)]
        with paused(broker):  # the first close's flush waits for the actor
            first = asyncio.ensure_future(producer.close())
            await asyncio.sleep(0.1)
            second = asyncio.ensure_future(producer.close())
            await asyncio.sleep(0.3)
            second_returned_early = second.done()
        await asyncio.wait_for(asyncio.gather(first, second), 30)
        return second_returned_early, [h.offset for h in handles]

    second_returned_early, offsets = asyncio.run(main())
    assert not second_returned_early
    assert offsets == [0, 1, 2]
