"""The consumer's ack path: records acked in delivery order fold into ranges per delivery,
any other order goes through the accumulator, and what is sent is exactly what was acked.
The folding and the due times are the core's (hand-driven clock); the sending is the
sync driver's, over a stand-in connection."""

from __future__ import annotations

import itertools
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zbroker.protocol.errors import ShuttingDown, Unavailable
from zbroker.protocol import messages as m
from zbroker.client.consumer_core import ConsumerCore
from zbroker.client.core import ConsumedRecord, MetadataCache
from zbroker.client.sync import Consumer
from zbroker.client.transport import Coordinators, Correlation


class SentAcks:
    """Stands in for the connection: keeps the ranges of every Ack sent, answers nothing."""

    def __init__(self) -> None:
        self.ranges: list[list] = []
        self.correlation = Correlation()
        self._early: dict = self.correlation.early
        self._ids = itertools.count(1)
        self.request_timeout = 5.0
        self.url = "inproc://coordinator"
        self.coordinators = Coordinators(self.url)
        self.metadata = MetadataCache()

    def coordinator(self, msg, timeout=None):
        assert isinstance(msg, m.Join)
        return m.JoinReply(member_id="m", generation=1, mode="shared", assignment=[], ack_timeout_ms=30000)

    def close(self):
        pass

    def send(self, endpoint, msg, frames=()):
        self.ranges.extend(msg.ranges)
        return next(self._ids)

    def recv_nowait_all(self):
        return []

    def collect(self):
        pass


def bare_consumer(ack_batch: int, conn=None) -> Consumer:
    """A sync Consumer over a stand-in connection (joined as member m, generation 1)."""
    return Consumer("inproc://coordinator", group="g", topics=["t"], ack_batch=ack_batch, heartbeat=False,
                    read_ahead=False, conn=conn if conn is not None else SentAcks())


class CoreDriver:
    """Drives a ConsumerCore by hand, as a driver does: asks `acks_due` when `ack` says to."""

    def __init__(self, ack_batch: int, ack_interval_s: float = 3600.0) -> None:
        self.core = ConsumerCore(group="g", topics=["t"], ack_batch=ack_batch, ack_interval_s=ack_interval_s)
        self.ranges: list[list] = []
        self.now = 100.0

    def ack(self, record) -> None:
        if self.core.ack(record) and self.core.acks_due(self.now):
            self.flush()

    def flush_if_due(self) -> None:
        if self.core.acks_due(self.now):
            self.flush()

    def flush(self) -> None:
        self.ranges.extend(self.core.take_acks())


def deliveries_strategy():
    # (partition, lease, first offset, count): like one poll's deliveries
    return st.lists(st.tuples(st.integers(0, 2), st.integers(1, 3), st.integers(0, 500), st.integers(0, 40)),
                    min_size=1, max_size=4)


def records_of(deliveries) -> tuple[list, list[int]]:
    out, sizes = [], []
    for partition, lease, first, count in deliveries:
        sizes.append(count)
        out += [ConsumedRecord("t", partition, first + i, 0, None, b"", None, lease, 1, "new")
                for i in range(count)]
    return out, sizes


def acked_set(ranges) -> list:
    return sorted((t, p, lease, o) for t, p, lease, lo, hi in ranges for o in range(lo, hi))


@settings(max_examples=300, deadline=None)
@given(st.lists(deliveries_strategy(), min_size=1, max_size=3), st.integers(1, 200), st.data())
def test_exactly_the_acked_records_are_sent(polls, ack_batch, data):
    driver = CoreDriver(ack_batch)
    acked = []
    for deliveries in polls:
        records, sizes = records_of(deliveries)
        driver.core.deliver(records, sizes)
        # Mostly in order, with skips, repeats of nothing, and some out-of-order acks.
        order = list(range(len(records)))
        if data.draw(st.booleans()):
            order = data.draw(st.permutations(order))
        chosen = [i for i in order if data.draw(st.integers(0, 9)) > 1]
        for n, i in enumerate(chosen):
            driver.ack(records[i])
            acked.append(records[i])
            if data.draw(st.integers(0, 30)) == 0:
                driver.flush()
    driver.flush()
    expected = sorted((r.topic, r.partition, r.lease_id, r.offset) for r in acked)
    assert acked_set(driver.ranges) == expected


def test_in_order_acks_of_a_poll_become_one_range_per_delivery():
    driver = CoreDriver(ack_batch=10_000)
    records, sizes = records_of([(0, 7, 100, 50), (1, 8, 0, 30)])
    driver.core.deliver(records, sizes)
    for r in records:
        driver.ack(r)
    driver.flush()
    assert driver.ranges == [["t", 0, 7, 100, 150], ["t", 1, 8, 0, 30]]


def test_the_sync_driver_sends_what_the_core_folded():
    consumer = bare_consumer(ack_batch=10_000)
    records, sizes = records_of([(0, 7, 100, 50), (1, 8, 0, 30)])
    consumer.core.held = [records[:50], records[50:]]
    assert consumer.core.hand_out(1000) == records
    for r in records:
        consumer.ack(r)
    consumer.flush_acks(wait=False)
    assert consumer.conn.ranges == [["t", 0, 7, 100, 150], ["t", 1, 8, 0, 30]]


def test_ack_batch_sends_acks_while_the_caller_is_still_acking():
    driver = CoreDriver(ack_batch=100)
    records, sizes = records_of([(0, 7, 0, 300)])
    driver.core.deliver(records, sizes)
    for r in records[:200]:
        driver.ack(r)
    assert acked_set(driver.ranges) == [("t", 0, 7, o) for o in range(128)]  # checked every 64


def test_held_acks_are_due_at_their_interval_even_after_a_flush_mid_batch():
    # With poll_ahead a poll does not send acks; they must still leave within the
    # interval. In-order acks after a flush in the middle of a batch do not pass the
    # "first ack" check, so the due time starts when the poll looks at them.
    driver = CoreDriver(ack_batch=1000, ack_interval_s=0.005)
    core = driver.core
    assert core.acks_due_at(driver.now) is None  # nothing held, nothing due
    records, sizes = records_of([(0, 7, 0, 10)])
    core.deliver(records, sizes)
    assert core.ack(records[0]) is True  # the first in-order ack: the driver asks
    assert core.acks_due_at(100.0) == 100.005
    driver.flush_if_due()
    assert driver.ranges == []  # not due yet: held
    driver.now = 100.006
    driver.flush_if_due()
    assert driver.ranges == [["t", 0, 7, 0, 1]]
    assert core.ack(records[1]) is False  # in order, not the first of the batch: no clock read
    driver.now = 100.010
    assert core.acks_due_at(driver.now) == 100.015  # the interval starts now, not never
    driver.now = 100.016
    driver.flush_if_due()
    assert driver.ranges == [["t", 0, 7, 0, 1], ["t", 0, 7, 1, 2]]


def test_a_full_ack_batch_is_due_at_once():
    driver = CoreDriver(ack_batch=100)
    records, sizes = records_of([(0, 7, 0, 150)])
    driver.core.deliver(records, sizes)
    for r in records[:100]:
        driver.ack(r)  # ack() itself looks only at the 1st and every 64th
    assert driver.ranges == []
    driver.flush_if_due()
    assert acked_set(driver.ranges) == [("t", 0, 7, o) for o in range(100)]


class RefusingConnection(SentAcks):
    """The coordinator is unreachable: every send fails."""

    def send(self, endpoint, msg, frames=()):
        raise Unavailable("no route to the coordinator")


def test_acks_that_could_not_be_sent_are_held_again():
    conn = RefusingConnection()
    consumer = bare_consumer(ack_batch=1000, conn=conn)
    records, sizes = records_of([(0, 7, 0, 10)])
    consumer.core.held = [records]
    consumer.core.hand_out(100)
    for r in records:
        consumer.ack(r)
    with pytest.raises(Unavailable):
        consumer.flush_acks(wait=False)
    conn.send = SentAcks.send.__get__(conn)  # the coordinator is back
    consumer.flush_acks(wait=False)
    assert acked_set(consumer.conn.ranges) == [("t", 0, 7, o) for o in range(10)]


def test_acks_refused_because_the_coordinator_is_stopping_are_held_again():
    consumer = bare_consumer(ack_batch=1000)
    env = types.SimpleNamespace(error=ShuttingDown("stopping"), msg=None)
    with pytest.raises(ShuttingDown):
        consumer._run(consumer.flow.ack_replied(env, [["t", 0, 7, 0, 5]], [["t", 0, 6, 0, 2]]))
    consumer.flush_acks(wait=False)
    assert acked_set(consumer.conn.ranges) == [("t", 0, 6, 0), ("t", 0, 6, 1)] + [("t", 0, 7, o) for o in range(5)]
