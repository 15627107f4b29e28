"""Consumer groups on real processes: redelivery, dead letters, rebalancing with fencing, restarts."""

from __future__ import annotations

import signal
import time

import pytest

from zbroker.protocol import messages as m
from zbroker.protocol.errors import ErrorCode, Fenced, StaleLease
from zbroker.client import Admin, Consumer, Producer, fetch
from zbroker.client.sync import Connection
from zbroker.supervisor import wait_ready

pytestmark = pytest.mark.processes


def produce_values(url: str, topic: str, values: list[bytes], **kw) -> None:
    with Producer(url, linger_ms=1, **kw) as producer:
        producer.produce(topic, values)


def drain(consumer: Consumer, want: int, timeout: float = 30.0, ack: bool = True,
          max_records: int = 500) -> list:
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        for rec in consumer.poll(max_records=max_records, timeout=0.2):
            got.append(rec)
            if ack:
                consumer.ack(rec)
    consumer.flush_acks()
    return got


def wait_committed(admin: Admin, group: str, expected: dict, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    seen = {}
    while time.monotonic() < deadline:
        seen = {(p["topic"], p["partition"]): p["committed"] for p in admin.describe_group(group)["partitions"]}
        if all(seen.get(k) == v for k, v in expected.items()):
            return seen
        time.sleep(0.05)
    raise AssertionError(f"committed offsets {seen} never reached {expected}")


def test_consume_with_acks_commits_everything(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("jobs", partitions=2)
    values = [f"job-{i}".encode() for i in range(2000)]
    produce_values(broker.url, "jobs", values)
    with Consumer(broker.url, group="workers", topics=["jobs"]) as consumer:
        got = drain(consumer, 2000)
    assert sorted(r.value for r in got) == sorted(values)
    with Admin(broker.url) as admin:
        ends = {("jobs", p["partition"]): p["log_end"] for p in admin.describe_topic("jobs")["partitions"]}
        wait_committed(admin, "workers", ends)
        described = admin.describe_group("workers")
    assert all(p["lag"] == 0 for p in described["partitions"])


@pytest.mark.parametrize("mode", ["exclusive", "shared"])
def test_records_of_a_consumer_that_dies_without_acking_reach_another_member(broker, mode):
    """Exclusive: the dead member's session expires and its partition moves with its records.
    Shared: the live member gets the records as soon as their ack timeout expires."""
    with Admin(broker.url) as admin:
        admin.create_topic("tasks", partitions=1)
        admin.configure_group("crew", ack_timeout_ms=1500, mode=mode)
    produce_values(broker.url, "tasks", [f"t{i}".encode() for i in range(300)])
    session = 2000 if mode == "exclusive" else 60_000
    doomed = Consumer(broker.url, group="crew", topics=["tasks"], session_timeout_ms=session, heartbeat=False)
    taken = drain(doomed, 300, ack=False)
    assert len(taken) == 300
    doomed.conn.close()  # dies: no ack, no leave, no heartbeat
    with Consumer(broker.url, group="crew", topics=["tasks"]) as survivor:
        started = time.monotonic()
        redelivered = drain(survivor, 300, timeout=30)
        elapsed = time.monotonic() - started
    assert sorted(r.offset for r in redelivered) == list(range(300))
    assert all(r.attempt == 2 for r in redelivered)
    assert {r.reason for r in redelivered} <= {"timeout", "rebalance"}
    assert elapsed < 25
    with Admin(broker.url) as admin:
        wait_committed(admin, "crew", {("tasks", 0): 300})


def test_a_poison_record_reaches_the_dlq_while_the_partition_keeps_flowing(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("mail", partitions=1)
        admin.configure_group("senders", max_deliveries=3, ack_timeout_ms=10_000)
    produce_values(broker.url, "mail", [b"ok-0", b"POISON", b"ok-2", b"ok-3"])
    handled, poison_attempts = [], []
    with Consumer(broker.url, group="senders", topics=["mail"]) as consumer:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (len(handled) < 3 or len(poison_attempts) < 3):
            for rec in consumer.poll(max_records=10, timeout=0.2):
                if rec.value == b"POISON":
                    poison_attempts.append(rec.attempt)
                    consumer.nack([rec], reason="cannot parse")
                else:
                    handled.append(rec.value)
                    consumer.ack(rec)
        consumer.flush_acks()
    assert sorted(handled) == [b"ok-0", b"ok-2", b"ok-3"]
    assert poison_attempts == [1, 2, 3]
    conn = Connection(broker.url)
    try:
        deadline = time.monotonic() + 15
        dead = []
        while time.monotonic() < deadline and not dead:
            try:
                dead, _s, _e = fetch(conn, "mail.dlq", 0, 0)
            except Exception:
                conn.metadata.forget("mail.dlq")
                time.sleep(0.1)
        assert [r.value for r in dead] == [b"POISON"]
        headers = dead[0].headers
        assert headers["zb-dlq-source-topic"] == b"mail"
        assert headers["zb-dlq-source-offset"] == b"1"
        assert headers["zb-dlq-attempts"] == b"3"
        assert b"cannot parse" in headers["zb-dlq-reason"]
    finally:
        conn.close()
    with Admin(broker.url) as admin:
        wait_committed(admin, "senders", {("mail", 0): 4})
        part = admin.describe_group("senders")["partitions"][0]
    assert part["dead_letters"] == 1


def test_reject_sends_a_record_to_the_dlq_at_once(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("orders", partitions=1)
    produce_values(broker.url, "orders", [b"fine", b"bad"])
    with Consumer(broker.url, group="g", topics=["orders"]) as consumer:
        recs = drain(consumer, 2, ack=False)
        consumer.ack(recs[0])
        assert consumer.reject([recs[1]], reason="schema violation") == 1
        consumer.flush_acks()
    with Admin(broker.url) as admin:
        wait_committed(admin, "g", {("orders", 0): 2})


def test_a_record_too_large_to_copy_whole_is_dead_lettered_without_its_value(broker):
    """A record that fits max_batch_bytes (8 MiB, also the dead-letter topic's limit) but
    not with the zb-dlq-* headers added: the copy is refused TOO_LARGE, so the DLQ gets
    it without its value and the committed offset passes it (it used to be retried for ever)."""
    with Admin(broker.url) as admin:
        admin.create_topic("blobs", partitions=1)
    big = b"B" * ((8 << 20) - 64)  # the record's own batch fits; with the provenance headers it does not
    with Producer(broker.url, linger_ms=1) as producer:
        producer.send("blobs", big, key=b"blob-key", headers={"h": b"1"})
        producer.flush()
        producer.send("blobs", b"small")
        producer.flush()
    with Consumer(broker.url, group="g", topics=["blobs"]) as consumer:
        recs = drain(consumer, 2, ack=False, max_records=1)
        assert [(r.offset, len(r.value)) for r in recs] == [(0, len(big)), (1, 5)]
        assert consumer.reject([recs[0]], reason="too big to handle") == 1
        consumer.ack(recs[1])
        consumer.flush_acks()
    with Admin(broker.url) as admin:
        wait_committed(admin, "g", {("blobs", 0): 2})
        part = admin.describe_group("g")["partitions"][0]
    assert part["dead_letters"] == 1 and part["dead_lettering"] == 0
    conn = Connection(broker.url)
    try:
        conn.refresh()
        dead, _s, end = fetch(conn, "blobs.dlq", 0, 0)
        assert end == 1 and len(dead) == 1
        copy = dead[0]
        assert copy.value == b"" and copy.key == b"blob-key"
        assert copy.headers["h"] == b"1"  # small original headers are kept
        assert copy.headers["zb-dlq-value-dropped"] == str(len(big)).encode()
        assert copy.headers["zb-dlq-source-topic"] == b"blobs"
        assert copy.headers["zb-dlq-source-partition"] == b"0"
        assert copy.headers["zb-dlq-source-offset"] == b"0"
        assert copy.headers["zb-dlq-group"] == b"g"
        assert b"too big to handle" in copy.headers["zb-dlq-reason"]
    finally:
        conn.close()


def test_a_third_member_moves_partitions_without_loss_and_fencing_stops_stale_acks(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("events", partitions=6)
        # a never acks what it holds on the partitions it keeps: those come back by ack timeout.
        admin.configure_group("team", ack_timeout_ms=2000)
    values = [f"e{i}".encode() for i in range(3000)]
    # 500 on every partition. Key-less, they would stick to a partition per batch (up to
    # 1000 records): often all 3000 on three consecutive partitions, and 1 time in 6 on
    # 3, 4 and 5, where a, which keeps 0-2 when b joins, would have nothing to hold.
    with Producer(broker.url, linger_ms=1) as producer:
        for i, value in enumerate(values):
            producer.send("events", value, partition=i % 6)
        producer.flush()
    a = Consumer(broker.url, group="team", topics=["events"])
    b = Consumer(broker.url, group="team", topics=["events"])
    try:
        a.poll(max_records=1, timeout=0.1)  # a re-syncs to the generation b's join started
        assert len(a.assignment) == 3 and len(b.assignment) == 3
        held_by_a = drain(a, 300, ack=False, timeout=10)
        assert held_by_a
        old_generation = a.generation
        c = Consumer(broker.url, group="team", topics=["events"])
        try:
            # a's acks under the old generation are FENCED, never silently applied.
            with pytest.raises(Fenced):
                a.conn.call(a.conn.url, m.Ack(group="team", member_id=a.member_id, generation=old_generation,
                                              ranges=[[r.topic, r.partition, r.lease_id, r.offset, r.offset + 1]
                                                      for r in held_by_a[:1]]))
            seen: dict[tuple[int, int], bytes] = {}
            deadline = time.monotonic() + 60
            while len(seen) < 3000 and time.monotonic() < deadline:
                for consumer in (a, b, c):
                    for rec in consumer.poll(max_records=300, timeout=0.05):
                        seen[(rec.partition, rec.offset)] = rec.value
                        consumer.ack(rec)
                for consumer in (a, b, c):
                    consumer.flush_acks()
            assert sorted(seen.values()) == sorted(values)
            assert sorted(len(x.assignment) for x in (a, b, c)) == [2, 2, 2]
        finally:
            c.close()
    finally:
        a.close()
        b.close()
    with Admin(broker.url) as admin:
        ends = {("events", p["partition"]): p["log_end"] for p in admin.describe_topic("events")["partitions"]}
        wait_committed(admin, "team", ends)


def test_an_ack_for_an_expired_and_redelivered_lease_is_stale(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("slow", partitions=1)
        admin.configure_group("sloths", ack_timeout_ms=500)
    produce_values(broker.url, "slow", [b"x"])
    with Consumer(broker.url, group="sloths", topics=["slow"]) as first:
        [rec] = drain(first, 1, ack=False)
        time.sleep(0.8)
        [again] = drain(first, 1, ack=False)
        assert again.attempt == 2 and again.lease_id != rec.lease_id
        with pytest.raises(StaleLease) as info:
            first.conn.call(first.conn.url, m.Ack(group="sloths", member_id=first.member_id,
                                                  generation=first.generation,
                                                  ranges=[["slow", 0, rec.lease_id, 0, 1]]))
        assert info.value.data["stale"] == [["slow", 0, rec.lease_id, 0, 1]]
        first.ack(again)
        first.flush_acks()
    with Admin(broker.url) as admin:
        wait_committed(admin, "sloths", {("slow", 0): 1})


def test_the_seed_example_over_the_wire(broker):
    """11 and 13 acked, 12 not: the commit stays at 12; once 12 is acked it moves to 14."""
    with Admin(broker.url) as admin:
        admin.create_topic("seed", partitions=1)
    produce_values(broker.url, "seed", [f"s{i}".encode() for i in range(14)])
    with Consumer(broker.url, group="seed", topics=["seed"]) as consumer, Admin(broker.url) as admin:
        recs = {r.offset: r for r in drain(consumer, 14, ack=False)}
        for off in range(11):
            consumer.ack(recs[off])
        consumer.ack(recs[11])
        consumer.ack(recs[13])
        consumer.flush_acks()
        wait_committed(admin, "seed", {("seed", 0): 12})
        time.sleep(0.3)
        assert admin.describe_group("seed")["partitions"][0]["committed"] == 12
        blocker = admin.describe_group("seed")["partitions"][0]["blocker"]
        assert blocker["offset"] == 12 and blocker["state"] == "leased"
        consumer.ack(recs[12])
        consumer.flush_acks()
        wait_committed(admin, "seed", {("seed", 0): 14})


def test_coordinator_restart_keeps_commits_and_ack_holes(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("durable", partitions=1)
    produce_values(broker.url, "durable", [f"d{i}".encode() for i in range(100)])
    with Consumer(broker.url, group="keepers", topics=["durable"]) as consumer, Admin(broker.url) as admin:
        recs = drain(consumer, 100, ack=False)
        for r in recs:
            if r.offset < 40 or r.offset >= 60:
                consumer.ack(r)  # 40..59 stay unfinished: a hole
        consumer.flush_acks()
        wait_committed(admin, "keepers", {("durable", 0): 40})
        time.sleep(0.3)  # let the holes' advance reach the writer
    broker.kill("coordinator", signal.SIGKILL)
    wait_ready(broker.url)
    with Admin(broker.url) as admin:
        assert admin.describe_group("keepers")["partitions"][0]["committed"] == 40
    with Consumer(broker.url, group="keepers", topics=["durable"]) as consumer:
        again = drain(consumer, 20, timeout=20)
        extra = consumer.poll(max_records=100, timeout=0.5)
    assert sorted(r.offset for r in again) == list(range(40, 60))  # acked 60..99 not redelivered
    assert extra == []
    assert {r.reason for r in again} == {"restart"}
    with Admin(broker.url) as admin:
        wait_committed(admin, "keepers", {("durable", 0): 100})


def test_group_reset_moves_the_committed_offset(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("replay", partitions=1)
        produce_values(broker.url, "replay", [b"a", b"b", b"c"])
        with Consumer(broker.url, group="r", topics=["replay"]) as consumer:
            drain(consumer, 3)
        wait_committed(admin, "r", {("replay", 0): 3})
        result = admin.reset_group("r", "replay", "earliest")
        assert result["partitions"] == [[0, 0]]
        wait_committed(admin, "r", {("replay", 0): 0})
        with Consumer(broker.url, group="r", topics=["replay"]) as consumer:
            assert sorted(r.value for r in drain(consumer, 3)) == [b"a", b"b", b"c"]
        assert ErrorCode.STALE_LEASE.value == "STALE_LEASE"
