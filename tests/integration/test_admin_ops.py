"""Admin operations against a real broker: each op, and each bad input answered with a clear code
that loses nothing."""

from __future__ import annotations

import asyncio

import json
import signal
import time
from contextlib import closing

import pytest

from zbroker.client import Admin, Consumer, Producer, fetch
from zbroker.client.sync import Connection
from zbroker.protocol.errors import ErrorCode, ZBrokerError
from zbroker.supervisor import wait_ready
from tests.integration.test_cli_and_clients import cli
from tests.integration.test_consumer_groups import drain, produce_values, wait_committed

pytestmark = pytest.mark.processes


def wait_for(predicate, what: str, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"never: {what}")


def refused(call) -> ZBrokerError:
    with pytest.raises(ZBrokerError) as info:
        call()
    return info.value


def test_alter_grows_partitions_and_refuses_to_shrink(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("orders", partitions=1)
        produce_values(broker.url, "orders", [b"a", b"b"])
        grown = admin.alter_topic("orders", partitions=3)
        assert grown["partitions"] == 3
        wait_for(lambda: all(p["endpoint"] for p in admin.metadata(["orders"])[0]["partitions"]),
                 "the new partitions are placed")

        err = refused(lambda: admin.alter_topic("orders", partitions=2))
        assert err.code is ErrorCode.INVALID_PARTITIONS and not err.retriable
        assert (err.data["partitions"], err.data["got"]) == (3, 2)
        assert len(admin.describe_topic("orders")["partitions"]) == 3  # nothing changed
    with Producer(broker.url, linger_ms=1) as producer:
        producer.produce("orders", [b"c"], partition=2)
    with closing(Connection(broker.url)) as conn:
        assert [r.value for r in fetch(conn, "orders", 0, 0)[0]] == [b"a", b"b"]  # nothing lost
        assert [r.value for r in fetch(conn, "orders", 2, 0)[0]] == [b"c"]

    proc = cli(broker.url, "topics", "alter", "orders", "--partitions", "1", check=False)
    assert proc.returncode == 1 and "INVALID_PARTITIONS" in proc.stderr
    assert "4 partition(s)" in cli(broker.url, "topics", "alter", "orders", "--partitions", "4").stdout


def test_alter_retention_reaches_the_partition_logs(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("metrics", partitions=1, config={"segment_bytes": 1024})
        produce_values(broker.url, "metrics", [b"x" * 200 for _ in range(60)], batch_size=1)
        wait_for(lambda: admin.describe_topic("metrics")["partitions"][0]["log_end"] == 60, "all appended")
        assert admin.describe_topic("metrics")["partitions"][0]["log_start"] == 0

        altered = admin.alter_topic("metrics", retention_bytes=2048)
        assert altered["config"]["retention_bytes"] == 2048
        part = wait_for(lambda: (p := admin.describe_topic("metrics")["partitions"][0])["log_start"] > 0 and p,
                        "retention deleted the oldest segments")
        assert part["log_end"] == 60
        assert admin.describe_topic("metrics")["config"]["retention_bytes"] == 2048
        err = refused(lambda: admin.alter_topic("metrics", retention_ms=-5))
        assert err.code is ErrorCode.BAD_REQUEST
    with closing(Connection(broker.url)) as conn:
        records, log_start, log_end = fetch(conn, "metrics", 0, part["log_start"])
        assert records[-1].offset == 59 and log_end == 60


def test_delete_group_refuses_live_members_then_forgets_its_offsets_for_good(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("jobs", partitions=2)
        produce_values(broker.url, "jobs", [b"%d" % i for i in range(100)])
        with Consumer(broker.url, group="workers", topics=["jobs"]) as consumer:
            drain(consumer, 100)
            ends = {("jobs", p["partition"]): p["log_end"] for p in admin.describe_topic("jobs")["partitions"]}
            wait_committed(admin, "workers", ends)
            err = refused(lambda: admin.delete_group("workers"))
            assert err.code is ErrorCode.GROUP_NOT_EMPTY and err.data["members"] == 1
            proc = cli(broker.url, "groups", "delete", "workers", check=False)
            assert proc.returncode == 1 and "GROUP_NOT_EMPTY" in proc.stderr
            wait_committed(admin, "workers", ends)  # the refusal lost nothing
        assert "removed" in cli(broker.url, "groups", "delete", "workers").stdout
        assert "workers" not in [g["group"] for g in admin.list_groups()]
        assert refused(lambda: admin.delete_group("workers")).code is ErrorCode.UNKNOWN_GROUP

    # The tombstones are durable: a restarted coordinator does not bring the offsets back,
    # and the group of the same name starts over from the earliest offset.
    with Admin(broker.url) as admin:
        wait_for(lambda: [a for a in admin.status()["actors"] if a["kind"] == "commit-writer"][0]
                 ["unconfirmed_advances"] == 0, "the writer confirmed the tombstones")
    broker.kill("coordinator", signal.SIGKILL)
    wait_ready(broker.url)
    with Admin(broker.url) as admin:
        assert "workers" not in [g["group"] for g in admin.list_groups()]
    with Consumer(broker.url, group="workers", topics=["jobs"]) as consumer:
        assert len(drain(consumer, 100)) == 100


def _wall_ms_after(ms: int) -> int:
    """Wall-clock milliseconds, once the clock is past `ms` (append times are wall-clock ms)."""
    while (now := int(time.time() * 1000)) <= ms:
        time.sleep(0.001)
    return now


def test_reset_to_a_time_moves_each_partition_to_the_first_record_appended_since(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("events", partitions=2)
    with Producer(broker.url, linger_ms=1) as producer:
        for p in (0, 1):
            producer.produce("events", [b"old-%d" % i for i in range(5)], partition=p)
        producer.flush()
        mid = _wall_ms_after(int(time.time() * 1000))
        _wall_ms_after(mid)
        for p in (0, 1):
            producer.produce("events", [b"new-%d" % i for i in range(3)], partition=p)
    with Admin(broker.url) as admin, Consumer(broker.url, group="readers", topics=["events"]) as consumer:
        assert len(drain(consumer, 16)) == 16
        wait_committed(admin, "readers", {("events", 0): 8, ("events", 1): 8})

        # Today's rule: a group with live members may be reset; their leases are revoked and
        # the records from the time on are delivered again.
        result = admin.reset_group_to_time("readers", "events", mid)
        assert sorted(result["partitions"]) == [[0, 5], [1, 5]]
        assert admin.describe_group("readers")["members"]  # the member is still there
        again = drain(consumer, 6)
        assert sorted(r.value for r in again) == sorted([b"new-%d" % i for i in range(3)] * 2)
        wait_committed(admin, "readers", {("events", 0): 8, ("events", 1): 8})

        future = admin.reset_group_to_time("readers", "events", int(time.time() * 1000) + 3_600_000)
        assert sorted(future["partitions"]) == [[0, 8], [1, 8]]
        assert refused(lambda: admin.reset_group_to_time("nobody", "events", 0)).code is ErrorCode.UNKNOWN_GROUP
        assert refused(lambda: admin.reset_group_to_time("readers", "nope", 0)).code is ErrorCode.UNKNOWN_TOPIC

    out = cli(broker.url, "groups", "reset", "readers", "--topic", "events", "--to-datetime",
              "1970-01-01T00:00:00Z", "--json").stdout
    assert sorted(json.loads(out)["partitions"]) == [[0, 0], [1, 0]]
    bad = cli(broker.url, "groups", "reset", "readers", "--topic", "events", "--to-datetime", "yesterday",
              check=False)
    assert bad.returncode == 2 and "ISO 8601" in bad.stderr


def _partition_dirs(broker, topic: str) -> list:
    from pathlib import Path
    return sorted(Path(broker.config.data_dir).glob(f"**/logs/{topic}/*"))


def test_delete_topic_refuses_live_consumers_then_removes_logs_and_offsets_for_good(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("orders", partitions=2)
        produce_values(broker.url, "orders", [b"old-%d" % i for i in range(40)])
        admin.create_topic("other", partitions=1)
        produce_values(broker.url, "other", [b"keep-%d" % i for i in range(5)])
        with Consumer(broker.url, group="workers", topics=["orders", "other"]) as consumer:
            drain(consumer, 45)
            ends = {("orders", p["partition"]): p["log_end"] for p in admin.describe_topic("orders")["partitions"]}
            wait_committed(admin, "workers", {**ends, ("other", 0): 5})
            err = refused(lambda: admin.delete_topic("orders"))
            assert err.code is ErrorCode.TOPIC_IN_USE and not err.retriable
            assert err.data == {"topic": "orders", "groups": ["workers"]}
            proc = cli(broker.url, "topics", "delete", "orders", check=False)
            assert proc.returncode == 1 and "TOPIC_IN_USE" in proc.stderr
            with closing(Connection(broker.url)) as conn:  # the refusal lost nothing
                assert sum(len(fetch(conn, "orders", p, 0)[0]) for p in (0, 1)) == 40
            wait_committed(admin, "workers", ends)
        assert _partition_dirs(broker, "orders")

        out = cli(broker.url, "topics", "delete", "orders", "--json").stdout
        assert json.loads(out) == {"topic": "orders", "partitions": 2, "groups": ["workers"], "pending": []}
        assert "orders" not in admin.list_topics()
        assert refused(lambda: admin.describe_topic("orders")).code is ErrorCode.UNKNOWN_TOPIC
        assert refused(lambda: admin.delete_topic("orders")).code is ErrorCode.UNKNOWN_TOPIC
        assert refused(lambda: admin.delete_topic("no..such")).code is ErrorCode.BAD_REQUEST
        assert _partition_dirs(broker, "orders") == []  # the reply came once the files were gone
        group = admin.describe_group("workers")
        assert {p["topic"] for p in group["partitions"]} == {"other"}  # the other topic's offsets stay

    # A restarted coordinator brings nothing back, and a topic created under the name
    # starts empty, its group from the start rule: the old offsets (20 per partition) would
    # skip every new record.
    broker.kill("coordinator", signal.SIGKILL)
    wait_ready(broker.url)
    with Admin(broker.url) as admin:
        assert "orders" not in admin.list_topics()
        admin.create_topic("orders", partitions=2)
        assert [p["log_end"] for p in admin.describe_topic("orders")["partitions"]] == [0, 0]
    produce_values(broker.url, "orders", [b"new-%d" % i for i in range(6)])
    with Admin(broker.url) as admin, Consumer(broker.url, group="workers", topics=["orders", "other"]) as consumer:
        got = drain(consumer, 6)
        assert sorted(r.value for r in got) == sorted(b"new-%d" % i for i in range(6))
        ends = {("orders", p["partition"]): p["log_end"] for p in admin.describe_topic("orders")["partitions"]}
        wait_committed(admin, "workers", {**ends, ("other", 0): 5})
        assert consumer.poll(timeout=0.5) == []  # "other" was not delivered again


def _dlq_end(admin, topic: str) -> int:
    try:
        return admin.describe_topic(topic)["partitions"][0]["log_end"]
    except ZBrokerError:
        return 0


def test_dlq_redrive_moves_letters_back_with_provenance_and_counts_each_attempt(broker):
    from zbroker.client.redrive import redrive_dead_letters, redrive_dead_letters_async
    with Admin(broker.url) as admin:
        admin.create_topic("jobs", partitions=2)
        with Producer(broker.url, linger_ms=1) as producer:
            for i in range(10):
                producer.send("jobs", b"job-%d" % i, key=b"k%d" % i, headers={"trace": b"t%d" % i})
        with Consumer(broker.url, group="workers", topics=["jobs"]) as consumer:
            got = drain(consumer, 10, ack=False)
            bad = [r for r in got if r.value in (b"job-1", b"job-4", b"job-7", b"job-8")]
            consumer.reject(bad, reason="poison")
            consumer.ack_many([r for r in got if r not in bad])
            consumer.flush_acks()
        wait_for(lambda: _dlq_end(admin, "jobs.dlq") == 4, "four dead letters")

        err = refused(lambda: redrive_dead_letters(broker.url, "nope.dlq"))
        assert err.code is ErrorCode.UNKNOWN_TOPIC
        proc = cli(broker.url, "dlq", "redrive", "nope.dlq", check=False)
        assert proc.returncode == 1 and "UNKNOWN_TOPIC" in proc.stderr

        first = json.loads(cli(broker.url, "dlq", "redrive", "jobs.dlq", "--max", "3", "--json").stdout)
        assert (first["redriven"], first["by_topic"], first["skipped"]) == (3, {"jobs": 3}, [])
        assert "redrove 1 dead letter(s)" in cli(broker.url, "dlq", "redrive", "jobs.dlq").stdout
        empty = cli(broker.url, "dlq", "redrive", "jobs.dlq")  # all gone back: a result, not an error
        assert empty.returncode == 0 and "nothing to redrive" in empty.stdout
        admin.create_topic("quiet.dlq", partitions=1)
        assert redrive_dead_letters(broker.url, "quiet.dlq")["redriven"] == 0

        # Back in the source, once each: value, key and headers kept, provenance kept, the attempt counted.
        with Consumer(broker.url, group="workers", topics=["jobs"]) as consumer:
            back = drain(consumer, 4, ack=False)
            assert sorted(r.value for r in back) == [b"job-1", b"job-4", b"job-7", b"job-8"]
            for r in back:
                i = r.value[4:]
                assert r.key == b"k" + i and r.headers["trace"] == b"t" + i
                assert r.headers["zb-dlq-source-topic"] == b"jobs" and r.headers["zb-dlq-reason"] == b"reject:poison"
                assert r.headers["zb-dlq-redrives"] == b"1"
            again = [r for r in back if r.value == b"job-4"]
            consumer.reject(again, reason="still poison")
            consumer.ack_many([r for r in back if r.value != b"job-4"])
            consumer.flush_acks()
            assert consumer.poll(timeout=0.5) == []  # nothing delivered twice
        wait_for(lambda: _dlq_end(admin, "jobs.dlq") == 5, "the letter is dead again")
        # From asyncio code: the same operation, off the event loop.
        assert asyncio.run(redrive_dead_letters_async(broker.url, "jobs.dlq"))["redriven"] == 1
        with Consumer(broker.url, group="workers", topics=["jobs"]) as consumer:
            [twice] = drain(consumer, 1)
            assert twice.value == b"job-4" and twice.headers["zb-dlq-redrives"] == b"2"
            assert twice.headers["zb-dlq-reason"] == b"reject:still poison"
