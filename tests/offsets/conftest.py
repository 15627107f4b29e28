"""Fixtures for the offset store and commit writer tests.

``backend`` runs a test once per offset store implementation. Each gives
fresh, isolated storage per test and a way to count the statements one call
sends, measured outside the store (SQLite's trace hook; for PostgreSQL the
frontend messages on the wire, through a proxy).
"""

from __future__ import annotations

import contextlib
import sqlite3
from typing import Iterator

import pytest

from zbroker.storage.offsets import OffsetStore, open_offset_store
from zbroker.storage.offsets.base import TABLE
# pg_dsn, pg_schema and pg_schema_factory come from the root conftest, so that
# every directory shares one session fixture (and at most one throwaway cluster).
from tests.support.pg import PgFrontendCounter, dsn_host_port, dsn_via, pg_execute, pg_fetch, with_schema
from tests.support.tcp_proxy import TcpProxy


class SqliteBackend:
    name = "sqlite"
    single_node = True  # a cluster of one: the coordinator lease is always ours, at epoch 1

    def __init__(self, tmp_path) -> None:
        self.path = tmp_path / "offsets.db"

    def url(self, schema: str | None = None) -> str:
        base = f"sqlite:///{self.path}"
        return f"{base}?schema={schema}" if schema else base

    def new_schema(self) -> str:
        self._n = getattr(self, "_n", 0) + 1
        return f"s{self._n}"

    @contextlib.contextmanager
    def counting_store(self) -> Iterator[tuple[OffsetStore, "StatementCount"]]:
        count = StatementCount()

        def trace(sql: str) -> None:
            count.statements += 1

        yield open_offset_store(self.url(), trace=trace), count

    def set_holes_by_hand(self, holes_text: str) -> None:
        """Overwrites every row's holes column in the default schema, as a person with a SQL prompt might."""
        with contextlib.closing(sqlite3.connect(self.path)) as conn, conn:
            conn.execute(f"UPDATE {TABLE} SET holes = ?", (holes_text,))

    def fetch(self, sql: str) -> list[tuple]:
        """Rows of `sql` (tables named ``{s}.table``) in the default schema, read outside the store."""
        with contextlib.closing(sqlite3.connect(self.path)) as conn:
            return [tuple(r) for r in conn.execute(sql.format(s="main"))]


class PostgresBackend:
    name = "postgres"
    single_node = False

    def __init__(self, dsn: str, schema_factory) -> None:
        self.dsn = dsn
        self._schema_factory = schema_factory
        self._default: str | None = None

    def url(self, schema: str | None = None) -> str:
        if schema is None:
            if self._default is None:
                self._default = self._schema_factory()
            schema = self._default
        return with_schema(self.dsn, schema)

    def new_schema(self) -> str:
        return self._schema_factory()

    @contextlib.contextmanager
    def counting_store(self) -> Iterator[tuple[OffsetStore, "StatementCount"]]:
        counter = PgFrontendCounter()
        self.url()  # makes the default schema
        with TcpProxy(dsn_host_port(self.dsn), tap=counter) as proxy:
            url = with_schema(dsn_via(self.dsn, proxy.port), self._default) + "&sslmode=disable"
            yield open_offset_store(url), _PgCount(counter)

    def set_holes_by_hand(self, holes_text: str) -> None:
        """Overwrites every row's holes column (jsonb: `holes_text` must be valid JSON)."""
        self.url()  # makes the default schema
        pg_execute(self.dsn, f'UPDATE "{self._default}".{TABLE} SET holes = $1::jsonb', holes_text)

    def fetch(self, sql: str) -> list[tuple]:
        self.url()
        return [tuple(r) for r in pg_fetch(self.dsn, sql.format(s=f'"{self._default}"'))]

    def expire_lease_by_hand(self) -> None:
        """Ends the coordinator lease now, by the server's clock: what waiting out lease_ms would do."""
        self.url()
        pg_execute(self.dsn, f'UPDATE "{self._default}".zbroker_coordinator_lease '
                             "SET expires_at = now() - interval '1 millisecond'")


class StatementCount:
    statements = 0

    def reset(self) -> None:
        self.statements = 0


class _PgCount(StatementCount):
    def __init__(self, counter: PgFrontendCounter) -> None:
        self.counter = counter

    @property
    def statements(self) -> int:  # type: ignore[override]
        return self.counter.statements

    @property
    def round_trips(self) -> int:
        return self.counter.counts["S"] + self.counter.counts["Q"]

    def reset(self) -> None:
        self.counter.reset()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def backend(request, tmp_path):
    if request.param == "sqlite":
        return SqliteBackend(tmp_path)
    dsn = request.getfixturevalue("pg_dsn")
    return PostgresBackend(dsn, request.getfixturevalue("pg_schema_factory"))
