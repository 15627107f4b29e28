"""PostgreSQL offset store through asyncpg (``--offsets postgresql://…``).

Theory of operation
-------------------
One connection, used by one operation at a time (an asyncio lock: asyncpg
refuses concurrent use, and the writer flushes one batch at a time anyway).

A flush is one round trip. The batch goes as one JSON array of rows to
``INSERT … SELECT … FROM jsonb_array_elements($1) ON CONFLICT … DO UPDATE … WHERE <guard>``.
A lone statement outside an explicit block is its own transaction in
PostgreSQL, so the batch commits atomically without the two extra round trips
of ``BEGIN``/``COMMIT``. asyncpg caches the prepared statement, so after the
first flush each one is Bind/Execute/Sync in a single write.

Failures: every operation has a timeout (connect and command), and after any
error the connection is terminated rather than reused, because after a
timeout or a cut network its state is unknown; the next call reconnects.
A statement that timed out may still have committed on the server: the
caller must treat it as *not* durable and write it again, which the monotonic
guard makes harmless.

Fencing (issue 26): an upsert given a coordinator epoch is still one
statement. A CTE locks the lease row ``FOR SHARE`` where its epoch is the
writer's, and the insert joins that CTE, so it writes nothing once another
node has taken the lease. The share lock makes a takeover (an UPDATE of that
row) wait for a flush in progress, and a flush that starts after a takeover
committed re-reads the row (READ COMMITTED re-checks a locked row's newest
version) and finds the epoch moved on: no flush of an older epoch can land
after its successor took over. Metadata writes take the same lock first in
their transaction. No session advisory lock is used for any of this: a
session lock is lost silently when the server fails over, and behind a
transaction-mode pooler the "session" is whichever client borrowed the
server connection last.

Schemas: ``schema=None`` uses ``public``. A named schema is created by
`migrate` if missing. Migrations run in one transaction under an advisory
lock keyed on the schema name, so concurrent migrators take turns.
"""

from __future__ import annotations

import asyncio
import json
from typing import Awaitable, Callable, Iterable, TypeVar

import asyncpg

from zbroker.protocol.errors import StaleEpoch
from zbroker.storage.offsets.base import (
    MIGRATIONS_TABLE, TABLE, OffsetRow, OffsetStore, OffsetStoreError, fold, load_migrations, stored_holes,
    stored_quarantine,
)
from zbroker.storage.offsets.metadata import (
    EPOCHS_TABLE, GROUPS_TABLE, LEASE_TABLE, PARTITIONS_TABLE, TOPICS_TABLE, UNCOUNTED_STEPS, LeaseState, Metadata, MetadataChanges,
    check_lease_request, metadata_from_rows, metadata_steps,
)

T = TypeVar("T")

APPLICATION_NAME = "zbroker-offsets"

# SQLSTATEs with which a server that answers refuses a connection for good: no such
# database (3D000), no such role or not allowed by pg_hba.conf (28000), a wrong
# password (28P01). Retrying cannot mend them; a server that does not answer may come up.
REFUSED_FOR_GOOD = frozenset({"3D000", "28000", "28P01"})

# Raw UTF-8, not \uXXXX escapes: jsonb must turn an escape into the database encoding,
# which fails for any non-ASCII name in a SQL_ASCII database; raw text is converted
# as the text arrays were before.
_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode

# The batch travels as one JSON array of rows, [group, topic, partition, committed,
# holes, generation, reset_epoch], unpacked by the server. Seven parallel arrays
# (unnest) cost asyncpg's encoder a type probe per element: a sixth of the writer's
# CPU at 100,000 advances/s, against one C json.dumps call for the whole batch.
_UPSERT = """
INSERT INTO {s}.{table} AS cur
    (group_id, topic, partition, committed_offset, holes, generation, reset_epoch, updated_at, quarantine)
SELECT r ->> 0, r ->> 1, (r ->> 2)::int4, (r ->> 3)::int8, r -> 4, (r ->> 5)::int8, (r ->> 6)::int8, now(),
       NULLIF(r -> 7, 'null'::jsonb)
FROM jsonb_array_elements($1::text::jsonb) AS u(r)
ON CONFLICT (group_id, topic, partition) DO UPDATE SET
    committed_offset = excluded.committed_offset,
    holes = excluded.holes,
    quarantine = excluded.quarantine,
    generation = excluded.generation,
    reset_epoch = excluded.reset_epoch,
    updated_at = excluded.updated_at,
    coordinator_epoch = 0
WHERE excluded.reset_epoch > cur.reset_epoch
   OR (excluded.reset_epoch = cur.reset_epoch AND excluded.committed_offset >= cur.committed_offset)
"""

# The same upsert fenced by the coordinator epoch ($2), still ONE statement (see the
# module doc for why FOR SHARE makes it safe against a concurrent takeover). It reports
# the rows changed and whether the epoch was current, which "0 rows changed" alone
# cannot tell apart from a batch the monotonic guard ignored.
_FENCED_UPSERT = """
WITH fence AS (
    SELECT epoch FROM {s}.{lease} WHERE id = 1 AND epoch = $2::int8 FOR SHARE
), written AS (
    INSERT INTO {s}.{table} AS cur
        (group_id, topic, partition, committed_offset, holes, generation, reset_epoch, updated_at,
         coordinator_epoch, quarantine)
    SELECT r ->> 0, r ->> 1, (r ->> 2)::int4, (r ->> 3)::int8, r -> 4, (r ->> 5)::int8, (r ->> 6)::int8, now(),
           fence.epoch, NULLIF(r -> 7, 'null'::jsonb)
    FROM jsonb_array_elements($1::text::jsonb) AS u(r) CROSS JOIN fence
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
    RETURNING 1
)
SELECT (SELECT count(*) FROM written) AS changed, EXISTS (SELECT 1 FROM fence) AS current,
       (SELECT epoch FROM {s}.{lease} WHERE id = 1 FOR SHARE) AS epoch
"""
# The last FOR SHARE is for the error's data: locked, the row is read in its newest
# version (the epoch that fenced us), not as the statement's snapshot saw it.

# Take the lease if it is free or has expired by the server's clock (the epoch grows by
# one and the history gets a row), renew it if the caller holds it and it has not
# expired (the epoch stays), and otherwise leave it and report its holder. One
# statement: the row lock of ON CONFLICT serialises nodes that try at once.
_LEASE = """
WITH taken AS (
    INSERT INTO {s}.{lease} AS l (id, holder, endpoint, epoch, taken_at, renewed_at, expires_at)
    VALUES (1, $1, $2, 1, now(), now(), now() + $3::int8 * interval '1 millisecond')
    ON CONFLICT (id) DO UPDATE SET
        holder = excluded.holder,
        endpoint = excluded.endpoint,
        epoch = CASE WHEN l.holder = excluded.holder AND l.expires_at > now() THEN l.epoch ELSE l.epoch + 1 END,
        taken_at = CASE WHEN l.holder = excluded.holder AND l.expires_at > now() THEN l.taken_at ELSE now() END,
        renewed_at = now(),
        expires_at = excluded.expires_at
    WHERE l.expires_at <= now() OR l.holder = excluded.holder
    RETURNING holder, endpoint, epoch, taken_at = now() AS new_epoch, expires_at
), history AS (
    INSERT INTO {s}.{epochs} (epoch, holder, endpoint, taken_at)
    SELECT epoch, holder, endpoint, now() FROM taken WHERE new_epoch
    ON CONFLICT (epoch) DO NOTHING
)
SELECT holder, endpoint, epoch, held,
       greatest(0, ceil(extract(epoch FROM expires_at - now()) * 1000))::int8 AS remaining_ms
FROM (SELECT holder, endpoint, epoch, true AS held, expires_at FROM taken
      UNION ALL
      SELECT holder, endpoint, epoch, false, expires_at FROM {s}.{lease}
      WHERE id = 1 AND NOT EXISTS (SELECT 1 FROM taken)) AS answer
"""

# Metadata change sets travel as JSON arrays, one statement per kind of change; each
# statement's row count must equal its number of items, or the transaction is rolled back.
_META_FENCE = "SELECT epoch FROM {s}.{lease} WHERE id = 1 FOR SHARE"
_META_DELETE_TOPICS = """
DELETE FROM {s}.{topics} AS t USING jsonb_array_elements($1::text::jsonb) AS u(r)
WHERE t.name = r ->> 0 AND t.incarnation = (r ->> 1)::int8
"""
_META_DELETE_PARTITIONS = """
DELETE FROM {s}.{partitions} WHERE topic IN (SELECT r ->> 0 FROM jsonb_array_elements($1::text::jsonb) AS u(r))
"""
_META_CREATE_TOPICS = """
INSERT INTO {s}.{topics} (name, partitions, config, replication_factor, min_insync, incarnation,
                          coordinator_epoch, updated_at)
SELECT r ->> 0, (r ->> 1)::int4, r -> 2, (r ->> 3)::int4, (r ->> 4)::int4, (r ->> 5)::int8, $2::int8, now()
FROM jsonb_array_elements($1::text::jsonb) AS u(r)
ON CONFLICT (name) DO NOTHING
"""
_META_UPDATE_TOPICS = """
UPDATE {s}.{topics} AS t SET partitions = (r ->> 1)::int4, config = r -> 2, replication_factor = (r ->> 3)::int4,
    min_insync = (r ->> 4)::int4, coordinator_epoch = $2::int8, updated_at = now()
FROM jsonb_array_elements($1::text::jsonb) AS u(r)
WHERE t.name = r ->> 0 AND t.incarnation = (r ->> 5)::int8
"""
_META_INSERT_PARTITIONS = """
INSERT INTO {s}.{partitions} (topic, partition, replicas, leader, leader_epoch, isr, coordinator_epoch, updated_at)
SELECT r ->> 0, (r ->> 1)::int4, r -> 2, r ->> 3, (r ->> 4)::int8, r -> 5, $2::int8, now()
FROM jsonb_array_elements($1::text::jsonb) AS u(r)
WHERE EXISTS (SELECT 1 FROM {s}.{topics} AS t WHERE t.name = r ->> 0)
ON CONFLICT (topic, partition) DO NOTHING
"""
_META_UPDATE_PARTITIONS = """
UPDATE {s}.{partitions} AS p SET replicas = r -> 2, leader = r ->> 3, leader_epoch = (r ->> 4)::int8,
    isr = r -> 5, coordinator_epoch = $2::int8, updated_at = now()
FROM jsonb_array_elements($1::text::jsonb) AS u(r)
WHERE p.topic = r ->> 0 AND p.partition = (r ->> 1)::int4 AND p.leader_epoch = (r ->> 6)::int8
"""
_META_UPSERT_GROUP_CONFIGS = """
INSERT INTO {s}.{groups} (group_id, config, coordinator_epoch, updated_at)
SELECT r ->> 0, r -> 1, $2::int8, now() FROM jsonb_array_elements($1::text::jsonb) AS u(r)
ON CONFLICT (group_id) DO UPDATE SET config = excluded.config, coordinator_epoch = excluded.coordinator_epoch,
    updated_at = excluded.updated_at
"""
_META_DELETE_GROUP_CONFIGS = """
DELETE FROM {s}.{groups} WHERE group_id IN (SELECT r ->> 0 FROM jsonb_array_elements($1::text::jsonb) AS u(r))
"""
_META_SELECT_GROUPS = "SELECT group_id, config::text FROM {s}.{groups} ORDER BY group_id"
_META_SELECT_TOPICS = """
SELECT name, partitions, config::text, replication_factor, min_insync, incarnation FROM {s}.{topics} ORDER BY name
"""
_META_SELECT_PARTITIONS = """
SELECT topic, partition, replicas::text, leader, leader_epoch, isr::text FROM {s}.{partitions}
ORDER BY topic, partition
"""


class _ConditionFailed(Exception):
    """A write_metadata condition did not hold: roll the transaction back."""

_SELECT_FIRST = """
SELECT group_id, topic, partition, committed_offset, holes::text AS holes, generation, reset_epoch,
       quarantine::text AS quarantine
FROM {s}.{table} ORDER BY group_id, topic, partition LIMIT $1
"""
# The row comparison and the ORDER BY use the same (column) collation, so pages neither
# overlap nor skip; both walk the primary key's index.
_SELECT_AFTER = """
SELECT group_id, topic, partition, committed_offset, holes::text AS holes, generation, reset_epoch,
       quarantine::text AS quarantine
FROM {s}.{table} WHERE (group_id, topic, partition) > ($1, $2, $3)
ORDER BY group_id, topic, partition LIMIT $4
"""


class PostgresOffsetStore(OffsetStore):
    backend = "postgresql"

    def __init__(self, dsn: str, *, schema: str | None = None, connect_timeout: float = 5.0,
                 command_timeout: float = 5.0, application_name: str = APPLICATION_NAME) -> None:
        self.dsn = dsn
        self.schema = schema
        self.connect_timeout = connect_timeout
        self.command_timeout = command_timeout
        self.application_name = application_name
        self._qualifier = f'"{schema or "public"}"'
        self._conn: asyncpg.Connection | None = None
        self._lock = asyncio.Lock()
        self._stats = {"statements": 0, "connects": 0, "failures": 0}
        self._upsert_sql = _UPSERT.format(s=self._qualifier, table=TABLE)
        self._select_first_sql = _SELECT_FIRST.format(s=self._qualifier, table=TABLE)
        self._select_after_sql = _SELECT_AFTER.format(s=self._qualifier, table=TABLE)
        names = dict(s=self._qualifier, table=TABLE, lease=LEASE_TABLE, epochs=EPOCHS_TABLE,
                     topics=TOPICS_TABLE, partitions=PARTITIONS_TABLE, groups=GROUPS_TABLE)
        self._fenced_upsert_sql = _FENCED_UPSERT.format(**names)
        self._lease_sql = _LEASE.format(**names)
        self._meta = {name: sql.format(**names) for name, sql in (
            ("fence", _META_FENCE), ("delete_topics", _META_DELETE_TOPICS),
            ("delete_partitions", _META_DELETE_PARTITIONS), ("create_topics", _META_CREATE_TOPICS),
            ("update_topics", _META_UPDATE_TOPICS), ("insert_partitions", _META_INSERT_PARTITIONS),
            ("update_partitions", _META_UPDATE_PARTITIONS), ("select_topics", _META_SELECT_TOPICS),
            ("select_partitions", _META_SELECT_PARTITIONS), ("upsert_group_configs", _META_UPSERT_GROUP_CONFIGS),
            ("delete_group_configs", _META_DELETE_GROUP_CONFIGS), ("select_groups", _META_SELECT_GROUPS))}

    # How long this connection may sit idle inside an open transaction before the server ends it.
    IDLE_IN_TRANSACTION_MS = "1000"

    # -- plumbing -------------------------------------------------------------------------

    async def _with_conn(self, operation: str, fn: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
        async with self._lock:
            try:
                if self._conn is None or self._conn.is_closed():
                    self._conn = None
                    self._conn = await asyncpg.connect(
                        self.dsn, timeout=self.connect_timeout, command_timeout=self.command_timeout,
                        # A reply says "durable": make sure the server's commit means it even
                        # where synchronous_commit was turned off for everyone else.
                        server_settings={"application_name": self.application_name,
                                         "synchronous_commit": "on",
                                         # A writer paused (SIGSTOP) inside write_metadata's
                                         # transaction would hold its FOR SHARE lock on the
                                         # lease row, and with it every takeover, for as long
                                         # as it stays paused: the server ends such a session.
                                         # Its statements follow each other within milliseconds.
                                         "idle_in_transaction_session_timeout": self.IDLE_IN_TRANSACTION_MS})
                    self._stats["connects"] += 1
                return await fn(self._conn)
            except BaseException as exc:
                # Unknown connection state after any failure (even a cancellation):
                # drop it so that the next call starts clean.
                self._stats["failures"] += 1
                self._drop()
                if isinstance(exc, Exception) and not isinstance(exc, OffsetStoreError):
                    raise OffsetStoreError(
                        f"postgresql {operation} failed: {type(exc).__name__}: {exc}",
                        backend=self.backend, operation=operation, cause=type(exc).__name__,
                        sqlstate=getattr(exc, "sqlstate", None)) from exc
                raise

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            conn.terminate()

    # -- OffsetStore ----------------------------------------------------------------------

    async def connect(self) -> None:
        async def noop(conn: asyncpg.Connection) -> None:
            return None

        await self._with_conn("connect", noop)

    async def migrate(self) -> list[int]:
        migrations = load_migrations("postgres")
        q = self._qualifier
        schema = self.schema or "public"

        async def run(conn: asyncpg.Connection) -> list[int]:
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", f"zbroker-migrate:{schema}")
                # Checked first: CREATE SCHEMA IF NOT EXISTS still needs CREATE on the database.
                if not await conn.fetchval("SELECT true FROM pg_namespace WHERE nspname = $1", schema):
                    await conn.execute(f"CREATE SCHEMA {q}")
                await conn.execute(f"CREATE TABLE IF NOT EXISTS {q}.{MIGRATIONS_TABLE} ("
                                   "version integer PRIMARY KEY, name text NOT NULL, "
                                   "applied_at timestamptz NOT NULL DEFAULT now())")
                done = {r[0] for r in await conn.fetch(f"SELECT version FROM {q}.{MIGRATIONS_TABLE}")}
                applied = []
                for mig in migrations:
                    if mig.version in done:
                        continue
                    await conn.execute(mig.sql.replace("{schema}", q))
                    await conn.execute(f"INSERT INTO {q}.{MIGRATIONS_TABLE} (version, name) VALUES ($1, $2)",
                                       mig.version, mig.name)
                    applied.append(mig.version)
                return applied

        return await self._with_conn("migrate", run)

    async def upsert(self, rows: Iterable[OffsetRow], coordinator_epoch: int | None = None) -> int:
        batch = fold(rows)
        if not batch:
            return 0
        payload = _dumps([[r.group_id, r.topic, r.partition, r.committed_offset, r.holes, r.generation,
                           r.reset_epoch, r.quarantine_or_none()] for r in batch])

        async def run(conn: asyncpg.Connection) -> int:
            self._stats["statements"] += 1
            status = await conn.execute(self._upsert_sql, payload)
            return int(status.rsplit(" ", 1)[-1])  # "INSERT 0 <rows changed>"

        async def run_fenced(conn: asyncpg.Connection) -> int:
            self._stats["statements"] += 1
            changed, current, epoch = await conn.fetchrow(self._fenced_upsert_sql, payload, coordinator_epoch)
            return changed if current else -1 - (epoch or 0)

        if coordinator_epoch is None:
            return await self._with_conn("upsert", run)
        changed = await self._with_conn("upsert", run_fenced)
        if changed < 0:
            current = -1 - changed
            raise StaleEpoch("the coordinator epoch of this write is no longer the lease's: nothing written",
                             epoch=current or None, got=coordinator_epoch, operation="upsert")
        return changed

    async def load_metadata(self) -> Metadata:
        meta = self._meta

        async def run(conn: asyncpg.Connection) -> Metadata:
            self._stats["statements"] += 3
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                topics = await conn.fetch(meta["select_topics"])
                parts = await conn.fetch(meta["select_partitions"])
                groups = await conn.fetch(meta["select_groups"])
            return metadata_from_rows(topics, parts, groups)

        return await self._with_conn("load_metadata", run)

    async def write_metadata(self, changes: MetadataChanges, coordinator_epoch: int) -> bool:
        meta = self._meta
        steps = metadata_steps(changes)

        async def run(conn: asyncpg.Connection) -> bool:
            try:
                async with conn.transaction():
                    self._stats["statements"] += 1
                    if await conn.fetchval(meta["fence"]) != coordinator_epoch:
                        raise _ConditionFailed
                    for name, items in steps:
                        self._stats["statements"] += 1
                        # Deletions record no epoch: they take only the items.
                        args = (_dumps(items),) if name.startswith("delete") else (_dumps(items), coordinator_epoch)
                        status = await conn.execute(meta[name], *args)
                        if name not in UNCOUNTED_STEPS and int(status.rsplit(" ", 1)[-1]) != len(items):
                            raise _ConditionFailed
            except _ConditionFailed:
                return False
            return True

        return await self._with_conn("write_metadata", run)

    async def acquire_or_renew_lease(self, node_id: str, endpoint: str, lease_ms: int) -> LeaseState:
        check_lease_request(node_id, endpoint, lease_ms)

        async def run(conn: asyncpg.Connection) -> LeaseState:
            # No answer happens once: nodes racing for a lease that did not exist yet, the
            # loser's statement found the winner's row on conflict, but its snapshot (taken
            # before that row committed) cannot read it. A second statement can.
            for _attempt in range(2):
                self._stats["statements"] += 1
                answer = await conn.fetchrow(self._lease_sql, node_id, endpoint, lease_ms)
                if answer is not None:
                    holder, holder_endpoint, epoch, held, remaining = answer
                    return LeaseState(holder, holder_endpoint, epoch, held, remaining)
            raise OffsetStoreError("the coordinator lease row neither could be taken nor read",
                                   backend=self.backend, operation="acquire_or_renew_lease")

        return await self._with_conn("acquire_or_renew_lease", run)

    async def load_page(self, after: tuple[str, str, int] | None, limit: int) -> list[OffsetRow]:
        async def run(conn: asyncpg.Connection) -> list[OffsetRow]:
            if after is None:
                records = await conn.fetch(self._select_first_sql, limit)
            else:
                records = await conn.fetch(self._select_after_sql, *after, limit)
            return [OffsetRow(r[0], r[1], r[2], r[3], stored_holes(r[4], (r[0], r[1], r[2])), r[5], r[6],
                              stored_quarantine(r[7], (r[0], r[1], r[2])))
                    for r in records]

        return await self._with_conn("load_page", run)

    async def ping(self) -> None:
        async def run(conn: asyncpg.Connection) -> None:
            await conn.fetchval("SELECT 1")

        await self._with_conn("ping", run)

    async def close(self) -> None:
        async with self._lock:
            conn, self._conn = self._conn, None
            if conn is None or conn.is_closed():
                return
            try:
                await conn.close(timeout=self.connect_timeout)
            except Exception:
                conn.terminate()

    def statistics(self) -> dict[str, int]:
        return dict(self._stats)


def refused_for_good(store: PostgresOffsetStore) -> str | None:
    """Connect once: why the server refuses this store for good, or None (connected, or
    not answering, which the commit writer's retries are for)."""

    async def probe() -> None:
        try:
            await store.connect()
        finally:
            await store.close()

    try:
        asyncio.run(probe())
    except OffsetStoreError as err:
        if err.data.get("sqlstate") in REFUSED_FOR_GOOD:
            return err.message
    return None
