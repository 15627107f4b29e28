"""SQLite offset store: the embedded default (``--offsets sqlite:///path``).

Theory of operation
-------------------
The stdlib ``sqlite3`` module blocks, so every call runs on one dedicated
worker thread (the connection never changes threads) and the event loop only
awaits it. The connection is in autocommit mode: the upsert is a single
statement and so its own transaction, and migrations open an explicit
``BEGIN IMMEDIATE`` (which also serialises two processes migrating at once).

Durability: WAL journal with ``synchronous=FULL``, so a committed batch has
been fsynced before `upsert` returns, and survives power loss, not only a
process crash. That costs one fsync per flush, which the writer's batching
keeps to at most ~100 a second.

The batch travels as one JSON parameter unpacked by ``json_each`` into
``INSERT … SELECT``: SQLite has no array parameters, and this keeps "one
statement per flush" true on both backends. A ``schema`` is an attached
database file ``<path>.<schema>`` so that SQL text names tables the same way
as on PostgreSQL (``"schema".consumer_group_offsets``).

Cluster metadata: SQLite is a cluster of one. The coordinator lease is always
this node's, at epoch 1 (`SINGLE_NODE_EPOCH`), and is not stored; a fenced
upsert or metadata write naming any other epoch is refused. Topics and
partition states are stored as on PostgreSQL, each change set in one
``BEGIN IMMEDIATE`` transaction.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import sqlite3
import time
from typing import Callable, Iterable, TypeVar

from zbroker.protocol.errors import StaleEpoch
from zbroker.storage.offsets.base import (
    MIGRATIONS_TABLE, TABLE, OffsetRow, OffsetStore, OffsetStoreError, fold, load_migrations, stored_holes,
    stored_quarantine,
)
from zbroker.storage.offsets.metadata import (
    GROUPS_TABLE, PARTITIONS_TABLE, SINGLE_NODE_EPOCH, TOPICS_TABLE, UNCOUNTED_STEPS, LeaseState, Metadata, MetadataChanges,
    check_lease_request, metadata_from_rows, metadata_steps,
)

T = TypeVar("T")

_UPSERT = """
INSERT INTO {s}.{table} AS cur
    (group_id, topic, partition, committed_offset, holes, generation, reset_epoch, updated_at, coordinator_epoch,
     quarantine)
SELECT value ->> 0, value ->> 1, value ->> 2, value ->> 3, value ->> 4, value ->> 5, value ->> 6, ?, ?, value ->> 7
FROM json_each(?) WHERE true
ON CONFLICT (group_id, topic, partition) DO UPDATE SET
    committed_offset = excluded.committed_offset,
    holes = excluded.holes,
    quarantine = excluded.quarantine,
    generation = excluded.generation,
    reset_epoch = excluded.reset_epoch,
    updated_at = excluded.updated_at,
    coordinator_epoch = excluded.coordinator_epoch
WHERE excluded.reset_epoch > cur.reset_epoch
   OR (excluded.reset_epoch = cur.reset_epoch AND excluded.committed_offset >= cur.committed_offset)
"""
# "WHERE true" is required: without it SQLite parses "ON CONFLICT" as a join constraint.
# value ->> 4 yields the holes array as JSON text, which is what the column stores;
# value ->> 7 the quarantine likewise, or NULL for JSON null.

_SELECT_FIRST = """
SELECT group_id, topic, partition, committed_offset, holes, generation, reset_epoch, quarantine
FROM {s}.{table} ORDER BY group_id, topic, partition LIMIT ?
"""
_SELECT_AFTER = """
SELECT group_id, topic, partition, committed_offset, holes, generation, reset_epoch, quarantine
FROM {s}.{table} WHERE (group_id, topic, partition) > (?, ?, ?)
ORDER BY group_id, topic, partition LIMIT ?
"""

# Metadata statements, as on PostgreSQL (see postgres.py): JSON items through json_each,
# each statement's row count checked against its number of items. :items, :epoch, :now.
_META = {
    "delete_topics": """
DELETE FROM {s}.{topics} WHERE EXISTS (
    SELECT 1 FROM json_each(:items) AS u WHERE u.value ->> 0 = name AND u.value ->> 1 = incarnation)
""",
    "delete_partitions": """
DELETE FROM {s}.{partitions} WHERE topic IN (SELECT u.value ->> 0 FROM json_each(:items) AS u)
""",
    "create_topics": """
INSERT INTO {s}.{topics} (name, partitions, config, replication_factor, min_insync, incarnation,
                          coordinator_epoch, updated_at)
SELECT value ->> 0, value ->> 1, value -> 2, value ->> 3, value ->> 4, value ->> 5, :epoch, :now
FROM json_each(:items) WHERE true
ON CONFLICT (name) DO NOTHING
""",
    "update_topics": """
UPDATE {s}.{topics} AS t SET partitions = u.value ->> 1, config = u.value -> 2, replication_factor = u.value ->> 3,
    min_insync = u.value ->> 4, coordinator_epoch = :epoch, updated_at = :now
FROM json_each(:items) AS u
WHERE t.name = u.value ->> 0 AND t.incarnation = u.value ->> 5
""",
    "insert_partitions": """
INSERT INTO {s}.{partitions} (topic, partition, replicas, leader, leader_epoch, isr, coordinator_epoch, updated_at)
SELECT value ->> 0, value ->> 1, value -> 2, value ->> 3, value ->> 4, value -> 5, :epoch, :now
FROM json_each(:items) WHERE EXISTS (SELECT 1 FROM {s}.{topics} AS t WHERE t.name = value ->> 0)
ON CONFLICT (topic, partition) DO NOTHING
""",
    "update_partitions": """
UPDATE {s}.{partitions} AS p SET replicas = u.value -> 2, leader = u.value ->> 3, leader_epoch = u.value ->> 4,
    isr = u.value -> 5, coordinator_epoch = :epoch, updated_at = :now
FROM json_each(:items) AS u
WHERE p.topic = u.value ->> 0 AND p.partition = u.value ->> 1 AND p.leader_epoch = u.value ->> 6
""",
    "upsert_group_configs": """
INSERT INTO {s}.{groups} (group_id, config, coordinator_epoch, updated_at)
SELECT value ->> 0, value -> 1, :epoch, :now FROM json_each(:items) WHERE true
ON CONFLICT (group_id) DO UPDATE SET config = excluded.config, coordinator_epoch = excluded.coordinator_epoch,
    updated_at = excluded.updated_at
""",
    "delete_group_configs": """
DELETE FROM {s}.{groups} WHERE group_id IN (SELECT u.value ->> 0 FROM json_each(:items) AS u)
""",
}
_SELECT_GROUPS = "SELECT group_id, config FROM {s}.{groups} ORDER BY group_id"
_SELECT_TOPICS = """
SELECT name, partitions, config, replication_factor, min_insync, incarnation FROM {s}.{topics} ORDER BY name
"""
_SELECT_PARTITIONS = """
SELECT topic, partition, replicas, leader, leader_epoch, isr FROM {s}.{partitions} ORDER BY topic, partition
"""


class SQLiteOffsetStore(OffsetStore):
    backend = "sqlite"

    def __init__(self, path: str, *, schema: str | None = None, busy_timeout_ms: int = 5000,
                 trace: Callable[[str], None] | None = None) -> None:
        """`trace`, if given, is called with the text of every statement SQLite runs (debugging)."""
        self.path = path
        self._trace = trace
        self.schema = schema
        self._busy_timeout_ms = busy_timeout_ms
        self._qualifier = f'"{schema}"' if schema else "main"
        self._conn: sqlite3.Connection | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._stats = {"statements": 0, "connects": 0}
        self._upsert_sql = _UPSERT.format(s=self._qualifier, table=TABLE)
        self._select_first_sql = _SELECT_FIRST.format(s=self._qualifier, table=TABLE)
        self._select_after_sql = _SELECT_AFTER.format(s=self._qualifier, table=TABLE)
        names = dict(s=self._qualifier, topics=TOPICS_TABLE, partitions=PARTITIONS_TABLE, groups=GROUPS_TABLE)
        self._meta = {name: sql.format(**names) for name, sql in _META.items()}
        self._select_topics_sql = _SELECT_TOPICS.format(**names)
        self._select_partitions_sql = _SELECT_PARTITIONS.format(**names)
        self._select_groups_sql = _SELECT_GROUPS.format(**names)

    # -- plumbing -------------------------------------------------------------------------

    async def _call(self, operation: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="zbroker-sqlite")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, self._on_thread, fn)
        except OffsetStoreError:
            raise
        except (sqlite3.Error, OSError) as exc:
            raise OffsetStoreError(f"sqlite {operation} failed: {exc}", backend=self.backend,
                                   operation=operation, cause=type(exc).__name__) from exc

    def _on_thread(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._conn is None:
            self._conn = self._open()
        return fn(self._conn)

    def _open(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=self._busy_timeout_ms / 1000)
        try:
            if self._trace is not None:
                conn.set_trace_callback(self._trace)
            if self.schema:
                attached = ":memory:" if self.path == ":memory:" else f"{self.path}.{self.schema}"
                conn.execute(f'ATTACH DATABASE ? AS "{self.schema}"', (attached,))
            self._use_wal(conn)
            conn.execute(f"PRAGMA {self._qualifier}.synchronous=FULL")
        except BaseException:
            conn.close()
            raise
        self._stats["connects"] += 1
        return conn

    def _use_wal(self, conn: sqlite3.Connection) -> None:
        # WAL is a property of the file, set once. Switching needs an exclusive lock and
        # SQLite reports "locked" at once, without its busy handler, when another connection
        # is doing the same: retry for as long as a busy wait would have lasted.
        deadline = time.monotonic() + self._busy_timeout_ms / 1000
        while True:
            mode = conn.execute(f"PRAGMA {self._qualifier}.journal_mode").fetchone()[0]
            if mode in ("wal", "memory"):
                return
            try:
                conn.execute(f"PRAGMA {self._qualifier}.journal_mode=WAL")
                return
            except sqlite3.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    # -- OffsetStore ----------------------------------------------------------------------

    async def connect(self) -> None:
        await self._call("connect", lambda conn: None)

    async def migrate(self) -> list[int]:
        migrations = load_migrations(self.backend)
        q = self._qualifier

        def run(conn: sqlite3.Connection) -> list[int]:
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute(f"CREATE TABLE IF NOT EXISTS {q}.{MIGRATIONS_TABLE} ("
                             "version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at INTEGER NOT NULL)")
                done = {v for (v,) in conn.execute(f"SELECT version FROM {q}.{MIGRATIONS_TABLE}")}
                applied = []
                for mig in migrations:
                    if mig.version in done:
                        continue
                    for statement in _statements(mig.sql.replace("{schema}", q)):
                        conn.execute(statement)
                    conn.execute(f"INSERT INTO {q}.{MIGRATIONS_TABLE} (version, name, applied_at) "
                                 "VALUES (?, ?, ?)", (mig.version, mig.name, int(time.time() * 1000)))
                    applied.append(mig.version)
                conn.execute("COMMIT")
                return applied
            except BaseException:
                conn.execute("ROLLBACK")
                raise

        return await self._call("migrate", run)

    async def upsert(self, rows: Iterable[OffsetRow], coordinator_epoch: int | None = None) -> int:
        batch = fold(rows)
        if not batch:
            return 0
        if coordinator_epoch is not None and coordinator_epoch != SINGLE_NODE_EPOCH:
            raise StaleEpoch("SQLite is a cluster of one at coordinator epoch 1: nothing written",
                             epoch=SINGLE_NODE_EPOCH, got=coordinator_epoch, operation="upsert")
        epoch = coordinator_epoch or 0
        payload = json.dumps([[r.group_id, r.topic, r.partition, r.committed_offset,
                               [list(h) for h in r.holes], r.generation, r.reset_epoch, r.quarantine_or_none()]
                              for r in batch],
                             separators=(",", ":"))
        now_ms = int(time.time() * 1000)

        def run(conn: sqlite3.Connection) -> int:
            self._stats["statements"] += 1
            return conn.execute(self._upsert_sql, (now_ms, epoch, payload)).rowcount

        return await self._call("upsert", run)

    async def load_metadata(self) -> Metadata:
        def run(conn: sqlite3.Connection) -> Metadata:
            conn.execute("BEGIN")  # one snapshot for both reads
            try:
                topics = conn.execute(self._select_topics_sql).fetchall()
                parts = conn.execute(self._select_partitions_sql).fetchall()
                groups = conn.execute(self._select_groups_sql).fetchall()
            finally:
                conn.execute("COMMIT")
            return metadata_from_rows(topics, parts, groups)

        return await self._call("load_metadata", run)

    async def write_metadata(self, changes: MetadataChanges, coordinator_epoch: int) -> bool:
        if coordinator_epoch != SINGLE_NODE_EPOCH:
            return False
        steps = [(name, json.dumps(items, separators=(",", ":"))) for name, items in metadata_steps(changes)]
        counts = [len(items) for _name, items in metadata_steps(changes)]
        now_ms = int(time.time() * 1000)

        def run(conn: sqlite3.Connection) -> bool:
            conn.execute("BEGIN IMMEDIATE")
            try:
                for (name, payload), expected in zip(steps, counts):
                    changed = conn.execute(self._meta[name], {"items": payload, "epoch": coordinator_epoch,
                                                               "now": now_ms}).rowcount
                    if name not in UNCOUNTED_STEPS and changed != expected:
                        conn.execute("ROLLBACK")
                        return False
                conn.execute("COMMIT")
                return True
            except BaseException:
                conn.execute("ROLLBACK")
                raise

        return await self._call("write_metadata", run)

    async def acquire_or_renew_lease(self, node_id: str, endpoint: str, lease_ms: int) -> LeaseState:
        check_lease_request(node_id, endpoint, lease_ms)
        return LeaseState(node_id, endpoint, SINGLE_NODE_EPOCH, True, lease_ms)

    async def load_page(self, after: tuple[str, str, int] | None, limit: int) -> list[OffsetRow]:
        def run(conn: sqlite3.Connection) -> list[OffsetRow]:
            cursor = (conn.execute(self._select_first_sql, (limit,)) if after is None
                      else conn.execute(self._select_after_sql, (*after, limit)))
            return [OffsetRow(g, t, p, c, stored_holes(h, (g, t, p)), gen, ep, stored_quarantine(q, (g, t, p)))
                    for g, t, p, c, h, gen, ep, q in cursor]

        return await self._call("load_page", run)

    async def ping(self) -> None:
        await self._call("ping", lambda conn: conn.execute("SELECT 1").fetchall())

    async def close(self) -> None:
        executor, self._executor = self._executor, None
        if executor is None:
            return

        def shut() -> None:
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.close()

        try:
            await asyncio.get_running_loop().run_in_executor(executor, shut)
        finally:
            executor.shutdown(wait=True)

    def statistics(self) -> dict[str, int]:
        return dict(self._stats)


def _statements(script: str) -> list[str]:
    """Split a migration into statements (executescript would COMMIT our transaction)."""
    out, buf = [], ""
    for line in script.splitlines(keepends=True):
        if line.lstrip().startswith("--"):
            continue
        buf += line
        if sqlite3.complete_statement(buf):
            out.append(buf.strip())
            buf = ""
    if buf.strip():
        out.append(buf.strip())
    return out
