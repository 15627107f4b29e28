"""Nodes of one cluster on one PostgreSQL schema (issue 26), as real `zbroker up` processes on
their own loopback addresses: a standby redirects with NOT_COORDINATOR to the leader, and
a leader paused past its lease wakes up able to change nothing, proved by a query of the
rows' coordinator_epoch."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import asyncpg
import pytest
import zmq

from zbroker.client import Admin, Consumer, Producer
from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.errors import NotCoordinator, StaleLease, ZBrokerError
from zbroker.supervisor import free_port_block, start_broker
from tests.support.pg import pg_execute, pg_fetch, with_schema
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.processes, pytest.mark.postgres]

LEASE_MS = 2000  # the shortest zbroker up takes: a takeover in seconds


def _node(tmp_path, name, host, offsets, **kw):
    return start_broker(tmp_path / name, host=host, offsets_url=offsets, wait=False, log_level="info",
                        log_file=tmp_path / f"{name}.log", extra_args=("--coordinator-lease-ms", str(LEASE_MS)), **kw)


def _lease(dsn, schema):
    try:
        rows = pg_fetch(dsn, f'SELECT holder, endpoint, epoch FROM "{schema}".zbroker_coordinator_lease')
    except asyncpg.UndefinedTableError:  # no commit writer has migrated the schema yet
        return None
    return None if not rows else dict(rows[0])


def _ask(url, msg, timeout_ms=3000):
    """One request, its reply or error as the wire has it (no client redirects)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(url)
        sock.send_multipart(codec.encode_request(msg, 1))
        if not sock.poll(timeout_ms):
            return None
        return codec.decode_reply(sock.recv_multipart())
    finally:
        sock.close(linger=0)


def _leading(dsn, schema, url, timeout=60.0):
    return wait_for(lambda: (lease := _lease(dsn, schema)) and lease["holder"] == url and lease,
                    timeout, f"{url} to hold the coordinator lease")


def _redirects_to(url, leader_url):
    env = _ask(url, m.ListTopics())
    return (env is not None and env.error is not None and env.error.code.value == "NOT_COORDINATOR"
            and (env.error.data.get("leader") or {}).get("endpoint") == leader_url and env.error)


def test_a_standby_answers_not_coordinator_and_a_client_given_only_it_finds_the_leader(tmp_path, pg_dsn, pg_schema):
    offsets = with_schema(pg_dsn, pg_schema)
    with _node(tmp_path, "a", "127.0.0.1", offsets) as a:
        lease = _leading(pg_dsn, pg_schema, a.url)
        with _node(tmp_path, "b", "127.0.0.2", offsets) as b:
            error = wait_for(lambda: _redirects_to(b.url, a.url), 60, "the standby to redirect to the leader")
            assert error.retriable and error.data["leader"]["epoch"] == lease["epoch"]
            assert error.data["leader"]["node_id"] == a.url
            # A client that knows only the standby follows it to the leader.
            with Admin(b.url) as admin:
                admin.create_topic("orders", partitions=2)
            with Admin(a.url) as admin:
                assert "orders" in admin.list_topics()
            stored = pg_fetch(pg_dsn, f'SELECT name, partitions, coordinator_epoch FROM "{pg_schema}".zbroker_topics')
            assert [tuple(r) for r in stored] == [("orders", 2, lease["epoch"])]
            assert _lease(pg_dsn, pg_schema)["holder"] == a.url


STALE_WRITES = """
SELECT '{table}' AS tbl, count(*) AS n FROM "{schema}".{table} AS t
WHERE t.coordinator_epoch > 0 AND EXISTS (
    SELECT 1 FROM "{schema}".zbroker_coordinator_epochs AS later
    WHERE later.epoch > t.coordinator_epoch AND later.taken_at <= t.updated_at)
"""
FENCED_TABLES = ("consumer_group_offsets", "zbroker_topics", "zbroker_partition_states")


def _stale_writes(dsn, schema):
    """Rows written by an epoch after a later epoch was taken: what fencing must make impossible."""
    return {t: pg_fetch(dsn, STALE_WRITES.format(table=t, schema=schema))[0]["n"] for t in FENCED_TABLES}


def _signal_node(handle, sig):
    """The whole node: its supervisor and every actor (each in a process group of its own)."""
    pids = [handle.process.pid, *handle.actor_pids()]
    for pid in pids if sig != signal.SIGCONT else reversed(pids):
        os.kill(pid, sig)


def test_a_paused_leader_resumed_after_its_successor_took_over_writes_nothing(tmp_path, pg_dsn, pg_schema):
    offsets = with_schema(pg_dsn, pg_schema)
    with _node(tmp_path, "a", "127.0.0.1", offsets) as a, _node(tmp_path, "b", "127.0.0.2", offsets) as b:
        first = wait_for(lambda: (lease := _lease(pg_dsn, pg_schema)) and lease, 60, "a leader")
        leader, standby = (a, b) if first["holder"] == a.url else (b, a)
        wait_for(lambda: _redirects_to(standby.url, leader.url), 60, "the standby to know the leader")
        with Admin(leader.url) as admin:
            admin.create_topic("work", partitions=1)
        with Producer(leader.url) as producer:
            for i in range(2000):
                producer.send("work", b"%d" % i)
            producer.flush()
        consumer = Consumer(f"{leader.url},{standby.url}", group="g", topics=["work"], request_timeout=2.0)
        try:
            acked = 0
            while acked < 500:  # offsets flowing to the leader's commit writer
                records = consumer.poll(max_records=50, timeout=2.0)
                consumer.ack_many(records)
                acked += len(records)
            consumer.flush_acks()
            committed_before = wait_for(lambda: pg_fetch(
                pg_dsn, f'SELECT committed_offset, coordinator_epoch FROM "{pg_schema}".consumer_group_offsets '
                "WHERE group_id = 'g' AND committed_offset > 0"), 30, "the leader to commit the acked offsets")
            assert committed_before[0]["coordinator_epoch"] == first["epoch"]
            # Paused mid-stream, with acks still arriving: past its lease, the standby takes over.
            for records in (consumer.poll(max_records=50, timeout=0.5) for _ in range(3)):
                consumer.ack_many(records)
            _signal_node(leader, signal.SIGSTOP)
            try:
                taken = _leading(pg_dsn, pg_schema, standby.url, timeout=60)
                assert taken["epoch"] > first["epoch"]
            finally:
                _signal_node(leader, signal.SIGCONT)
            # Woken, the former leader stands by at once and points at its successor.
            wait_for(lambda: _redirects_to(leader.url, standby.url), 60, "the former leader to stand by")
            assert _stale_writes(pg_dsn, pg_schema) == dict.fromkeys(FENCED_TABLES, 0)
            committed_after = pg_fetch(pg_dsn, f'SELECT committed_offset FROM "{pg_schema}".consumer_group_offsets '
                                       "WHERE group_id = 'g'")
            assert committed_after[0]["committed_offset"] >= committed_before[0]["committed_offset"]
        finally:
            # Its unflushed acks were for the former leader's leases, which ended with its
            # term: the close's last ack flush may be refused, which is not under test here.
            with contextlib.suppress(NotCoordinator, StaleLease):
                consumer.close(leave=False)
        # The query catches a write that fencing would have refused: one crafted by hand.
        pg_execute(pg_dsn, f'UPDATE "{pg_schema}".consumer_group_offsets SET coordinator_epoch = $1, '
                   "updated_at = now() WHERE group_id = 'g'", first["epoch"])
        assert _stale_writes(pg_dsn, pg_schema)["consumer_group_offsets"] == 1


def _partition_actor(tmp_path, broker_urls, port):
    """A partition actor of its own (its host: 127.0.0.3), as on a host apart from the nodes.
    Its id sorts before the nodes' built-in p0, so a one-partition topic is placed on it."""
    log = open(tmp_path / "a1.log", "ab")
    try:
        return subprocess.Popen([sys.executable, "-m", "zbroker", "partition", "--broker", broker_urls,
                                 "--data", str(tmp_path / "a1"), "--actor-id", "a1",
                                 "--bind", f"tcp://127.0.0.3:{port}", "--log-level", "info"],
                                stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    finally:
        log.close()


class Load:
    """An idempotent producer and a consumer group acking what they get, on their own threads,
    through the nodes' bootstrap list; what was acknowledged and what was received."""

    def __init__(self, urls):
        self.urls = urls
        self.acked: set[bytes] = set()
        self.received: set[bytes] = set()
        self.producing = threading.Event()
        self.producing.set()
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._produce, daemon=True),
                        threading.Thread(target=self._consume, daemon=True)]
        for t in self.threads:
            t.start()

    def _produce(self):
        with Producer(self.urls, request_timeout=2.0) as producer:
            n = 0
            while self.producing.is_set():
                batch = [b"v%06d" % (n + i) for i in range(20)]
                try:
                    for value in batch:
                        producer.send("orders", value)
                    producer.flush(timeout=30)
                except ZBrokerError as err:  # not acknowledged: those values may or may not be in the log
                    self.errors.append(f"produce: {err.code.value}")
                    time.sleep(0.2)
                else:
                    self.acked.update(batch)
                n += len(batch)
                time.sleep(0.01)

    def _consume(self):
        consumer = None
        while not self.stop.is_set():
            try:
                if consumer is None:
                    consumer = Consumer(self.urls, group="g", topics=["orders"], request_timeout=2.0)
                records = consumer.poll(max_records=100, timeout=0.5)
                self.received.update(r.value for r in records)
                consumer.ack_many(records)
            except ZBrokerError as err:
                # The client is expected to ride a failover out by itself; whatever it still
                # raises is counted (and the member joins again), never hidden from the totals.
                self.errors.append(f"consume: {err.code.value}")
                if consumer is not None:
                    with contextlib.suppress(ZBrokerError):
                        consumer.close(leave=False)
                consumer = None
                time.sleep(0.2)
        if consumer is not None:
            with contextlib.suppress(ZBrokerError):
                consumer.close()

    def close(self):
        self.producing.clear()
        self.stop.set()
        for t in self.threads:
            t.join(60)


def _committed(dsn, schema):
    rows = pg_fetch(dsn, f'SELECT committed_offset FROM "{schema}".consumer_group_offsets '
                    "WHERE group_id = 'g' AND topic = 'orders' AND partition = 0")
    return rows[0]["committed_offset"] if rows else None


def test_the_leader_killed_under_load_a_standby_takes_over_and_nothing_acknowledged_is_lost(
        tmp_path, pg_dsn, pg_schema):
    offsets = with_schema(pg_dsn, pg_schema)
    port = free_port_block(1, host="127.0.0.3")
    with _node(tmp_path, "a", "127.0.0.1", offsets) as a:
        first = _leading(pg_dsn, pg_schema, a.url)
        with _node(tmp_path, "b", "127.0.0.2", offsets) as b:
            wait_for(lambda: _redirects_to(b.url, a.url), 60, "the standby to know the leader")
            urls = f"{a.url},{b.url}"
            actor = _partition_actor(tmp_path, urls, port)
            try:
                with Admin(a.url) as admin:
                    wait_for(lambda: any(x["actor_id"] == "a1" for x in admin.status()["actors"]), 60,
                             "the partition actor to register with the leader")
                    admin.create_topic("orders", partitions=1)
                    assert admin.metadata(["orders"])[0]["partitions"][0]["actor_id"] == "a1"
                load = Load(urls)
                committed = []
                try:
                    wait_for(lambda: (c := _committed(pg_dsn, pg_schema)) and c > 200 and committed.append(c) is None,
                             120, "the group to commit under load on the first leader")
                    for pid in [a.process.pid, *a.actor_pids()]:
                        os.kill(pid, signal.SIGKILL)  # the whole node at once
                    # The actor dials the surviving node. Partition actors following the leader
                    # by themselves is not under test here: it is restarted, on its own data
                    # directory and port, pointed at that node (which redirects to the leader).
                    actor.terminate()
                    actor.wait(30)
                    actor = _partition_actor(tmp_path, b.url, port)
                    taken = _leading(pg_dsn, pg_schema, b.url, timeout=120)
                    assert taken["epoch"] > first["epoch"]
                    acked_at_kill = len(load.acked)
                    wait_for(lambda: (committed.append(_committed(pg_dsn, pg_schema)) or True)
                             and len(load.acked) > acked_at_kill + 200, 180,
                             "produce to go on through the new leader")
                    load.producing.clear()
                    load.threads[0].join(60)
                    wait_for(lambda: (committed.append(_committed(pg_dsn, pg_schema)) or True)
                             and load.acked <= load.received, 180,
                             "every acknowledged record to reach the group through the new leader")
                finally:
                    load.close()
                lost = sorted(load.acked - load.received)
                assert lost == [], f"{len(lost)} acknowledged records never delivered: {lost[:5]}"
                seen = [c for c in committed if c is not None]
                assert seen == sorted(seen), f"a committed offset went back: {seen}"
                rows = pg_fetch(pg_dsn, f'SELECT coordinator_epoch FROM "{pg_schema}".consumer_group_offsets')
                assert {r["coordinator_epoch"] for r in rows} == {taken["epoch"]}
            finally:
                actor.terminate()
                actor.wait(30)
