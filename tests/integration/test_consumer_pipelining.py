"""Consumer pipelining on real processes: read-ahead (exclusive groups) and poll-ahead.

Read-ahead fetches, before the lease, the records the next lease of an exclusive
group will start at, and serves the lease from those frames. Poll-ahead sends
the next Poll as soon as ``poll()`` returns; a consumer that closes with such a
poll out leaves the group, and the coordinator requeues what it had leased.
Every test checks correctness only (what arrives, how often, what is committed),
never speed, and the bounds are generous.
"""

from __future__ import annotations

import signal
import time
from collections import Counter

import pytest

from tests.integration.test_consumer_groups import drain, produce_values, wait_committed
from zbroker.client import Admin, Consumer, Producer

pytestmark = pytest.mark.processes


def log_ends(admin: Admin, topic: str) -> dict:
    return {(topic, p["partition"]): p["log_end"] for p in admin.describe_topic(topic)["partitions"]}


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def in_flight(admin: Admin, group: str) -> int:
    return sum(p["in_flight"] for p in admin.describe_group(group)["partitions"])


# ------------------------------------------------------------------------------------------


def test_read_ahead_serves_leases_of_an_exclusive_group_exactly_once(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("stream", partitions=2)
    values = [f"v-{i}".encode() for i in range(3000)]
    produce_values(broker.url, "stream", values)

    with Consumer(broker.url, group="ahead", topics=["stream"]) as consumer:
        got = drain(consumer, len(values), max_records=200)
        # Nothing expires (30 s ack timeout): a later poll brings nothing more.
        extra = consumer.poll(max_records=500, timeout=0.3)
        assert consumer.mode == "exclusive"
        assert consumer.read_ahead
        served, fetches = consumer.ahead.stats["served"], consumer.ahead.stats["fetches"]
    assert extra == []
    counts = Counter(r.value for r in got)
    assert set(counts) == set(values), "some values never arrived"
    assert max(counts.values()) == 1, f"duplicates: {[v for v, n in counts.items() if n > 1][:5]}"
    assert len({(r.partition, r.offset) for r in got}) == len(values)
    assert all(r.attempt == 1 for r in got)
    assert fetches > 0, "read-ahead sent no fetch"
    assert served > 0, "read-ahead served no lease"

    with Consumer(broker.url, group="plain", topics=["stream"], read_ahead=False) as plain:
        plain_got = drain(plain, len(values), max_records=200)
        assert plain.ahead.stats == {"served": 0, "fetches": 0}
    assert Counter(r.value for r in plain_got) == counts

    with Admin(broker.url) as admin:
        ends = log_ends(admin, "stream")
        assert sum(ends.values()) == len(values)
        wait_committed(admin, "ahead", ends)
        wait_committed(admin, "plain", ends)


def test_a_consumer_connects_to_the_actors_of_its_partitions_when_it_joins(start):
    broker = start(partition_actors=2)
    with Admin(broker.url) as admin:
        admin.create_topic("spread", partitions=2)
        owners = {p["endpoint"] for p in admin.metadata(["spread"])[0]["partitions"]}
    assert len(owners) == 2, "the two partitions should live on two actors"
    with Consumer(broker.url, group="early", topics=["spread"]) as consumer:
        # Before any poll: the first fetch finds its socket there (no metadata request,
        # no handshake on the poll's path).
        assert owners <= set(consumer.conn.sockets)
        produce_values(broker.url, "spread", [b"a", b"b", b"c", b"d"])
        assert sorted(r.value for r in drain(consumer, 4)) == [b"a", b"b", b"c", b"d"]


def test_a_shared_group_does_no_read_ahead_and_gets_everything(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("fanout", partitions=2)
        admin.configure_group("sharers", mode="shared")
    values = [f"s-{i}".encode() for i in range(1000)]
    produce_values(broker.url, "fanout", values)
    with Consumer(broker.url, group="sharers", topics=["fanout"]) as consumer:
        assert consumer.mode == "shared"
        got = drain(consumer, len(values), max_records=100)
        assert consumer.ahead.stats["fetches"] == 0
        assert consumer.ahead.stats["served"] == 0
    counts = Counter(r.value for r in got)
    assert set(counts) == set(values)
    assert max(counts.values()) == 1
    with Admin(broker.url) as admin:
        wait_committed(admin, "sharers", log_ends(admin, "fanout"))


def test_poll_ahead_drains_everything_exactly_once(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("piped", partitions=2)
    values = [f"p-{i}".encode() for i in range(2000)]
    produce_values(broker.url, "piped", values)
    with Consumer(broker.url, group="pipers", topics=["piped"], poll_ahead=True) as consumer:
        got = drain(consumer, len(values), timeout=20, max_records=150)
        extra = consumer.poll(max_records=150, timeout=0.3)
        extra += consumer.poll(max_records=150, timeout=0.3)
    assert extra == []
    counts = Counter(r.value for r in got)
    assert set(counts) == set(values)
    assert max(counts.values()) == 1
    assert all(r.attempt == 1 for r in got)
    with Admin(broker.url) as admin:
        wait_committed(admin, "pipers", log_ends(admin, "piped"))


@pytest.mark.parametrize("mode", ["exclusive", "shared"])
def test_a_closing_poll_ahead_consumer_hands_its_leased_ahead_records_over_at_once(broker, mode):
    """With a 60 s ack timeout and a 60 s session only the Leave on close can release what the
    poll sent ahead leased."""
    with Admin(broker.url) as admin:
        admin.create_topic("handover", partitions=1)
        admin.configure_group("relay", mode=mode, ack_timeout_ms=60_000)
    values = [f"h-{i}".encode() for i in range(1000)]
    produce_values(broker.url, "handover", values)

    a = Consumer(broker.url, group="relay", topics=["handover"], poll_ahead=True, session_timeout_ms=60_000)
    try:
        first = []
        deadline = time.monotonic() + 15
        while not first and time.monotonic() < deadline:
            first = a.poll(max_records=100, timeout=0.5)
        assert 0 < len(first) <= 100
        for rec in first:
            a.ack(rec)
        a.flush_acks()
        with Admin(broker.url) as admin:
            # The poll sent ahead holds the next lease now: records leased, never handed out.
            wait_for(lambda: in_flight(admin, "relay") > 0, 10, "the poll sent ahead to lease records")
            assert in_flight(admin, "relay") <= 100
    finally:
        a.close()

    with Consumer(broker.url, group="relay", topics=["handover"]) as b:
        started = time.monotonic()
        rest = drain(b, len(values) - len(first), timeout=20, max_records=500)
        elapsed = time.monotonic() - started
        extra = b.poll(max_records=500, timeout=0.3)
    assert extra == []
    assert elapsed < 20
    assert sorted(r.value for r in first + rest) == sorted(values), "lost or duplicated across the hand-over"
    # What a's poll leased ahead came back because a left, well before its ack timeout.
    handed_back = [r for r in rest if r.attempt > 1]
    assert handed_back, "no record leased ahead by a came back to b"
    assert {r.reason for r in handed_back} == {"rebalance"}
    with Admin(broker.url) as admin:
        wait_committed(admin, "relay", {("handover", 0): len(values)})


def test_records_produced_while_a_read_ahead_fetch_is_parked_arrive(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("quiet", partitions=1)
    with Consumer(broker.url, group="waiters", topics=["quiet"]) as consumer:
        assert consumer.poll(max_records=100, timeout=0.3) == []  # an empty topic
        assert consumer.ahead.stats["fetches"] == 0  # no lease yet: nowhere to read ahead from

        # A lease tells the consumer where its next one starts. The poll that returns it sends
        # a read-ahead fetch from there, parked at the actor for up to the poll's timeout (5 s).
        produce_values(broker.url, "quiet", [b"warm-up"])
        warm = []
        deadline = time.monotonic() + 10
        while not warm and time.monotonic() < deadline:
            warm = consumer.poll(max_records=100, timeout=5.0)
        assert [r.value for r in warm] == [b"warm-up"]
        consumer.ack(warm[0])
        assert consumer.ahead.stats["fetches"] == 1

        # Produced while that fetch is parked: the fetch brings them, and serves their lease.
        values = [f"q-{i}".encode() for i in range(10)]
        produce_values(broker.url, "quiet", values)
        got = drain(consumer, 10, timeout=10, max_records=100)
        assert consumer.ahead.stats["served"] > 0, "the parked read-ahead fetch served nothing"
        assert sorted(r.value for r in got) == sorted(values)
        assert sorted(r.offset for r in got) == list(range(1, 11))

        # Idle past the parked fetch's wait (it ends empty): the next poll must park a new one,
        # so what comes after the quiet spell is still brought by read-ahead.
        later = [f"l-{i}".encode() for i in range(10)]
        with Producer(broker.url, linger_ms=0) as producer:
            producer.conn.refresh(["quiet"])  # connected before the quiet spell, so it sends at once
            producer.conn.socket(producer.conn.endpoint("quiet", 0))
            assert consumer.poll(max_records=100, timeout=0.3) == []
            assert consumer.poll(max_records=100, timeout=2.0) == []
            # The fetch parked by that last poll waits up to 2 s: produce within it.
            served_before = consumer.ahead.stats["served"]
            producer.produce("quiet", later)
        got_later = drain(consumer, 10, timeout=10, max_records=100)
        assert consumer.ahead.stats["served"] > served_before, "read-ahead stopped after an idle spell"
        extra = consumer.poll(max_records=100, timeout=0.3)
    assert extra == []
    assert sorted(r.value for r in got_later) == sorted(later)
    assert sorted(r.offset for r in got_later) == list(range(11, 21))
    with Admin(broker.url) as admin:
        wait_committed(admin, "waiters", {("quiet", 0): 21})


def kill_partition_actor(broker) -> None:
    old = broker.kill("partition-0", signal.SIGKILL)
    wait_for(lambda: broker.pids().get("partition-0") not in (None, old), 20, "the partition actor to restart")


def test_read_ahead_survives_sigkills_of_the_partition_actor(broker):
    """Killed once while the consumer holds read-ahead frames it has not been leased yet, and
    once while its read-ahead fetch is parked at the actor: every value still arrives."""
    with Admin(broker.url) as admin:
        admin.create_topic("fragile", partitions=1)
        # Leases whose fetch died with the actor come back by ack timeout: keep it short.
        admin.configure_group("survivors", ack_timeout_ms=2000)
    batches = [[f"{n}-{i}".encode() for i in range(400)] for n in "abc"]
    produce_values(broker.url, "fragile", batches[0])

    seen: Counter = Counter()
    errors: list = []

    def consume_until(want: set, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not want <= set(seen) and time.monotonic() < deadline:
            try:
                # A long timeout: the read-ahead fetch each poll sends stays parked for long.
                for rec in consumer.poll(max_records=50, timeout=3.0):
                    seen[rec.value] += 1
                    consumer.ack(rec)
            except Exception as exc:  # noqa: BLE001  (kept for the failure message)
                errors.append(exc)
                time.sleep(0.1)
        consumer.flush_acks()

    with Consumer(broker.url, group="survivors", topics=["fragile"], request_timeout=2.0) as consumer:
        deadline = time.monotonic() + 15
        while sum(seen.values()) < 100 and time.monotonic() < deadline:
            for rec in consumer.poll(max_records=50, timeout=0.2):
                seen[rec.value] += 1
                consumer.ack(rec)
        consumer.flush_acks()
        assert 100 <= sum(seen.values()) < 400
        assert consumer.ahead.stats["fetches"] > 0  # read-ahead is working before the kill
        assert consumer.ahead.held_bytes() > 0  # ... and holds records not leased yet

        kill_partition_actor(broker)
        produce_values(broker.url, "fragile", batches[1], request_timeout=2.0)  # retries through restarts
        consume_until(set(batches[0]) | set(batches[1]), 60)
        assert set(batches[0]) | set(batches[1]) <= set(seen), f"errors: {errors[:3]}"

        # Caught up: the poll that brought the last records left a read-ahead fetch parked
        # at the actor for up to 3 s; kill the actor under it.
        kill_partition_actor(broker)
        produce_values(broker.url, "fragile", batches[2], request_timeout=2.0)
        want = {v for batch in batches for v in batch}
        consume_until(want, 60)
    missing = want - set(seen)
    assert not missing, f"{len(missing)} values never arrived, e.g. {sorted(missing)[:5]}; errors: {errors[:3]}"
    assert set(seen) == want
    with Admin(broker.url) as admin:
        wait_committed(admin, "survivors", {("fragile", 0): len(want)}, timeout=20)


def test_a_smaller_poll_after_a_poll_ahead_gets_no_more_than_it_asked_for(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("sized", partitions=1)
    values = [f"s-{i}".encode() for i in range(300)]
    produce_values(broker.url, "sized", values)
    got = []
    with Consumer(broker.url, group="sizers", topics=["sized"], poll_ahead=True) as consumer:
        first = consumer.poll(max_records=100, timeout=5.0)
        got += first
        for r in first:
            consumer.ack(r)
        while len(got) < 300:
            batch = consumer.poll(max_records=7, timeout=5.0)
            assert len(batch) <= 7
            got += batch
            for r in batch:
                consumer.ack(r)
    assert [r.value for r in got] == values  # in order, each once
    with Admin(broker.url) as admin:
        wait_committed(admin, "sizers", {("sized", 0): 300})
