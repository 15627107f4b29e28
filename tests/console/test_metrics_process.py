"""/metrics of a real broker, parsed with prometheus_client, against `groups describe`."""

from __future__ import annotations

import pytest

from tests.console.conftest import eventually, labels
from zbroker.client import Admin, Consumer, Producer

pytestmark = pytest.mark.processes


def _produce(url: str, topic: str, n: int, start: int = 0) -> None:
    producer = Producer(url)
    try:
        for i in range(start, start + n):
            producer.send(topic, value=b"v%d" % i, key=b"k%d" % i)
        producer.flush()
    finally:
        producer.close()


def _lag_matches(admin: Admin, console, group: str) -> bool | tuple:
    described = {(p["topic"], p["partition"]): p["lag"] for p in admin.describe_group(group)["partitions"]}
    scraped = console.samples()
    shown = {k: scraped.get(("zbroker_group_lag", labels(group=group, topic=k[0], partition=k[1]))) for k in described}
    return described == shown or (described, shown)


def test_group_lag_equals_describe_with_and_without_live_members(console_broker):
    broker, console = console_broker
    with Admin(broker.url) as admin:
        admin.create_topic("orders", partitions=2)
        _produce(broker.url, "orders", 40)
        consumer = Consumer(broker.url, group="billing", topics=["orders"])
        got = []
        while len(got) < 40:
            got += consumer.poll(max_records=40, timeout=1.0)
        for rec in got[:15]:
            consumer.ack(rec)
        consumer.flush_acks()
        # Lag, in flight and committed settle once the writer made the acks durable.
        eventually(lambda: _lag_matches(admin, console, "billing") is True, what="lag equal with a live member")
        described = admin.describe_group("billing")
        assert sum(p["lag"] for p in described["partitions"]) > 0
        scraped = console.samples()
        for p in described["partitions"]:
            key = labels(group="billing", topic="orders", partition=p["partition"])
            # No committed offset yet (none of the 15 acked records on this partition: a poll takes
            # shares of 32 per partition, so all 15 can come from one) is no sample, and None in
            # describe; a CI run at 6 workers read the sample as missing.
            assert scraped.get(("zbroker_group_committed_offset", key)) == p["committed"]
            assert scraped.get(("zbroker_group_in_flight", key)) == p["in_flight"]
        assert scraped[("zbroker_group_members", labels(group="billing"))] == 1
        consumer.close()
        # No live member: the group's lag is still there, and still describe's.
        eventually(lambda: console.samples().get(("zbroker_group_members", labels(group="billing"))) == 0,
                   what="the member gone from /metrics")
        eventually(lambda: _lag_matches(admin, console, "billing") is True, what="lag equal with no member")
        scraped = console.samples()
        lags = [v for (name, lab), v in scraped.items() if name == "zbroker_group_lag" and ("group", "billing") in lab]
        assert sum(lags) == 25


def test_counters_move_with_produce_redelivery_and_dead_letters(console_broker):
    broker, console = console_broker
    produced = ("zbroker_records_produced_total", labels(topic="jobs"))
    nacked = ("zbroker_redelivered_total", labels(group="workers", reason="nack"))
    rejected = ("zbroker_dead_lettered_total", labels(group="workers", reason="rejected"))
    with Admin(broker.url) as admin:
        admin.create_topic("jobs", partitions=1)
    eventually(lambda: console.samples().get(produced) == 0, what="the topic at 0 produced")
    _produce(broker.url, "jobs", 10)
    eventually(lambda: console.samples().get(produced) == 10, what="10 produced")
    _produce(broker.url, "jobs", 5, start=10)
    eventually(lambda: console.samples().get(produced) == 15, what="15 produced")

    with Consumer(broker.url, group="workers", topics=["jobs"]) as consumer:
        first = []
        while len(first) < 15:
            first += consumer.poll(max_records=15, timeout=1.0)
        assert consumer.nack(first[:4], reason="try later") == 4
        for rec in first[4:14]:
            consumer.ack(rec)
        again = []
        while len(again) < 4:
            again += [r for r in consumer.poll(max_records=10, timeout=1.0)]
        assert all(r.attempt == 2 for r in again)
        eventually(lambda: console.samples().get(nacked) == 4, what="4 redelivered after nack")
        assert consumer.reject(again[:3], reason="bad job") == 3
        for rec in again[3:] + first[14:]:
            consumer.ack(rec)
        consumer.flush_acks()
        eventually(lambda: console.samples().get(rejected) == 3, what="3 dead-lettered as rejected")
        # The dead letters are records produced to jobs.dlq: that topic's counter counts them.
        eventually(lambda: console.samples().get(("zbroker_records_produced_total", labels(topic="jobs.dlq"))) == 3,
                   what="3 records in jobs.dlq")
    with Admin(broker.url) as admin:
        described = admin.describe_group("workers")["partitions"][0]
    assert described["redeliveries_by_reason"] == {"nack": 4}
    assert described["dead_letters_by_reason"] == {"rejected": 3}
    scraped = console.samples()
    assert scraped[("zbroker_commit_flush_seconds_count", frozenset())] >= 1
    assert ("zbroker_commit_pending_keys", frozenset()) in scraped


def test_a_restarted_console_reads_the_same_counters(console_broker):
    """The console counts nothing itself: killed and restarted, it shows what the broker keeps."""
    broker, console = console_broker
    produced = ("zbroker_records_produced_total", labels(topic="events"))
    with Admin(broker.url) as admin:
        admin.create_topic("events", partitions=3)
    _produce(broker.url, "events", 21)
    eventually(lambda: console.samples().get(produced) == 21, what="21 produced")
    old = broker.pids()["console"]
    broker.kill("console")
    eventually(lambda: broker.pids().get("console") not in (None, old), what="the console restarted")
    console.wait_ready()
    assert console.samples()[produced] == 21


def test_bytes_produced_and_the_replication_and_coordinator_figures(console_broker):
    broker, console = console_broker
    with Admin(broker.url) as admin:
        admin.create_topic("sized", partitions=2)
        producer = Producer(broker.url, linger_ms=1)
        for i in range(20):
            producer.send("sized", value=b"x" * 100, partition=i % 2)
        producer.flush()

        def described_bytes():
            parts = admin.describe_topic("sized")["partitions"]
            return sum(p["bytes_appended"] for p in parts) if all(p["log_end"] == 10 for p in parts) else 0
        first = eventually(described_bytes, what="the appends reported")
        assert first >= 20 * 100  # payload bytes: the values and their record framing
        key = ("zbroker_bytes_produced_total", labels(topic="sized"))
        eventually(lambda: console.samples().get(key) == first, what="bytes produced as describe says")

        for _ in range(5):
            producer.send("sized", value=b"y" * 1000, partition=0)
        producer.flush()
        producer.close()
        second = eventually(lambda: (n := sum(p["bytes_appended"] for p in admin.describe_topic("sized")
                                               ["partitions"])) > first and n, what="more bytes reported")
        assert second - first >= 5 * 1000
        eventually(lambda: console.samples().get(key) == second, what="the counter moved")

        scraped = console.samples()
        for p in admin.describe_topic("sized")["partitions"]:
            part = labels(topic="sized", partition=p["partition"])
            assert scraped[("zbroker_partition_leader_epoch", part)] == p["leader_epoch"]
            assert scraped[("zbroker_partition_isr_size", part)] == len(p["isr"])
            assert scraped[("zbroker_partition_under_replicated", part)] == 0
        assert scraped[("zbroker_coordinator_epoch", frozenset())] == 1
