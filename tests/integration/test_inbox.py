"""The transactional inbox on real processes: a consumer SIGKILLed between the database
commit and the ack, and each record's effect is in the database exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psycopg
import pytest

from zbroker.client import Admin, Producer
from zbroker.client.inbox import Inbox, migrate_inbox
from tests.integration.test_consumer_groups import wait_committed

pytestmark = pytest.mark.processes

TOTAL = 300
KILL_AT = 120  # the consumer dies right after the 120th record's transaction commits

# One consumer process: the inbox on its own psycopg connection (not autocommit: the
# inbox's transaction block must commit by itself). Prints what it does, flushed, so the
# test knows which record it died on and which redeliveries it found done.
CONSUMER = r"""
import os, signal, sys
import psycopg
from zbroker.client import Admin, Consumer
from zbroker.client.inbox import Inbox

url, dsn, schema, kill_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
db = psycopg.connect(dsn)
handled = 0

def handler(conn, rec):
    conn.execute(f'INSERT INTO "{schema}".effects (topic, partition, "offset", value) VALUES (%s, %s, %s, %s)',
                 (rec.topic, rec.partition, rec.offset, rec.value))

def after_commit(rec):
    global handled
    handled += 1
    if handled == kill_at:
        print(f"killed {rec.partition} {rec.offset}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # committed, not acked

with Admin(url) as admin, Consumer(url, group="ib", topics=["inb"], session_timeout_ms=30_000) as consumer:
    inbox = Inbox(consumer, db, admin, table=f"{schema}.inbox", prune_every=50, after_commit=after_commit)
    print("ready", flush=True)
    while True:
        for rec in consumer.poll(100, timeout=0.2):
            if not inbox.handle(rec, handler):
                print(f"done-before {rec.partition} {rec.offset}", flush=True)
        consumer.flush_acks()
"""


def start_consumer(url: str, dsn: str, schema: str, kill_at: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CONSUMER, url, dsn, schema, str(kill_at)],
                            stdout=subprocess.PIPE, text=True, cwd=os.getcwd())


def effects(dsn: str, schema: str) -> list[tuple]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(f'SELECT partition, "offset" FROM "{schema}".effects').fetchall()


def test_sigkill_between_commit_and_ack_leaves_each_effect_exactly_once(broker, pg_dsn, pg_schema):
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(f'CREATE TABLE "{pg_schema}".effects (topic text, partition int, "offset" bigint, value bytea)')
        migrate_inbox(conn, f"{pg_schema}.inbox")
        conn.commit()
    with Admin(broker.url) as admin:
        admin.create_topic("inb", partitions=2)
        # Shared, with a short lease: the dead member's records come back to the next one.
        admin.configure_group("ib", mode="shared", ack_timeout_ms=2_000)
    with Producer(broker.url, linger_ms=1) as producer:
        producer.produce("inb", [(f"k{i}".encode(), f"v{i}".encode()) for i in range(TOTAL)])

    first = start_consumer(broker.url, pg_dsn, pg_schema, KILL_AT)
    out, _ = first.communicate(timeout=120)
    assert first.returncode == -signal.SIGKILL, out
    killed = next(line.split()[1:] for line in out.splitlines() if line.startswith("killed"))
    killed = (int(killed[0]), int(killed[1]))
    assert killed in effects(pg_dsn, pg_schema)  # the commit happened before the kill

    second = start_consumer(broker.url, pg_dsn, pg_schema, 0)
    try:
        with Admin(broker.url) as admin:
            ends = {("inb", p["partition"]): p["log_end"] for p in admin.describe_topic("inb")["partitions"]}
            wait_committed(admin, "ib", ends, timeout=120)
            rows = effects(pg_dsn, pg_schema)
            assert sorted(rows) == sorted((p, o) for (_t, p), end in ends.items() for o in range(end))  # once each
            # The inbox is pruned below the durable committed offset: one last prune empties it.
            with psycopg.connect(pg_dsn) as conn:
                Inbox(None, conn, admin, group="ib", table=f"{pg_schema}.inbox").prune()
                left = conn.execute(f'SELECT count(*) FROM "{pg_schema}".inbox').fetchone()[0]
            assert left == 0
    finally:
        second.send_signal(signal.SIGTERM)
        out, _ = second.communicate(timeout=30)
    done_before = {(int(p), int(o)) for tag, p, o in (line.split() for line in out.splitlines()
                                                      if line.startswith("done-before"))}
    assert killed in done_before  # redelivered, found done, acked without running the handler

