"""Nodes of one cluster on one PostgreSQL schema (issue 26), as real `zbroker up` processes on
their own loopback addresses: a standby redirects with NOT_COORDINATOR to the leader, and
a leader paused past its lease wakes up able to change nothing, proved by a query of the
rows' coordinator_epoch."""

from __future__ import annotations

import contextlib
import os
import signal

import asyncpg
import pytest
import zmq

from zbroker.client import Admin, Consumer, Producer
from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.errors import NotCoordinator, StaleLease
from zbroker.supervisor import start_broker
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
