"""Ahead leases on real processes (Consumer(lease_ahead=True), Poll.ahead).

An exclusive member with nothing to lease holds the partition's next offsets
before they exist and hands records out as its parked fetch brings them. These
tests check what arrives, how often and what is committed, never speed.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from tests.integration.test_consumer_groups import drain, produce_values, wait_committed
from tests.integration.test_consumer_pipelining import log_ends, wait_for
from zbroker.client import Admin, Consumer, Producer

pytestmark = pytest.mark.processes


def trickle(url: str, topic: str, values: list[bytes], gap_s: float) -> threading.Thread:
    """Produce one record at a time, `gap_s` apart, from a thread."""
    def run() -> None:
        with Producer(url, linger_ms=0) as producer:
            for v in values:
                producer.send(topic, v)
                producer.flush()
                time.sleep(gap_s)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_trickle_arrives_exactly_once_under_ahead_leases_and_is_committed(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("drip", partitions=2)
    with Consumer(broker.url, group="ahead", topics=["drip"], lease_ahead=True) as consumer:
        assert consumer.poll(max_records=50, timeout=0.3) == []  # empty topic: ahead leases granted
        with Admin(broker.url) as admin:
            parts = admin.describe_group("ahead")["partitions"]
        assert all(p["ahead"] is not None and p["ahead"]["start"] == 0 for p in parts)
        values = [f"d-{i}".encode() for i in range(300)]
        producer = trickle(broker.url, "drip", values, gap_s=0.002)
        got = drain(consumer, len(values), timeout=30, max_records=50)
        producer.join(10)
        extra = consumer.poll(max_records=50, timeout=0.3)
        fetches = consumer.ahead.stats["fetches"]
    assert extra == []
    # The read-ahead's fetch follows the log end (Fetch.follow): one fetch brings many
    # appends, instead of one fetch sent again per record.
    assert fetches < len(values) // 4, fetches
    counts = Counter(r.value for r in got)
    assert set(counts) == set(values) and max(counts.values()) == 1
    assert all(r.attempt == 1 and r.reason == "new" for r in got)
    with Admin(broker.url) as admin:
        wait_committed(admin, "ahead", log_ends(admin, "drip"))


def test_a_backlog_then_a_trickle_and_acks_that_beat_the_log_end_report(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("mixed", partitions=1)
    backlog = [f"b-{i}".encode() for i in range(2000)]
    produce_values(broker.url, "mixed", backlog)
    with Consumer(broker.url, group="mixed", topics=["mixed"], lease_ahead=True, ack_interval_ms=0.0) as consumer:
        got = drain(consumer, len(backlog), timeout=30, max_records=300)  # ordinary leases first
        later = [f"l-{i}".encode() for i in range(200)]
        producer = trickle(broker.url, "mixed", later, gap_s=0.001)
        got += drain(consumer, len(later), timeout=30, max_records=300)
        producer.join(10)
        stale = consumer.stats["stale"]
    assert stale == 0, "an ack under an ahead lease was refused"
    assert Counter(r.value for r in got) == Counter(backlog + later)
    with Admin(broker.url) as admin:
        wait_committed(admin, "mixed", {("mixed", 0): 2200})


def test_a_consumer_that_closes_holding_an_ahead_lease_loses_nothing(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("handover", partitions=1)
    first = Consumer(broker.url, group="h", topics=["handover"], lease_ahead=True)
    try:
        assert first.poll(max_records=100, timeout=0.3) == []
        values = [f"h-{i}".encode() for i in range(50)]
        produce_values(broker.url, "handover", values)
        taken = drain(first, 20, timeout=10, max_records=20, ack=False)  # handed out, never acked
        assert len(taken) >= 20
    finally:
        first.close()  # leaves: a new generation ends the ahead lease, the leases come back
    with Consumer(broker.url, group="h", topics=["handover"], lease_ahead=True) as second:
        got = drain(second, len(values), timeout=30, max_records=100)
    assert Counter(r.value for r in got) == Counter(values)
    assert {r.reason for r in got if r.value in {t.value for t in taken}} <= {"rebalance", "new"}
    with Admin(broker.url) as admin:
        wait_committed(admin, "h", {("handover", 0): 50})


def test_a_reset_ends_the_ahead_lease_and_the_consumer_follows_the_new_position(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("rewind", partitions=1)
        produce_values(broker.url, "rewind", [f"r-{i}".encode() for i in range(10)])
        with Consumer(broker.url, group="rw", topics=["rewind"], lease_ahead=True) as consumer:
            assert len(drain(consumer, 10, timeout=10, max_records=100)) == 10
            assert consumer.poll(max_records=100, timeout=0.3) == []  # now holds an ahead lease
            wait_for(lambda: admin.describe_group("rw")["partitions"][0]["ahead"] is not None, 5, "an ahead lease")
            admin.reset_group("rw", "rewind", "earliest")
            assert admin.describe_group("rw")["partitions"][0]["ahead"] is None
            again = drain(consumer, 10, timeout=15, max_records=100)
    assert sorted(r.offset for r in again) == list(range(10))


def test_a_burst_past_a_small_ahead_lease_is_handed_out_whole_and_in_order(broker):
    # The ahead lease covers 10 offsets; a burst of 300 fills it at once and the
    # coordinator leases the rest the ordinary way, possibly before this consumer has
    # handed out all of the ahead lease. Nothing may be left behind to expire (that
    # would take the 30 s ack timeout, far past this drain's 15 s).
    with Admin(broker.url) as admin:
        admin.create_topic("burst", partitions=1)
    with Consumer(broker.url, group="b", topics=["burst"], lease_ahead=True) as consumer:
        for _round in range(3):
            assert consumer.poll(max_records=10, timeout=0.2) == []  # holds an ahead lease of 10
            values = [f"x-{_round}-{i}".encode() for i in range(300)]
            produce_values(broker.url, "burst", values)
            got = drain(consumer, len(values), timeout=15, max_records=10)
            assert Counter(r.value for r in got) == Counter(values), "records were left behind"
            assert all(r.attempt == 1 for r in got)
            assert [r.offset for r in got] == sorted(r.offset for r in got), "handed out out of order"


def test_a_fast_trickle_leaves_nothing_behind(broker):
    # One record per request from another process, faster than one poll each: an ahead
    # lease fills before the consumer has handed all of it out, and the next records come
    # as an ordinary lease, sometimes before the fetch that brings the ahead lease's tail.
    # Read-ahead keeps one position per partition, so that tail must go first; a tail
    # left behind would only come back after the 30 s ack timeout.
    with Admin(broker.url) as admin:
        admin.create_topic("fast", partitions=1)
    count = 15_000
    with Consumer(broker.url, group="f", topics=["fast"], lease_ahead=True) as consumer:
        assert consumer.poll(max_records=1000, timeout=0.2) == []
        publisher = subprocess.Popen([sys.executable, "-c", PACED_PUBLISHER, broker.url, "fast", str(count)])
        try:
            got = drain(consumer, count, timeout=25, max_records=1000)
        finally:
            publisher.wait(30)
    assert publisher.returncode == 0
    offsets = Counter(r.offset for r in got)
    assert set(offsets) == set(range(count)), f"left behind: {sorted(set(range(count)) - set(offsets))[:10]}"
    assert all(r.attempt == 1 for r in got)


PACED_PUBLISHER = """
import sys, time
from zbroker.client import Producer
url, topic, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
with Producer(url, linger_ms=0, batch_size=1, max_in_flight_records=1000) as producer:
    start = time.monotonic()
    for i in range(count):
        due = start + i / 5000
        while time.monotonic() < due:
            time.sleep(0.0001)
        producer.send(topic, b"f-%d" % i)
"""
