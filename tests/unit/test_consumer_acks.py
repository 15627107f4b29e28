"""The consumer's ack path: records acked in delivery order fold into ranges per delivery,
any other order goes through the accumulator, and what is sent is exactly what was acked."""

from __future__ import annotations

import itertools
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zbroker.protocol.errors import ShuttingDown, Unavailable
from zbroker.client.core import AckAccumulator, ConsumedRecord
from zbroker.client.sync import Consumer


class SentAcks:
    """Stands in for the connection: keeps the ranges of every Ack sent, answers nothing."""

    def __init__(self) -> None:
        self.ranges: list[list] = []
        self._early: dict = {}
        self._ids = itertools.count(1)
        self.request_timeout = 5.0

    def send(self, endpoint, msg, frames=()):
        self.ranges.extend(msg.ranges)
        return next(self._ids)

    def recv_nowait_all(self):
        return []


def bare_consumer(ack_batch: int) -> Consumer:
    consumer = Consumer.__new__(Consumer)
    consumer.conn = SentAcks()
    consumer.conn.url = "inproc://coordinator"
    consumer.group, consumer.member_id, consumer.generation = "g", "m", 1
    consumer.acks = AckAccumulator()
    consumer.ack_batch, consumer.ack_interval_s = ack_batch, 3600.0
    consumer._acks_since = None
    consumer._ack_requests = {}
    consumer._poll_acks = {}
    consumer._delivered, consumer._next, consumer._in_order, consumer._folded = [None], None, 0, 0
    consumer._spans = []
    consumer._ack_check_mask = 63 if ack_batch >= 64 else 0
    return consumer


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
    consumer = bare_consumer(ack_batch)
    acked = []
    for deliveries in polls:
        records, sizes = records_of(deliveries)
        consumer._deliver(records, sizes)
        # Mostly in order, with skips, repeats of nothing, and some out-of-order acks.
        order = list(range(len(records)))
        if data.draw(st.booleans()):
            order = data.draw(st.permutations(order))
        chosen = [i for i in order if data.draw(st.integers(0, 9)) > 1]
        for n, i in enumerate(chosen):
            consumer.ack(records[i])
            acked.append(records[i])
            if data.draw(st.integers(0, 30)) == 0:
                consumer.flush_acks(wait=False)
    consumer.flush_acks(wait=False)
    expected = sorted((r.topic, r.partition, r.lease_id, r.offset) for r in acked)
    assert acked_set(consumer.conn.ranges) == expected


def test_in_order_acks_of_a_poll_become_one_range_per_delivery():
    consumer = bare_consumer(ack_batch=10_000)
    records, sizes = records_of([(0, 7, 100, 50), (1, 8, 0, 30)])
    consumer._deliver(records, sizes)
    for r in records:
        consumer.ack(r)
    consumer.flush_acks(wait=False)
    assert consumer.conn.ranges == [["t", 0, 7, 100, 150], ["t", 1, 8, 0, 30]]


def test_ack_batch_sends_acks_while_the_caller_is_still_acking():
    consumer = bare_consumer(ack_batch=100)
    records, sizes = records_of([(0, 7, 0, 300)])
    consumer._deliver(records, sizes)
    for r in records[:200]:
        consumer.ack(r)
    assert acked_set(consumer.conn.ranges) == [("t", 0, 7, o) for o in range(128)]  # checked every 64


def test_held_acks_are_due_at_their_interval_even_after_a_flush_mid_batch(monkeypatch):
    # With poll_ahead a poll does not send acks; they must still leave within the
    # interval. In-order acks after a flush in the middle of a batch do not pass the
    # "first ack" check, so the due time starts when the poll looks at them.
    clock = [100.0]
    monkeypatch.setattr("zbroker.client.sync.time.monotonic", lambda: clock[0])
    consumer = bare_consumer(ack_batch=1000)
    consumer.ack_interval_s = 0.005
    assert consumer._acks_due_at() is None  # nothing held, nothing due
    records, sizes = records_of([(0, 7, 0, 10)])
    consumer._deliver(records, sizes)
    consumer.ack(records[0])
    assert consumer._acks_due_at() == 100.005
    consumer._flush_acks_if_due()
    assert consumer.conn.ranges == []  # not due yet: held
    clock[0] = 100.006
    consumer._flush_acks_if_due()
    assert consumer.conn.ranges == [["t", 0, 7, 0, 1]]
    consumer.ack(records[1])  # in order, not the first of the batch: no clock read in ack()
    clock[0] = 100.010
    assert consumer._acks_due_at() == 100.015  # the interval starts now, not never
    clock[0] = 100.016
    consumer._flush_acks_if_due()
    assert consumer.conn.ranges == [["t", 0, 7, 0, 1], ["t", 0, 7, 1, 2]]


def test_a_full_ack_batch_is_due_at_once():
    consumer = bare_consumer(ack_batch=100)
    consumer.ack_interval_s = 3600.0
    records, sizes = records_of([(0, 7, 0, 150)])
    consumer._deliver(records, sizes)
    for r in records[:100]:
        consumer.ack(r)  # ack() itself looks only at the 1st and every 64th
    assert consumer.conn.ranges == []
    consumer._flush_acks_if_due()
    assert acked_set(consumer.conn.ranges) == [("t", 0, 7, o) for o in range(100)]


class RefusingConnection(SentAcks):
    """The coordinator is unreachable: every send fails."""

    def send(self, endpoint, msg, frames=()):
        raise Unavailable("no route to the coordinator")


def test_acks_that_could_not_be_sent_are_held_again():
    consumer = bare_consumer(ack_batch=1000)
    consumer.conn = RefusingConnection()
    consumer.conn.url = "inproc://coordinator"
    records, sizes = records_of([(0, 7, 0, 10)])
    consumer._deliver(records, sizes)
    for r in records:
        consumer.ack(r)
    with pytest.raises(Unavailable):
        consumer.flush_acks(wait=False)
    consumer.conn = SentAcks()
    consumer.conn.url = "inproc://coordinator"
    consumer.flush_acks(wait=False)
    assert acked_set(consumer.conn.ranges) == [("t", 0, 7, o) for o in range(10)]


def test_acks_refused_because_the_coordinator_is_stopping_are_held_again():
    consumer = bare_consumer(ack_batch=1000)
    env = types.SimpleNamespace(error=ShuttingDown("stopping"), msg=None)
    with pytest.raises(ShuttingDown):
        consumer._on_ack_reply(env, [["t", 0, 7, 0, 5]], [["t", 0, 6, 0, 2]])
    consumer.flush_acks(wait=False)
    assert acked_set(consumer.conn.ranges) == [("t", 0, 6, 0), ("t", 0, 6, 1)] + [("t", 0, 7, o) for o in range(5)]
