"""Both inbox drivers against a real PostgreSQL (in a schema of the test's own).

The consumer and admin are stand-ins with only the methods the inbox calls (ack,
describe_group), so what is tested is the database side: one row and one effect
per record, the handler skipped for a record done before, a failing handler
rolling back both, and pruning below the durable committed offset.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import asyncpg
import psycopg
import pytest

from zbroker.client.inbox import AsyncInbox, Inbox, InboxTransactionOpen, migrate_inbox, migrate_inbox_async


class Acks:
    group = "g"

    def __init__(self) -> None:
        self.acked: list = []

    def ack(self, record) -> None:
        self.acked.append(record.offset)


class AsyncAcks(Acks):
    async def ack(self, record) -> None:
        self.acked.append(record.offset)


class Report:
    def __init__(self, committed: int) -> None:
        self.committed = committed

    def describe_group(self, group: str) -> dict:
        return {"partitions": [{"topic": "t", "partition": 0, "committed": self.committed}]}


class AsyncReport(Report):
    async def describe_group(self, group: str) -> dict:
        return Report.describe_group(self, group)


def rec(offset: int):
    return SimpleNamespace(topic="t", partition=0, offset=offset, value=b"v%d" % offset)


def test_the_sync_inbox_runs_each_record_once_and_prunes(pg_dsn, pg_schema):
    with psycopg.connect(pg_dsn) as db:
        db.execute(f'CREATE TABLE "{pg_schema}".effects ("offset" bigint)')
        db.commit()
        migrate_inbox(db, f"{pg_schema}.inbox")
        consumer, admin = Acks(), Report(committed=2)
        inbox = Inbox(consumer, db, admin, table=f"{pg_schema}.inbox")

        def handler(conn, r):
            conn.execute(f'INSERT INTO "{pg_schema}".effects VALUES (%s)', (r.offset,))

        assert [inbox.handle(rec(o), handler) for o in (0, 1, 2, 1)] == [True, True, True, False]
        assert consumer.acked == [0, 1, 2, 1]

        def boom(conn, r):
            handler(conn, r)
            raise RuntimeError("no")

        with pytest.raises(RuntimeError):
            inbox.handle(rec(3), boom)
        assert consumer.acked == [0, 1, 2, 1]  # not acked
        db.execute("SELECT 1")  # an open transaction: the inbox will not nest in it
        with pytest.raises(InboxTransactionOpen):
            inbox.handle(rec(4), handler)
        db.rollback()
        assert inbox.prune() == 2  # offsets 0 and 1, below the durable committed offset 2
        with psycopg.connect(pg_dsn) as other:  # what is committed, seen from elsewhere
            effects = [r[0] for r in other.execute(f'SELECT "offset" FROM "{pg_schema}".effects ORDER BY 1')]
            left = [r[0] for r in other.execute(f'SELECT "offset" FROM "{pg_schema}".inbox ORDER BY 1')]
        assert effects == [0, 1, 2] and left == [2]


def test_the_asyncio_inbox_runs_each_record_once_and_prunes(pg_dsn, pg_schema):
    async def body():
        db = await asyncpg.connect(pg_dsn)
        try:
            await db.execute(f'CREATE TABLE "{pg_schema}".effects ("offset" bigint)')
            await migrate_inbox_async(db, f"{pg_schema}.inbox")
            consumer = AsyncAcks()
            inbox = AsyncInbox(consumer, db, AsyncReport(committed=1), table=f"{pg_schema}.inbox")

            async def handler(conn, r):
                await conn.execute(f'INSERT INTO "{pg_schema}".effects VALUES ($1)', r.offset)

            assert [await inbox.handle(rec(o), handler) for o in (0, 1, 0)] == [True, True, False]
            assert consumer.acked == [0, 1, 0]
            assert await inbox.prune() == 1
            assert [r[0] for r in await db.fetch(f'SELECT "offset" FROM "{pg_schema}".effects ORDER BY 1')] == [0, 1]
        finally:
            await db.close()

    asyncio.run(body())
