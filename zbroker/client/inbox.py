"""The transactional inbox: exactly-once effects in the handler's own PostgreSQL database.

Theory of operation
-------------------
A consumer delivers each record at least once. The inbox turns that into
exactly-once *effects in one database* by making "this record is done" part of
the same transaction as the handler's writes:

1. ``BEGIN`` on the user's own connection;
2. ``INSERT INTO <inbox> (group_id, topic, partition, "offset") ... ON CONFLICT
   DO NOTHING RETURNING 1``: a row comes back if this record was never done. If
   another transaction is doing the same record right now (a lease timed out
   and the record went to a second member), the insert waits on the primary key
   until that one ends, then finds its row;
3. the handler runs on the same connection, only if the row was new;
4. ``COMMIT``; only then is the record acked. A crash before the commit rolls
   back the row and the effects together (the record comes again and runs
   again); a crash after it leaves both (the record comes again, finds its row
   and is acked without running the handler).

The table is pruned below the group's *durable* committed offset (what the
coordinator's store holds, `describe_group`'s ``committed``): a record below it
is never delivered again, so its row can go. Pruning runs every
``prune_every`` records handled, so the table holds about the records between
the durable committed offset and the newest, whatever the topic's size.

This module has an I/O-free part (`InboxPlan`: the SQL, the parameters, when to
prune and what) and two thin drivers over it: `AsyncInbox` for the asyncio
client on an asyncpg connection, and `Inbox` for the sync client on a psycopg
(3) connection. The sync driver takes psycopg rather than running asyncpg in a
private event loop because a sync application's handler is sync code that
already holds a sync connection: with asyncpg in a loop the handler would have
to be a coroutine run by our loop, or its writes would go through a connection
it cannot use directly. Neither driver imports its database library: each only
calls methods on the connection it is given.

What it guarantees, and what not: docs/SEMANTICS.md, "Transactional inbox".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

DEFAULT_TABLE = "zbroker_inbox"
DEFAULT_PRUNE_EVERY = 1000

# The migration: one table, its primary key the record's identity within its group.
# docs/SEMANTICS.md shows the same statement, for users who run migrations themselves.
INBOX_DDL = """CREATE TABLE IF NOT EXISTS {table} (
    group_id  text        NOT NULL,
    topic     text        NOT NULL,
    partition integer     NOT NULL,
    "offset"  bigint      NOT NULL,
    done_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (group_id, topic, partition, "offset")
)"""

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]{0,62}$")


def quote_table(name: str) -> str:
    """``table`` or ``schema.table`` as a quoted SQL identifier; anything else is refused."""
    parts = name.split(".")
    if not 1 <= len(parts) <= 2 or not all(_NAME.match(p) for p in parts):
        raise ValueError(f"inbox table must be 'table' or 'schema.table' of plain identifiers, not {name!r}")
    return ".".join(f'"{p}"' for p in parts)


@dataclass(frozen=True)
class InboxSQL:
    """The three statements, with the placeholders of one driver ($1 or %s)."""
    create: str
    claim: str
    prune: str


def inbox_sql(table: str, placeholder: Callable[[int], str]) -> InboxSQL:
    t = quote_table(table)
    p = [placeholder(i) for i in range(1, 5)]
    return InboxSQL(
        create=INBOX_DDL.format(table=t),
        claim=(f'INSERT INTO {t} (group_id, topic, partition, "offset") VALUES ({p[0]}, {p[1]}, {p[2]}, {p[3]}) '
               "ON CONFLICT DO NOTHING RETURNING 1"),
        prune=f'DELETE FROM {t} WHERE group_id = {p[0]} AND topic = {p[1]} AND partition = {p[2]} AND "offset" < {p[3]}',
    )


@dataclass
class InboxPlan:
    """The inbox's decisions, no I/O: what to insert for a record, when to prune, what."""
    group: str
    table: str = DEFAULT_TABLE
    prune_every: int = DEFAULT_PRUNE_EVERY
    handled: int = 0
    # Per (topic, partition), the durable committed offset rows were last pruned below.
    pruned_below: dict[tuple[str, int], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        quote_table(self.table)  # refuse a bad name at construction, not at the first record
        if self.prune_every < 1:
            raise ValueError("prune_every must be >= 1")

    def claim_params(self, record: Any) -> tuple:
        return (self.group, record.topic, record.partition, record.offset)

    def record_done(self) -> bool:
        """One more record handled (or found done); True when it is time to prune."""
        self.handled += 1
        return self.handled % self.prune_every == 0

    def prunes(self, group_report: dict) -> list[tuple]:
        """The prune parameters for a `describe_group` report: one per partition whose
        durable committed offset moved since the last prune."""
        out = []
        for part in group_report.get("partitions", []):
            committed = part.get("committed")
            key = (part["topic"], part["partition"])
            if committed is None or committed <= self.pruned_below.get(key, 0):
                continue
            out.append((self.group, key[0], key[1], committed))
        return out

    def pruned(self, params: tuple) -> None:
        self.pruned_below[(params[1], params[2])] = params[3]


class InboxTransactionOpen(Exception):
    """The connection was already inside a transaction: the inbox must commit its own
    before it acks, and a nested block would only be a savepoint."""


# -- asyncio client + asyncpg ----------------------------------------------------------------

async def migrate_inbox_async(conn: Any, table: str = DEFAULT_TABLE) -> None:
    """Create the inbox table if it does not exist (asyncpg connection)."""
    await conn.execute(inbox_sql(table, lambda i: f"${i}").create)


class AsyncInbox:
    """``await inbox.handle(record, handler)``: run ``await handler(conn, record)`` once per
    record, in one transaction with the inbox row, then ack. `consumer` is a
    `zbroker.client.aio.AsyncConsumer`, `admin` an `AsyncAdmin` (for pruning)."""

    def __init__(self, consumer: Any, conn: Any, admin: Any, *, group: str | None = None,
                 table: str = DEFAULT_TABLE, prune_every: int = DEFAULT_PRUNE_EVERY,
                 after_commit: Callable[[Any], Any] | None = None) -> None:
        self.consumer, self.conn, self.admin = consumer, conn, admin
        self.plan = InboxPlan(group or consumer.group, table, prune_every)
        self.sql = inbox_sql(table, lambda i: f"${i}")
        self.after_commit = after_commit  # called after the commit, before the ack

    async def handle(self, record: Any, handler: Callable[[Any, Any], Awaitable[Any]]) -> bool:
        """True if the handler ran, False if the record was done before (acked again only)."""
        if self.conn.is_in_transaction():
            raise InboxTransactionOpen("the connection is inside a transaction; the inbox needs its own")
        async with self.conn.transaction():
            fresh = await self.conn.fetchval(self.sql.claim, *self.plan.claim_params(record)) is not None
            if fresh:
                await handler(self.conn, record)
        if self.after_commit is not None:
            self.after_commit(record)
        await self.consumer.ack(record)
        if self.plan.record_done():
            await self.prune()
        return fresh

    async def prune(self) -> int:
        """Delete the rows below the group's durable committed offsets; returns how many."""
        removed = 0
        for params in self.plan.prunes(await self.admin.describe_group(self.plan.group)):
            status = await self.conn.execute(self.sql.prune, *params)
            removed += int(status.rsplit(" ", 1)[-1])
            self.plan.pruned(params)
        return removed


# -- sync client + psycopg 3 ---------------------------------------------------------------

def migrate_inbox(conn: Any, table: str = DEFAULT_TABLE) -> None:
    """Create the inbox table if it does not exist (psycopg 3 connection)."""
    with conn.transaction():
        conn.execute(inbox_sql(table, lambda i: "%s").create)


class Inbox:
    """``inbox.handle(record, handler)``: run ``handler(conn, record)`` once per record, in
    one transaction with the inbox row, then ack. `consumer` is a `zbroker.client.Consumer`,
    `conn` a psycopg 3 connection, `admin` a `zbroker.client.Admin` (for pruning)."""

    def __init__(self, consumer: Any, conn: Any, admin: Any, *, group: str | None = None,
                 table: str = DEFAULT_TABLE, prune_every: int = DEFAULT_PRUNE_EVERY,
                 after_commit: Callable[[Any], Any] | None = None) -> None:
        self.consumer, self.conn, self.admin = consumer, conn, admin
        self.plan = InboxPlan(group or consumer.group, table, prune_every)
        self.sql = inbox_sql(table, lambda i: "%s")
        self.after_commit = after_commit

    def handle(self, record: Any, handler: Callable[[Any, Any], Any]) -> bool:
        """True if the handler ran, False if the record was done before (acked again only)."""
        if self.conn.info.transaction_status != 0:  # psycopg.pq.TransactionStatus.IDLE
            raise InboxTransactionOpen("the connection is inside a transaction; the inbox needs its own")
        with self.conn.transaction():
            fresh = self.conn.execute(self.sql.claim, self.plan.claim_params(record)).fetchone() is not None
            if fresh:
                handler(self.conn, record)
        if self.after_commit is not None:
            self.after_commit(record)
        self.consumer.ack(record)
        if self.plan.record_done():
            self.prune()
        return fresh

    def run(self, handler: Callable[[Any, Any], Any], *, stop: Callable[[], bool] = lambda: False,
            max_records: int = 1000) -> None:
        """Poll and handle until ``stop()``; a record whose handler raises is nacked (its
        transaction rolled back), as `Consumer.run` does."""
        while not stop():
            for record in self.consumer.poll(max_records):
                try:
                    self.handle(record, handler)
                except InboxTransactionOpen:
                    raise
                except Exception as exc:
                    self.consumer.nack([record], reason=f"{type(exc).__name__}: {exc}"[:200])

    def prune(self) -> int:
        removed = 0
        for params in self.plan.prunes(self.admin.describe_group(self.plan.group)):
            with self.conn.transaction():
                removed += self.conn.execute(self.sql.prune, params).rowcount
            self.plan.pruned(params)
        return removed

