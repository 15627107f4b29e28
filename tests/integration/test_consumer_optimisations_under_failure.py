"""The synchronous Consumer's optimisations against failures: each test compares what a
consumer with read-ahead, poll-ahead or ahead leases gets with what the plain
poll/fetch/ack protocol would give. The ack timeout is long (60 s), so a record whose
lease the client dropped, or whose ack went stale, would show as missing or as a
committed offset that stalls."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter

import pytest

from tests.integration.test_consumer_groups import drain, produce_values, wait_committed
from tests.integration.test_consumer_pipelining import wait_for
from zbroker.client import Admin, Consumer, Producer

pytestmark = pytest.mark.processes


def kill_partition_actor(broker) -> None:
    old = broker.kill("partition-0", signal.SIGKILL)
    wait_for(lambda: broker.pids().get("partition-0") not in (None, old), 20, "the partition actor to restart")


@pytest.mark.parametrize("lease_ahead", [False, True])
def test_records_under_an_ahead_lease_arrive_after_the_partition_actor_is_killed(broker, lease_ahead):
    """The followed fetch of an ahead lease is parked at the actor when it is killed: its
    replies never come. The records produced after the restart must still arrive well
    before the (long) ack timeout, once, as first deliveries: as they do without ahead leases."""
    with Admin(broker.url) as admin:
        admin.create_topic("fragile", partitions=1)
        admin.configure_group("g", ack_timeout_ms=60_000)
    produce_values(broker.url, "fragile", [b"w-0", b"w-1"])
    with Consumer(broker.url, group="g", topics=["fragile"], lease_ahead=lease_ahead,
                  request_timeout=2.0) as consumer:
        assert len(drain(consumer, 2, timeout=10, max_records=100)) == 2
        assert consumer.poll(max_records=100, timeout=0.3) == []  # caught up (lease_ahead: an ahead lease)
        # The next poll parks a read-ahead fetch at the actor for up to 3 s: kill the actor under it.
        killer = threading.Timer(1.0, kill_partition_actor, (broker,))
        killer.start()
        assert consumer.poll(max_records=100, timeout=3.0) == []
        killer.join()
        values = [f"v-{i}".encode() for i in range(5)]
        produce_values(broker.url, "fragile", values, request_timeout=2.0)
        got = drain(consumer, len(values), timeout=20, max_records=100)
    assert Counter(r.value for r in got) == Counter(values)
    assert all(r.attempt == 1 for r in got)
    with Admin(broker.url) as admin:
        wait_committed(admin, "g", {("fragile", 0): 7})


def _two_partitions_of_200(broker, topic: str, group: str) -> list[bytes]:
    """A topic whose two partitions hold 200 records each, and a group with a long ack timeout."""
    with Admin(broker.url) as admin:
        admin.create_topic(topic, partitions=2)
        admin.configure_group(group, ack_timeout_ms=60_000)
    values = [f"{topic}-{i}".encode() for i in range(400)]
    with Producer(broker.url, linger_ms=1) as producer:
        producer.produce(topic, values[:200], partition=0)
        producer.produce(topic, values[200:], partition=1)
    return values


@pytest.fixture
def consumer_of(broker, request):
    """Makes a Consumer on `broker` that is closed at teardown, however the test ends."""
    def make(**options) -> Consumer:
        consumer = Consumer(broker.url, **options)
        request.addfinalizer(consumer.close)
        return consumer
    return make


def _consume_all(a: Consumer, b: Consumer, got: list, total: int, timeout: float = 20.0) -> None:
    """Both members poll and ack in turn until `got` holds `total` distinct records; then both leave."""
    deadline = time.monotonic() + timeout
    while len({r.value for r in got}) < total and time.monotonic() < deadline:
        for consumer in (a, b):
            batch = consumer.poll(max_records=50, timeout=0.1)
            got += batch
            for r in batch:
                consumer.ack(r)
            consumer.flush_acks()
    a.close()
    b.close()


def _assert_all_delivered_and_committed(broker, got: list, values: list, group: str, topic: str) -> None:
    assert set(r.value for r in got) == set(values), f"{len(set(values) - set(r.value for r in got))} missing"
    assert all(r.reason in ("new", "rebalance") for r in got)
    with Admin(broker.url) as admin:  # every ack applied: none waits for the ack timeout
        wait_committed(admin, group, {(topic, 0): 200, (topic, 1): 200})


@pytest.mark.parametrize("poll_ahead", [False, True])
def test_a_rebalance_that_keeps_a_partition_leaves_no_lease_of_it_behind(broker, consumer_of, poll_ahead):
    """A member whose poll sent ahead was answered (its leases granted) and who then learns of a
    rebalance from its heartbeat keeps the partitions those leases are on: their records must
    reach the application now, not when their (long) ack timeout sends them round again."""
    values = _two_partitions_of_200(broker, "kept", "k")
    a = consumer_of(group="k", topics=["kept"], poll_ahead=poll_ahead, session_timeout_ms=1500)
    got: list = []
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        got = a.poll(max_records=50, timeout=0.5)
    for r in got:
        a.ack(r)
    a.flush_acks()
    if poll_ahead:
        assert a.flow.poll_in_flight is not None  # the next 50 are leased to a already
    b = consumer_of(group="k", topics=["kept"], session_timeout_ms=1500)  # a rebalance
    wait_for(lambda: a.flow.needs_rejoin, 5, "a's heartbeat to hear of the rebalance")
    _consume_all(a, b, got, len(values))
    _assert_all_delivered_and_committed(broker, got, values, "k", "kept")


def test_records_held_for_a_smaller_poll_survive_a_rejoin_on_the_partition_kept(broker, consumer_of):
    """A poll sent ahead leased more than the next call asked for: the rest is held for the
    calls after it. A re-join (here: an ack fenced by a rebalance) in between must not drop
    what is held on a partition this member keeps: its lease stands, and dropped it would
    come back only at its (long) ack timeout."""
    values = _two_partitions_of_200(broker, "held", "h")
    a = consumer_of(group="h", topics=["held"], poll_ahead=True, heartbeat=False)
    got: list = []
    deadline = time.monotonic() + 10
    while len(got) < 50 and time.monotonic() < deadline:
        got += a.poll(max_records=50, timeout=0.5)
    got += a.poll(max_records=5, timeout=5.0)  # the poll sent ahead leased 50: 45 are held
    assert len(got) == 55 and a.core.held
    for r in got:
        a.ack(r)
    b = consumer_of(group="h", topics=["held"])  # a rebalance: one partition moves
    a.flush_acks()  # FENCED: a re-joins, and sends them again
    _consume_all(a, b, got, len(values))
    _assert_all_delivered_and_committed(broker, got, values, "h", "held")
