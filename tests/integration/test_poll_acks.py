"""Acks riding on polls (Poll.acks) through the real client and processes.

A consumer that polls ahead sends the acks it holds with its next poll: one
message instead of two. These tests check what must stay true: every ack is
applied exactly where an `ack` would have been, a poll that is fenced applies
none of its acks and the consumer sends them again, and `flush_acks()` returns
only once the acks riding on a poll still waiting at the coordinator are applied.
"""

from __future__ import annotations

from collections import Counter

import pytest

from zbroker.protocol import messages as m
from tests.integration.test_consumer_groups import produce_values, wait_committed
from zbroker.client import Admin, Consumer

pytestmark = pytest.mark.processes


def count_sends(consumer: Consumer) -> Counter:
    """Count what the consumer sends: message types, and the polls that carried acks."""
    sent: Counter = Counter()
    send = consumer.conn.send

    def counting(endpoint, msg, frames=(), **options):
        sent[type(msg).__name__] += 1
        if isinstance(msg, m.Poll) and msg.acks:
            sent["poll_with_acks"] += 1
        return send(endpoint, msg, frames, **options)

    consumer.conn.send = counting
    return sent


def test_acks_ride_on_polls_and_flush_waits_until_those_on_a_waiting_poll_are_applied(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("ride", partitions=1)
        values = [f"r-{i}".encode() for i in range(3000)]
        produce_values(broker.url, "ride", values)
        # A long ack interval: only a poll or a full ack batch may take the acks.
        consumer = Consumer(broker.url, group="ride", topics=["ride"], poll_ahead=True, ack_interval_ms=60_000)
        try:
            sent = count_sends(consumer)
            got = []
            while len(got) < len(values):
                batch = consumer.poll(max_records=500, timeout=1.0)
                for record in batch:
                    consumer.ack(record)
                got.extend(batch)
            assert sorted(r.value for r in got) == sorted(values)
            assert sent["Ack"] == 0, "acks went on their own although a poll could take them"
            assert sent["poll_with_acks"] >= 4
            # The poll sent ahead finds nothing and waits; the next one carries the last batch's acks.
            assert consumer.poll(max_records=500, timeout=1.5) == []
            assert consumer.flow.poll_in_flight.acks, "the last acks should be riding on the waiting poll"
            consumer.flush_acks(wait=True)
            # Applied by now (in the coordinator's memory); durable a flush of the writer later.
            applied = {(p["topic"], p["partition"]): p["committed_pending"]
                       for p in admin.describe_group("ride")["partitions"]}
            assert applied == {("ride", 0): 3000}
            wait_committed(admin, "ride", {("ride", 0): 3000}, timeout=10.0)
            assert consumer.stats["stale"] == 0
        finally:
            consumer.close()


def test_the_acks_of_a_fenced_poll_are_sent_again_after_the_rejoin(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("fence", partitions=1)
        produce_values(broker.url, "fence", [f"f-{i}".encode() for i in range(1000)])
        a = Consumer(broker.url, group="fence", topics=["fence"], poll_ahead=True, ack_interval_ms=60_000)
        b = None
        try:
            sent = count_sends(a)
            first = a.poll(max_records=500, timeout=2.0)  # the poll sent ahead leases 500..999 now
            assert [r.offset for r in first] == list(range(500))
            for record in first:
                a.ack(record)
            # A second member: a new generation. `a` keeps the only partition, and its leases.
            b = Consumer(broker.url, group="fence", topics=["fence"], poll_ahead=True)
            second = a.poll(max_records=500, timeout=2.0)  # sends the next poll with 0..499's acks: fenced
            assert [r.offset for r in second] == list(range(500, 1000))
            for record in second:
                a.ack(record)
            assert a.poll(max_records=500, timeout=0.5) == []  # fenced: re-join, the acks go again
            a.flush_acks(wait=True)
            wait_committed(admin, "fence", {("fence", 0): 1000}, timeout=10.0)
            assert a.stats["rejoins"] >= 1 and a.stats["stale"] == 0
            assert sent["poll_with_acks"] >= 2
        finally:
            a.close()
            if b is not None:
                b.close()


def test_more_ranges_than_one_header_holds_go_in_several_requests(broker):
    """Every other record acked, then the rest nacked: 5,000 ranges each way. One request
    with all of them would pass the 1 MiB header limit, whose TOO_LARGE reply has no id
    to match: the call would time out instead of being applied."""
    topic = "many-ranges-" + "t" * 188  # 200 characters, the longest name: about 235 bytes per range
    with Admin(broker.url) as admin:
        admin.create_topic(topic, partitions=1)
    values = [f"m-{i}".encode() for i in range(10_000)]
    produce_values(broker.url, topic, values)
    consumer = Consumer(broker.url, group="many-ranges", topics=[topic], ack_batch=1_000_000,
                        ack_interval_ms=60_000, max_in_flight=20_000, request_timeout=5.0)
    try:
        got = []
        while len(got) < len(values):
            got.extend(consumer.poll(max_records=10_000, timeout=1.0))
        sent = count_sends(consumer)
        for record in got[::2]:
            consumer.ack(record)
        consumer.flush_acks(wait=True)
        assert consumer.stats["acked"] == 5_000
        assert sent["Ack"] >= 2
        assert consumer.nack(got[1::2]) == 5_000
        assert sent["Nack"] >= 2
    finally:
        consumer.close()


def test_a_nack_split_over_several_requests_applies_every_chunk_when_one_range_is_stale(broker):
    """The coordinator applies a request's valid ranges and answers STALE_LEASE for the
    rest: the first chunk's STALE_LEASE must not keep the later chunks from being sent.
    Both consumers: ack offset 0, then nack the even offsets (4001 ranges, two requests,
    the first range stale): 4000 applied, offset 8000 among them, one STALE_LEASE."""
    import asyncio

    from zbroker.protocol.errors import StaleLease
    from zbroker.client.aio import AsyncConsumer

    n = 8002
    with Admin(broker.url) as admin:
        for topic in ("chunks-sync", "chunks-aio"):
            admin.create_topic(topic, partitions=1)
            admin.configure_group(topic, ack_timeout_ms=120_000, max_in_flight=20_000)
    for topic in ("chunks-sync", "chunks-aio"):
        produce_values(broker.url, topic, [b"%d" % i for i in range(n)])

    def refused_as_one(nack_evens) -> None:
        with pytest.raises(StaleLease) as refused:
            nack_evens()
        assert refused.value.data["applied"] == 4000
        assert [r[3:] for r in refused.value.data["stale"]] == [[0, 1]]

    consumer = Consumer(broker.url, group="chunks-sync", topics=["chunks-sync"], read_ahead=False,
                        ack_batch=1_000_000, ack_interval_ms=60_000)
    try:
        got = []
        while len(got) < n:
            got += consumer.poll(max_records=n, timeout=1.0)
        consumer.ack(got[0])
        consumer.flush_acks(wait=True)
        refused_as_one(lambda: consumer.nack([r for r in got if r.offset % 2 == 0]))
    finally:
        consumer.close()

    async def asynchronously() -> None:
        async with AsyncConsumer(broker.url, group="chunks-aio", topics=["chunks-aio"], ack_batch=1_000_000,
                                 ack_interval_ms=60_000) as aconsumer:
            got = []
            while len(got) < n:
                got += await aconsumer.poll(max_records=n, timeout=1.0)
            await aconsumer.ack(got[0])
            await aconsumer.flush_acks()
            with pytest.raises(StaleLease) as refused:
                await aconsumer.nack([r for r in got if r.offset % 2 == 0])
            assert refused.value.data["applied"] == 4000
            assert [r[3:] for r in refused.value.data["stale"]] == [[0, 1]]

    asyncio.run(asynchronously())
