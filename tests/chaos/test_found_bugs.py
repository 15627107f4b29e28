"""Broker bugs the chaos run found, each as the smallest test that shows it.

A bug still open is marked ``xfail(strict=True)``: its fix makes the test
pass, strict xfail turns that into a failure, and the mark comes off. A fixed
one stays here as a regression test.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.log.support import make_payload, open_log
from tests.support.waiting import wait_for
from zbroker.actors.partition_log.replica import Replica, ReplicaState
from zbroker.client import Admin, Consumer, Producer



def _endpoints(admin: Admin, topic: str) -> dict[int, str]:
    [meta] = admin.metadata([topic])
    return {i: p.get("endpoint") for i, p in enumerate(meta["partitions"])}


@pytest.mark.processes
def test_a_consumer_keeps_consuming_after_its_partitions_move_to_another_actor(start):
    """Found by the chaos run (fixed): `Consumer` ignored NOT_OWNER on a fetch and never refreshed the
    metadata it had cached, so after partitions moved between partition-log actors it fetched from
    the old owner forever; its leases expired and came back to it, and the partitions stopped being
    consumed (a livelock: nothing lost, nothing delivered)."""
    broker = start(partition_actors=2)
    with Admin(broker.url) as admin:
        admin.create_topic("moving", partitions=2)
        admin.configure_group("movers", ack_timeout_ms=1000)
        before = _endpoints(admin, "moving")
    assert before[0] != before[1]  # p0 owns partition 0, p1 owns partition 1

    with Producer(broker.url, linger_ms=1) as producer:
        for p in (0, 1):
            producer.produce("moving", [b"before"], partition=p)
    consumer = Consumer(broker.url, group="movers", topics=["moving"], session_timeout_ms=30_000)
    try:
        got = []
        deadline = time.monotonic() + 15
        while len(got) < 2 and time.monotonic() < deadline:
            for rec in consumer.poll(max_records=10, timeout=0.2):
                got.append(rec)
                consumer.ack(rec)
        consumer.flush_acks()
        assert len(got) == 2  # the consumer has cached both partitions' endpoints

        # Silence p0 past the coordinator's actor timeout (5 s): partition 0 moves to p1. When p0
        # speaks again, it takes the highest partition of p1, partition 1. The two have swapped.
        pid = broker.pids()["partition-0"]
        os.kill(pid, signal.SIGSTOP)
        try:
            with Admin(broker.url) as admin:
                wait_for(lambda: _endpoints(admin, "moving")[0] == before[1], 15, "partition 0 to move to p1")
        finally:
            os.kill(pid, signal.SIGCONT)
        with Admin(broker.url) as admin:
            wait_for(lambda: _endpoints(admin, "moving") == {0: before[1], 1: before[0]}, 15,
                      "the partitions to swap actors")

        with Producer(broker.url, linger_ms=1) as producer:
            for p in (0, 1):
                producer.produce("moving", [b"after"], partition=p)
        after = []
        deadline = time.monotonic() + 15  # fifteen lease expiries
        while len(after) < 2 and time.monotonic() < deadline:
            for rec in consumer.poll(max_records=10, timeout=0.2):
                after.append(rec)
                consumer.ack(rec)
        assert sorted((r.partition, r.value) for r in after) == [(0, b"after"), (1, b"after")]
    finally:
        consumer.close()


def test_a_follower_given_the_answer_to_one_fetch_offset_twice_appends_it_once(tmp_path):
    """Found by the replicated chaos run (fixed): a follower host's actor exited with
    ``CORRUPT_BATCH: a replicated batch does not continue the log {"base_offset": 0,
    "log_end": 10}`` (then ``7``/``17`` after its restart), a minute into the run, with no
    fault on it. Two replica_fetch requests from one offset were answered in one leader epoch
    (here: the follower's replica was dropped and re-created by an assignment while its fetch
    was out, so the new one fetched from the same offset); the first answer was appended, the
    second no longer started at the log end, and `append_stored` raised out of the loop. An
    answer whose first batch does not start at the log end answers an earlier fetch: it is
    dropped, and the next fetch goes out from where the log is."""
    names = ("a", "b")
    state = ReplicaState(1, "a", "a", names, names, 2, {n: n for n in names})
    leader_log, follower_log = open_log(tmp_path / "a"), open_log(tmp_path / "b")
    leader = Replica("t", 0, "a", leader_log, state, 0)
    leader_log.append(make_payload(1, 10), 10, append_time_ms=1)
    leader.on_local_end(leader_log.log_end, 0)

    first = Replica("t", 0, "b", follower_log, state, 0)
    _endpoint, early = first.next_fetch(0)
    again = Replica("t", 0, "b", follower_log, state, 0)  # re-created while `early` is out
    _endpoint, late = again.next_fetch(0)
    assert early.fetch_offset == late.fetch_offset == 0
    for request in (early, late):  # both answered, both in epoch 1
        reply, data, _effects = leader.on_replica_fetch(request, 0)
        again.on_fetch_reply(reply, data, 0)
    assert follower_log.log_end == 10
    assert follower_log.read(0, 1 << 20) == leader_log.read(0, 1 << 20)  # once, byte for byte
    _endpoint, following = again.next_fetch(0)
    assert following.fetch_offset == 10
    leader_log.close(), follower_log.close()


def test_a_follower_given_a_late_answer_to_an_earlier_fetch_from_a_lower_offset_drops_it(tmp_path):
    """The same crash, the other interleaving the chaos run showed (both followers of one
    partition exited a second into the run with ``{"base_offset": 0, "log_end": 5}``): a fetch
    from 0 is still out when another from 0 is answered and applied and a fetch from 5 is sent;
    then the first is answered, from 0. It must change nothing (and not take the actor down)."""
    names = ("a", "b")
    state = ReplicaState(1, "a", "a", names, names, 2, {n: n for n in names})
    leader_log, follower_log = open_log(tmp_path / "a"), open_log(tmp_path / "b")
    leader = Replica("t", 0, "a", leader_log, state, 0)
    leader_log.append(make_payload(1, 5), 5, append_time_ms=1)
    leader.on_local_end(leader_log.log_end, 0)

    _endpoint, stale = Replica("t", 0, "b", follower_log, state, 0).next_fetch(0)  # out, never answered yet
    follower = Replica("t", 0, "b", follower_log, state, 0)
    _endpoint, request = follower.next_fetch(0)
    follower.on_fetch_reply(*leader.on_replica_fetch(request, 0)[:2], 0)
    assert follower_log.log_end == 5
    _endpoint, newer = follower.next_fetch(0)
    assert newer.fetch_offset == 5
    leader_log.append(make_payload(2, 3), 3, append_time_ms=2)
    leader.on_local_end(leader_log.log_end, 0)
    follower.on_fetch_reply(*leader.on_replica_fetch(stale, 0)[:2], 0)  # batches from 0: dropped
    assert follower_log.log_end == 5
    follower.on_fetch_reply(*leader.on_replica_fetch(newer, 0)[:2], 0)
    assert follower_log.log_end == 8
    assert follower_log.read(0, 1 << 20) == leader_log.read(0, 1 << 20)
    leader_log.close(), follower_log.close()


@pytest.mark.processes
def test_followers_fetch_again_after_their_leaders_link_dropped_an_answer(start, tmp_path):
    """Found by the replicated chaos run (fixed): after a leader's network link was cut (or the
    leader paused), its followers stopped fetching for good: the partition-log shell gave the
    links its wall clock for a fetch's give-up deadline and compared it with the monotonic one,
    so a fetch whose answer was lost was never given up. The ISR stayed at the leader alone
    (produce refused with NOT_ENOUGH_REPLICAS) until a host restarted or the leader changed."""
    from tests.chaos.hosts import Host

    broker = start(partition_actors=1)
    hosts = [Host(i, broker.url, tmp_path / "hosts", replica_lag_ms=2000, fsync="interval:1000")
             for i in range(3)]
    names = [h.name for h in hosts]
    try:
        for host in hosts:
            host.start()
        with Admin(broker.url) as admin:
            wait_for(lambda: {a["actor_id"] for a in admin.status()["actors"] if a.get("healthy")} >= set(names),
                     60, "the hosts to register")
            admin.create_topic("cut", partitions=1, replication_factor=3, min_insync=2)
            admin.reassign_partition("cut", 0, names)

            def full_isr():
                p = admin.describe_topic("cut")["partitions"][0]
                return p if p["replicas"] == names and sorted(p["isr"]) == sorted(names) else None
            before = wait_for(full_isr, 60, "the replica set to move onto the hosts")
            with Producer(broker.url, linger_ms=1, retries=1000) as producer:
                producer.produce("cut", [b"before-%d" % i for i in range(50)], partition=0)
            leader = next(h for h in hosts if h.name == before["leader"])
            leader.link.cut("reset")  # the followers' parked fetches lose their answers
            # Both followers lag; one stays in the ISR (the ISR floor, at min_insync 2), and the
            # leader counts it out: status lists the partition below M.
            wait_for(lambda: next((u for u in admin.status().get("under_replicated", [])
                                   if u["topic"] == "cut" and u["keeping_up"] == 1 and len(u["isr"]) == 2), None),
                     60, "the leader to count both followers out")
            leader.link.restore()
            after = wait_for(full_isr, 60, "the followers to fetch again and rejoin the ISR")
            assert after["leader"] == leader.name and after["leader_epoch"] == before["leader_epoch"]
            with Producer(broker.url, linger_ms=1, retries=1000) as producer:
                producer.produce("cut", [b"after"], partition=0)
    finally:
        for host in hosts:
            host.close()
