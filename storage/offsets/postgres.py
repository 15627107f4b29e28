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

Schemas: ``schema=None`` uses ``public``. A named schema is created by
`migrate` if missing. Migrations run in one transaction under an advisory
lock keyed on the schema name, so concurrent migrators take turns.
"""

from __future__ import annotations

import asyncio
import json
from typing import Awaitable, Callable, Iterable, TypeVar

import asyncpg

from zbroker.storage.offsets.base import (
    MIGRATIONS_TABLE, TABLE, OffsetRow, OffsetStore, OffsetStoreError, fold, load_migrations, stored_holes,
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
    (group_id, topic, partition, committed_offset, holes, generation, reset_epoch, updated_at)
SELECT r ->> 0, r ->> 1, (r ->> 2)::int4, (r ->> 3)::int8, r -> 4, (r ->> 5)::int8, (r ->> 6)::int8, now()
FROM jsonb_array_elements($1::text::jsonb) AS u(r)
ON CONFLICT (group_id, topic, partition) DO UPDATE SET
    committed_offset = excluded.committed_offset,
    holes = excluded.holes,
    generation = excluded.generation,
    reset_epoch = excluded.reset_epoch,
    updated_at = excluded.updated_at
WHERE excluded.reset_epoch > cur.reset_epoch
   OR (excluded.reset_epoch = cur.reset_epoch AND excluded.committed_offset >= cur.committed_offset)
"""

_SELECT_FIRST = """
SELECT group_id, topic, partition, committed_offset, holes::text AS holes, generation, reset_epoch
FROM {s}.{table} ORDER BY group_id, topic, partition LIMIT $1
"""
# The row comparison and the ORDER BY use the same (column) collation, so pages neither
# overlap nor skip; both walk the primary key's index.
_SELECT_AFTER = """
SELECT group_id, topic, partition, committed_offset, holes::text AS holes, generation, reset_epoch
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
                                         "synchronous_commit": "on"})
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

    async def upsert(self, rows: Iterable[OffsetRow]) -> int:
        batch = fold(rows)
        if not batch:
            return 0
        payload = _dumps([[r.group_id, r.topic, r.partition, r.committed_offset, r.holes, r.generation,
                           r.reset_epoch] for r in batch])

        async def run(conn: asyncpg.Connection) -> int:
            self._stats["statements"] += 1
            status = await conn.execute(self._upsert_sql, payload)
            return int(status.rsplit(" ", 1)[-1])  # "INSERT 0 <rows changed>"

        return await self._with_conn("upsert", run)

    async def load_page(self, after: tuple[str, str, int] | None, limit: int) -> list[OffsetRow]:
        async def run(conn: asyncpg.Connection) -> list[OffsetRow]:
            if after is None:
                records = await conn.fetch(self._select_first_sql, limit)
            else:
                records = await conn.fetch(self._select_after_sql, *after, limit)
            return [OffsetRow(r[0], r[1], r[2], r[3], stored_holes(r[4], (r[0], r[1], r[2])), r[5], r[6])
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
