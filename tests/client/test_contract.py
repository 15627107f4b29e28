"""The client contract: one suite, run against the sync driver and the asyncio driver.

As tests/offsets/test_store_contract.py runs one suite over SQLite and PostgreSQL,
each check here runs over both drivers against a real broker. The asyncio driver
is wrapped to the sync interface (`AsyncDriver`: each call runs on its own loop),
so a check cannot tell the drivers apart except by what they do. The last test
shows the suite catching a driver that deviates.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time

import pytest
import zmq
import zmq.auth

from tests.integration.test_consumer_groups import wait_committed
from zbroker.actors.security import keygen
from zbroker.client import Admin, Consumer, Producer
from zbroker.client.aio import AsyncAdmin, AsyncConnection, AsyncConsumer, AsyncProducer
from zbroker.client.keys import ClientKeys
from zbroker.protocol import codec
from zbroker.protocol.errors import NotCoordinator, ZBrokerError

pytestmark = pytest.mark.processes


class SyncDriver:
    name = "sync"

    def __init__(self) -> None:
        self.closers: list = []

    def produce(self, url: str, topic: str, values: list[bytes], partition: int | None = None,
                keys: list[bytes] | None = None, **options) -> list[int]:
        with Producer(url, **{"linger_ms": 1, **options}) as producer:
            records = values if keys is None else list(zip(keys, values))
            return [h.offset for h in producer.produce(topic, records, partition=partition)]

    def admin(self, url: str, call: str, *args, **options):
        with Admin(url, **{k: options.pop(k) for k in ("curve", "request_timeout") if k in options}) as admin:
            return getattr(admin, call)(*args, **options)

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

    def run(self, handler, stop, max_records: int = 100) -> None:
        self.inner.run(handler, max_records=max_records, stop=stop)

    @property
    def assignment(self) -> list:
        return self.inner.assignment

    @property
    def read_ahead_stats(self) -> dict:
        return self.inner.core.ahead.stats

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

    def produce(self, url: str, topic: str, values: list[bytes], partition: int | None = None,
                keys: list[bytes] | None = None, **options) -> list[int]:
        async def go():
            producer = AsyncProducer(url, **{"linger_ms": 1, **options})
            try:
                handles = [await producer.send(topic, v, key=None if keys is None else keys[i], partition=partition)
                           for i, v in enumerate(values)]
                await producer.flush()
                return [h.offset for h in handles]
            finally:
                await producer.close()
        return self.run(go())

    def admin(self, url: str, call: str, *args, **options):
        async def go():
            admin = AsyncAdmin(url, **{k: options.pop(k) for k in ("curve", "request_timeout") if k in options})
            try:
                return await getattr(admin, call)(*args, **options)
            finally:
                await admin.close()
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

    def run(self, handler, stop, max_records: int = 100) -> None:
        self.driver.run(self.inner.run(handler, max_records=max_records, stop=stop))

    @property
    def assignment(self) -> list:
        return self.inner.assignment

    @property
    def read_ahead_stats(self) -> dict:
        return self.inner.core.ahead.stats

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


def check_keyed_records_sent_together_land_once_each_in_their_keys_order(driver, broker) -> None:
    """With a linger longer than the sends, the flush sends the batches of every partition at
    once (`ProducerFlow.send`: one produce_many for the actor): each record lands once, in its
    key's partition, after the records of its key sent before it."""
    with Admin(broker.url) as admin:
        admin.create_topic("c-keys", partitions=4)
    keys = [b"k%d" % (i % 12) for i in range(240)]
    values = [b"%d" % i for i in range(240)]
    offsets = driver.produce(broker.url, "c-keys", values, keys=keys, linger_ms=60_000)
    assert None not in offsets
    consumer = driver.consumer(broker.url, group="g-keys", topics=["c-keys"], heartbeat=False)
    got = poll_until(consumer, len(values))
    assert sorted(r.value for r in got) == sorted(values)  # each once
    partitions = {r.key: set() for r in got}
    for r in got:
        partitions[r.key].add(r.partition)
    assert all(len(p) == 1 for p in partitions.values()) and len({p for ps in partitions.values() for p in ps}) > 1
    for key in partitions:
        in_log = [int(r.value) for r in sorted((r for r in got if r.key == key), key=lambda r: r.offset)]
        assert in_log == sorted(in_log)  # the order it was sent in


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


def check_every_ahead_mode_hands_out_each_record_once_in_order(driver, broker, **mode) -> None:
    """Read-ahead, poll-ahead and lease-ahead change when records are fetched and leased,
    never what is handed out: each record once, in offset order, and committed when acked."""
    topic = "ahead-" + "-".join(sorted(mode)) if mode else "ahead-none"
    with Admin(broker.url) as admin:
        admin.create_topic(topic, partitions=1)
        consumer = driver.consumer(broker.url, group=topic, topics=[topic], heartbeat=False, **mode)
        driver.produce(broker.url, topic, [b"a%d" % i for i in range(50)])
        got = poll_until(consumer, 50)
        # Records produced while the consumer reads ahead (a fetch parked at the log end), or
        # holds an ahead lease, reach it as well.
        driver.produce(broker.url, topic, [b"b%d" % i for i in range(50)])
        got += poll_until(consumer, 50)
        consumer.flush_acks()
        assert [r.offset for r in got] == list(range(100))
        assert [r.value for r in got] == [b"a%d" % i for i in range(50)] + [b"b%d" % i for i in range(50)]
        # The mode is live in this driver: records came from read-ahead fetches, or none were sent.
        if mode.get("read_ahead", True):
            assert consumer.read_ahead_stats["served"] > 0, consumer.read_ahead_stats
        else:
            assert consumer.read_ahead_stats["fetches"] == 0
        wait_committed(admin, topic, {(topic, 0): 100})
        assert consumer.poll(max_records=100, timeout=0.3) == []


AHEAD_MODES = [{"read_ahead": False}, {"read_ahead": True}, {"poll_ahead": True}, {"lease_ahead": True}]


def ahead_mode_check(mode: dict):
    check = functools.partial(check_every_ahead_mode_hands_out_each_record_once_in_order, **mode)
    check.__name__ = "ahead_mode_" + "_".join(f"{k}={v}" for k, v in mode.items())
    return check


def check_run_acks_what_the_handler_returns_and_nacks_what_it_raises(driver, broker) -> None:
    with Admin(broker.url) as admin:
        admin.create_topic("c-run", partitions=1)
        driver.produce(broker.url, "c-run", [b"ok0", b"bad", b"ok1"])
        consumer = driver.consumer(broker.url, group="g-run", topics=["c-run"], heartbeat=False)
        handled: list = []

        def handler(record):
            handled.append((record.value, record.attempt, record.reason))
            if record.value == b"bad" and record.attempt == 1:
                raise ValueError("bad record")

        consumer.run(handler, stop=lambda: (b"bad", 2, "nack:ValueError: bad record") in handled
                     or len(handled) > 20)
        consumer.flush_acks()
        assert handled[:3] == [(b"ok0", 1, "new"), (b"bad", 1, "new"), (b"ok1", 1, "new")]
        assert handled[3:] == [(b"bad", 2, "nack:ValueError: bad record")]
        wait_committed(admin, "g-run", {("c-run", 0): 3})


class NotTheCoordinator:
    """A coordinator that has stepped down: answers every request NOT_COORDINATOR, naming the leader."""

    def __init__(self, leader: str) -> None:
        self.leader, self.answered = leader, 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.url = f"tcp://127.0.0.1:{self._sock.bind_to_random_port('tcp://127.0.0.1')}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            identity, *frames = self._sock.recv_multipart()
            env = codec.decode_request(frames)
            error = NotCoordinator("not the coordinator", leader={"endpoint": self.leader})
            self._sock.send_multipart([identity, *codec.encode_error(env.op, env.corr_id, error)])
            self.answered += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(linger=0)
        self._ctx.term()


def check_a_url_list_follows_not_coordinator_to_the_leader_it_names(driver, broker) -> None:
    stepped_down = NotTheCoordinator(leader=broker.url)
    try:
        urls = f"{stepped_down.url},{broker.url}"
        assert driver.admin(urls, "create_topic", "c-moved", partitions=1)["topic"] == "c-moved"
        driver.produce(urls, "c-moved", [b"x", b"y"])
        consumer = driver.consumer(urls, group="g-moved", topics=["c-moved"], heartbeat=False)
        got = poll_until(consumer, 2)
        consumer.flush_acks()
        assert [r.value for r in got] == [b"x", b"y"]
        assert stepped_down.answered >= 3  # each client asked it first, and was sent on
    finally:
        stepped_down.close()


CHECKS = [check_produced_records_are_consumed_once_in_order_and_committed,
          check_keyed_records_sent_together_land_once_each_in_their_keys_order,
          check_a_nacked_record_comes_back_with_its_reason_and_a_second_attempt,
          check_a_rebalance_calls_back_and_hands_out_only_what_it_still_owns,
          check_run_acks_what_the_handler_returns_and_nacks_what_it_raises,
          check_a_url_list_follows_not_coordinator_to_the_leader_it_names,
          *map(ahead_mode_check, AHEAD_MODES)]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_client_contract(driver, broker, check):
    check(driver, broker)


@pytest.mark.parametrize("driver_class", [SyncDriver, AsyncDriver], ids=["sync", "asyncio"])
def test_client_contract_over_curve(driver_class, start, tmp_path):
    """Every driver takes ``curve=`` keys: allowed in, records through; a stranger is refused."""
    keys = tmp_path / "keys"
    keygen(keys, clients=["app"])
    (keys / "acl.json").write_text(json.dumps({"app": {"produce": "*", "consume": "*", "admin": True}}))
    broker = start(curve_dir=keys)
    app = ClientKeys.load(keys / "server.key", keys / "clients" / "app.key_secret")
    (tmp_path / "rogue").mkdir()
    _public, rogue_secret = zmq.auth.create_certificates(str(tmp_path / "rogue"), "rogue")
    stranger = ClientKeys.load(keys / "server.key", rogue_secret)  # well-formed, never heard of

    def check(d, broker):
        d.admin(broker.url, "create_topic", "secret", partitions=1, curve=app)
        d.produce(broker.url, "secret", [b"s0", b"s1"], curve=app)
        consumer = d.consumer(broker.url, group="g-curve", topics=["secret"], heartbeat=False, curve=app)
        assert [r.value for r in poll_until(consumer, 2)] == [b"s0", b"s1"]
        consumer.flush_acks()
        with pytest.raises(ZBrokerError):
            d.admin(broker.url, "list_topics", curve=stranger, request_timeout=1.0)

    check_with_a_fresh_driver(driver_class, check, broker)


def check_with_a_fresh_driver(driver_class, check, broker) -> None:
    d = driver_class()
    try:
        check(d, broker)
    finally:
        for close in reversed(d.closers):
            close()
        if isinstance(d, AsyncDriver):
            d.shutdown()


def test_the_contract_fails_a_driver_that_does_not_follow_not_coordinator(broker, monkeypatch):
    """A second deliberate difference: the asyncio connection sends coordinator requests to the
    first URL only, as it did before this suite covered it."""
    async def first_url_only(self, msg, timeout=None):
        return (await self.call(self.coordinators.urls[0], msg, timeout=timeout)).msg

    monkeypatch.setattr(AsyncConnection, "coordinator", first_url_only)
    with pytest.raises(NotCoordinator):
        check_with_a_fresh_driver(AsyncDriver, check_a_url_list_follows_not_coordinator_to_the_leader_it_names, broker)


def test_the_contract_fails_a_driver_that_skips_the_rebalance_callbacks(broker, monkeypatch):
    """A deliberate difference in one driver: the asyncio one stops calling on_revoke. The same
    check that passes for both drivers above must fail for it."""
    original = AsyncConsumer._notify

    async def notify_all_but_revoke(self, step):
        if step.callback is not self.flow.on_revoke:
            await original(self, step)

    monkeypatch.setattr(AsyncConsumer, "_notify", notify_all_but_revoke)
    with pytest.raises(AssertionError):
        check_with_a_fresh_driver(AsyncDriver, check_a_rebalance_calls_back_and_hands_out_only_what_it_still_owns,
                                  broker)
