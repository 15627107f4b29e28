"""produce_many and fetch_many on real processes (issue #29): a producer spreading records
over many partitions of one actor sends one request per actor, and a consumer fetches the
leases of one actor together; every record arrives once."""

from __future__ import annotations

import pytest

from zbroker.client import Admin, Consumer, Producer
from zbroker.protocol import messages as m

pytestmark = pytest.mark.processes

PARTITIONS = 16


def actor_counters(admin: Admin, topic: str) -> dict:
    endpoint = admin.conn.endpoint(topic, 0)
    return admin.conn.call(endpoint, m.Status()).msg.actors[0]["counters"]


def test_round_robin_over_many_partitions_travels_in_produce_many_and_fetch_many(broker):
    admin = Admin(broker.url)
    try:
        admin.create_topic("spread", partitions=PARTITIONS)
        hello = admin.conn.call(admin.conn.endpoint("spread", 0), m.Hello(versions=[1])).msg
        assert "multi_partition" in hello.features
        producer = Producer(broker.url, linger_ms=20, batch_size=500)
        try:
            handles = [producer.send("spread", b"r%d" % i, partition=i % PARTITIONS) for i in range(2000)]
            producer.flush()
        finally:
            producer.close()
        assert all(h.offset is not None for h in handles)
        counters = actor_counters(admin, "spread")
        assert counters["produce_many_requests"] >= 1 and counters["records_appended"] == 2000
        # Fewer requests than batches: the batches that lingered together went together.
        assert counters["produce_many_requests"] < counters["produce_requests"]

        consumer = Consumer(broker.url, group="g", topics=["spread"], read_ahead=False)
        seen: set[bytes] = set()
        try:
            for _ in range(200):
                for record in consumer.poll(max_records=1000, timeout=1.0):
                    assert record.value not in seen
                    seen.add(record.value)
                    consumer.ack(record)
                if len(seen) == 2000:
                    break
            consumer.flush_acks()
        finally:
            consumer.close()
        assert seen == {b"r%d" % i for i in range(2000)}
        assert actor_counters(admin, "spread")["fetch_many_requests"] >= 1
    finally:
        admin.close()
