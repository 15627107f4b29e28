"""The client contract: one suite, run against the sync driver and the asyncio driver.

As tests/offsets/test_store_contract.py runs one suite over SQLite and PostgreSQL,
each check here runs over both drivers against a real broker. The asyncio driver
is wrapped to the sync interface (`AsyncDriver`: each call runs on its own loop),
so a check cannot tell the drivers apart except by what they do. The last test
shows the suite catching a driver that deviates.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.integration.test_consumer_groups import wait_committed
from zbroker.client import Admin, Consumer, Producer
from zbroker.client.aio import AsyncConsumer, AsyncProducer

pytestmark = pytest.mark.processes


class SyncDriver:
    name = "sync"

    def __init__(self) -> None:
        self.closers: list = []

    def produce(self, url: str, topic: str, values: list[bytes], partition: int | None = None) -> list[int]:
        with Producer(url, linger_ms=1) as producer:
            return [h.offset for h in producer.produce(topic, values, partition=partition)]

    def consumer(self, url: str, **options) -> "SyncConsumer":
        c = SyncConsumer(Consumer(url, **options))
        self.closers.append(c.close)
        return c


class SyncConsumer:
    def __init__(self, consumer: Consumer) -> None:
        self.inner = consumer

    def poll(self, max_records: int = 100, timeout: float = 0.2) -> list:
        return self.inner.poll(max_records=max_records, timeout=timeout)

    def ack(self, record) -> None:
        self.inner.ack(record)

    def flush_acks(self) -> None:
        self.inner.flush_acks()

    def nack(self, records, reason: str = "") -> int:
        return self.inner.nack(records, reason=reason)

    @property
    def assignment(self) -> list:
        return self.inner.assignment

    def close(self) -> None:
        self.inner.close()


class AsyncDriver:
    """The asyncio driver behind the sync interface: one loop, each call run to completion on it."""

    name = "asyncio"

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.closers: list = []

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def produce(self, url: str, topic: str, values: list[bytes], partition: int | None = None) -> list[int]:
        async def go():
            producer = AsyncProducer(url, linger_ms=1)
            try:
                handles = [await producer.send(topic, v, partition=partition) for v in values]
                await producer.flush()
                return [h.offset for h in handles]
            finally:
                await producer.close()
        return self.run(go())

    def consumer(self, url: str, **options) -> "AsyncConsumerWrapped":
        options.pop("heartbeat", None)
        c = AsyncConsumerWrapped(self, self.run(AsyncConsumer(url, **options).start()))
        self.closers.append(c.close)
        return c

    def shutdown(self) -> None:
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()


class AsyncConsumerWrapped:
    def __init__(self, driver: AsyncDriver, consumer: AsyncConsumer) -> None:
        self.driver, self.inner = driver, consumer

    def poll(self, max_records: int = 100, timeout: float = 0.2) -> list:
        return self.driver.run(self.inner.poll(max_records=max_records, timeout=timeout))

    def ack(self, record) -> None:
        self.driver.run(self.inner.ack(record))

    def flush_acks(self) -> None:
        self.driver.run(self.inner.flush_acks())

    def nack(self, records, reason: str = "") -> int:
        return self.driver.run(self.inner.nack(records, reason=reason))

    @property
    def assignment(self) -> list:
        return self.inner.assignment

    def close(self) -> None:
        self.driver.run(self.inner.close())


@pytest.fixture(params=[SyncDriver, AsyncDriver], ids=["sync", "asyncio"])
def driver(request, broker):  # closed before the broker stops
    d = request.param()
    yield d
    for close in reversed(d.closers):
        close()
    if isinstance(d, AsyncDriver):
        d.shutdown()


def poll_until(consumer, want: int, timeout: float = 20.0, ack: bool = True) -> list:
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        for r in consumer.poll(max_records=100, timeout=0.2):
            got.append(r)
            if ack:
                consumer.ack(r)
    return got


# -- the checks: each takes a driver and a running broker -------------------------------------------

def check_produced_records_are_consumed_once_in_order_and_committed(driver, broker) -> None:
    with Admin(broker.url) as admin:
        admin.create_topic("c1", partitions=2)
        values = [b"v%d" % i for i in range(300)]
        offsets = driver.produce(broker.url, "c1", values)
        assert all(o is not None for o in offsets)
        consumer = driver.consumer(broker.url, group="g1", topics=["c1"], heartbeat=False)
        got = poll_until(consumer, len(values))
        consumer.flush_acks()
        assert sorted(r.value for r in got) == sorted(values)  # each once
        for p in (0, 1):
            offs = [r.offset for r in got if r.partition == p]
            assert offs == sorted(offs) == list(range(len(offs)))
        ends = {(p, max(r.offset for r in got if r.partition == p) + 1) for p in (0, 1)
                if any(r.partition == p for r in got)}
        wait_committed(admin, "g1", {("c1", p): end for p, end in ends})
        assert consumer.poll(max_records=100, timeout=0.3) == []


def check_a_nacked_record_comes_back_with_its_reason_and_a_second_attempt(driver, broker) -> None:
    with Admin(broker.url) as admin:
        admin.create_topic("c2", partitions=1)
    driver.produce(broker.url, "c2", [b"only"])
    consumer = driver.consumer(broker.url, group="g2", topics=["c2"], heartbeat=False)
    [first] = poll_until(consumer, 1, ack=False)
    assert first.attempt == 1
    assert consumer.nack([first], reason="boom") == 1
    [again] = poll_until(consumer, 1, ack=False)
    assert (again.offset, again.attempt, again.reason) == (first.offset, 2, "nack:boom")
    consumer.ack(again)
    consumer.flush_acks()


def check_a_rebalance_calls_back_and_hands_out_only_what_it_still_owns(driver, broker) -> None:
    with Admin(broker.url) as admin:
        admin.create_topic("c3", partitions=2)
    for p in (0, 1):  # both partitions hold records, whichever moves
        driver.produce(broker.url, "c3", [b"r%d-%d" % (p, i) for i in range(100)], partition=p)
    seen: dict[str, list] = {"assigned": [], "revoked": []}
    a = driver.consumer(broker.url, group="g3", topics=["c3"], heartbeat=False,
                        on_assign=lambda ps: seen["assigned"].append(sorted(map(tuple, ps))),
                        on_revoke=lambda ps: seen["revoked"].append(sorted(map(tuple, ps))))
    assert seen["assigned"] == [[("c3", 0), ("c3", 1)]]
    first = poll_until(a, 2, ack=False)
    for r in first[:-1]:
        a.ack(r)
    a.flush_acks()
    b = driver.consumer(broker.url, group="g3", topics=["c3"], heartbeat=False)  # one partition moves
    a.ack(first[-1])
    a.flush_acks()  # fenced: a re-joins
    assert len(seen["revoked"]) == 1 and len(seen["revoked"][0]) == 1
    owned = {tuple(p) for p in a.assignment}
    assert owned and not owned & set(seen["revoked"][0])
    later = poll_until(a, 1, timeout=3)
    assert all((r.topic, r.partition) in owned for r in later), "handed out a record it no longer owns"
    rest = poll_until(b, 1, timeout=5)
    assert rest and all((r.topic, r.partition) in {tuple(p) for p in b.assignment} for r in rest)
    assert first


CHECKS = [check_produced_records_are_consumed_once_in_order_and_committed,
          check_a_nacked_record_comes_back_with_its_reason_and_a_second_attempt,
          check_a_rebalance_calls_back_and_hands_out_only_what_it_still_owns]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_client_contract(driver, broker, check):
    check(driver, broker)


def test_the_contract_fails_a_driver_that_skips_the_rebalance_callbacks(broker, monkeypatch):
    """A deliberate difference in one driver: the asyncio one stops calling on_revoke. The same
    check that passes for both drivers above must fail for it."""
    original = AsyncConsumer._join

    async def join_without_revoke(self):
        self.on_revoke = None
        await original(self)

    monkeypatch.setattr(AsyncConsumer, "_join", join_without_revoke)
    d = AsyncDriver()
    try:
        with pytest.raises(AssertionError):
            check_a_rebalance_calls_back_and_hands_out_only_what_it_still_owns(d, broker)
    finally:
        for close in reversed(d.closers):
            close()
        d.shutdown()
