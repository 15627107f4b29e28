"""Replicated topics on a real broker: `zbroker up --partition-actors 3 --actor-dirs`, topics
created with --replication-factor, described, reassigned, and refused when unplaceable."""

from __future__ import annotations

import json

import pytest

from tests.integration.test_cli_and_clients import cli
from tests.support.waiting import wait_for
from zbroker.client import Admin, Producer
from zbroker.protocol.errors import NotEnoughReplicas

pytestmark = pytest.mark.processes


def test_r3_on_three_builtin_actors_is_placed_described_and_reassigned(start, tmp_path):
    broker = start(partition_actors=3, extra_args=("--actor-dirs",))
    # Each built-in actor has its own data directory (p0 keeps the historical one).
    assert {p.name for p in (tmp_path / "data").iterdir() if p.name.startswith("partitions")} == \
        {"partitions", "partitions-p1", "partitions-p2"}
    out = cli(broker.url, "topics", "create", "orders", "--partitions", "3", "--replication-factor", "3")
    assert "replication factor 3" in out.stdout
    parts = json.loads(cli(broker.url, "topics", "describe", "orders", "--json").stdout)["partitions"]
    assert len(parts) == 3
    for p in parts:
        assert sorted(p["replicas"]) == ["p0", "p1", "p2"] and p["isr"] == p["replicas"]
        assert p["leader"] == p["replicas"][0] == p["actor_id"] and p["leader_epoch"] == 0
        assert p["endpoint"] and p["min_insync"] == 2
    assert sorted(p["leader"] for p in parts) == ["p0", "p1", "p2"]  # leadership spread
    with Admin(broker.url) as admin:
        meta = admin.metadata(["orders"])[0]["partitions"][0]
        assert meta["replicas"] == parts[0]["replicas"] and meta["leader_epoch"] == 0
        with pytest.raises(NotEnoughReplicas) as info:
            admin.create_topic("too-wide", partitions=1, replication_factor=4)
        assert info.value.data["qualifying"] == 3
        assert "too-wide" not in admin.list_topics()
    table = cli(broker.url, "topics", "describe", "orders").stdout
    assert "LEADER_EPOCH" in table and "HIGH_WATERMARK" in table and "p0,p1,p2" in table
    status = json.loads(cli(broker.url, "status", "--json").stdout)
    assert status["under_replicated"] == [] and status["healthy"]

    # Move partition 0 off its leader onto the other two: the target is in the ISR already,
    # so the move finishes at once and leadership passes to the target at a new epoch.
    leader = parts[0]["leader"]
    target = [r for r in parts[0]["replicas"] if r != leader]
    out = cli(broker.url, "topics", "reassign", "orders", "--partition", "0", "--replicas", ",".join(target))
    assert "moved" in out.stdout
    moved = json.loads(cli(broker.url, "topics", "describe", "orders", "--json").stdout)["partitions"][0]
    assert moved["replicas"] == target and moved["isr"] == target
    assert moved["leader"] == target[0] and moved["leader_epoch"] == 1
    # Fewer replicas than min_insync is refused, and nothing changes.
    refused = cli(broker.url, "topics", "reassign", "orders", "--partition", "0", "--replicas", target[0],
                  check=False)
    assert refused.returncode != 0 and "NOT_ENOUGH_REPLICAS" in refused.stderr


def test_builtin_actors_sharing_one_directory_cannot_hold_two_replicas(broker_pair):
    with Admin(broker_pair.url) as admin:
        with pytest.raises(NotEnoughReplicas) as info:
            admin.create_topic("r2", partitions=1, replication_factor=2)
        assert info.value.data["qualifying"] == 1
        admin.create_topic("r1", partitions=2)  # unreplicated topics are placed as always
        owners = {p["actor_id"] for p in admin.metadata(["r1"])[0]["partitions"]}
        assert owners == {"p0", "p1"}


@pytest.fixture
def broker_pair(start):
    """Two built-in actors in today's layout: one shared <data>/partitions."""
    return start(partition_actors=2)


def test_a_sigkilled_leader_loses_its_leadership_to_an_isr_member_at_a_new_epoch(start):
    import os
    import signal
    broker = start(partition_actors=3, extra_args=("--actor-dirs",))
    with Admin(broker.url) as admin:
        admin.create_topic("failover", partitions=1, replication_factor=3)
        before = admin.describe_topic("failover")["partitions"][0]
        victim = next(a for a in admin.status()["actors"] if a.get("actor_id") == before["leader"])
        os.kill(victim["pid"], signal.SIGKILL)
        # The supervisor restarts it: a new process, which may have lost its unsynced
        # tail, so it leads no more (and leaves the ISR until its leader re-admits it).
        after = wait_for(lambda: (lambda p: p if p["leader_epoch"] > before["leader_epoch"] else None)(
            admin.describe_topic("failover")["partitions"][0]), 60, "a new leader epoch")
        assert after["leader"] != before["leader"] and after["leader"] in before["isr"]
        assert after["leader_epoch"] == before["leader_epoch"] + 1
        assert after["replicas"] == before["replicas"]
        meta = admin.metadata(["failover"])[0]["partitions"][0]
        assert meta["actor_id"] == after["leader"] and meta["leader_epoch"] >= after["leader_epoch"]
        # Under-replicated until the restarted replica is re-admitted (once partition actors
        # replicate, that may already have happened), never below min_insync.
        for row in admin.status()["under_replicated"]:
            assert row["leader"] == after["leader"] and not row["below_min_insync"]


def test_growing_a_replicated_topic_replicates_its_new_partitions(start):
    """`topics alter --partitions` on an R = 3 topic: the new partitions get replica sets of
    three like the first ones (they were placed unreplicated, on one actor, before), and a
    record produced to one is acknowledged once the ISR has it."""
    broker = start(partition_actors=3, extra_args=("--actor-dirs",))
    with Admin(broker.url) as admin:
        admin.create_topic("grow", partitions=1, replication_factor=3)
        admin.alter_topic("grow", partitions=3)
        parts = wait_for(lambda: (ps := admin.describe_topic("grow")["partitions"]) and
                         all(len(p["isr"]) == 3 for p in ps) and ps, timeout=30,
                         what="every partition with an ISR of three")
        assert [p["partition"] for p in parts] == [0, 1, 2]
        for p in parts:
            assert sorted(p["replicas"]) == ["p0", "p1", "p2"] and p["min_insync"] == 2
            assert p["leader"] == p["replicas"][0] and p["leader_epoch"] == 0
    with Producer(broker.url) as producer:
        handle = producer.send("grow", b"on-a-new-partition", partition=2)
        producer.flush()
        assert handle.error is None and handle.offset == 0
    with Admin(broker.url) as admin:
        wait_for(lambda: all(v == 1 for v in admin.describe_topic("grow")["partitions"][2]
                             ["replica_log_ends"].values()) and
                 len(admin.describe_topic("grow")["partitions"][2]["replica_log_ends"]) == 3,
                 timeout=30, what="the record on all three replicas")
