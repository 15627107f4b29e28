"""PostgreSQL-only behaviour of the offset store, and the test support that finds a server."""

from __future__ import annotations

import asyncio
import time

import pytest

from zbroker.storage.offsets import OffsetRow, OffsetStoreError, open_offset_store
from tests.support import pg as pg_support
from tests.support.pg import PgSession, ThrowawayCluster, dsn_host_port, dsn_via, with_schema
from tests.support.tcp_proxy import TcpProxy


def rows(n: int, committed: int) -> list[OffsetRow]:
    return [OffsetRow("g", "t", p, committed, [(committed + 1, committed + 2)], 1, 0) for p in range(n)]


@pytest.mark.postgres
def test_a_flush_is_one_transaction(pg_dsn, pg_schema):
    async def body():
        store = open_offset_store(with_schema(pg_dsn, pg_schema))
        try:
            await store.migrate()
            await store.upsert(rows(500, 1))
            await store.upsert(rows(500, 2))
        finally:
            await store.close()

    asyncio.run(body())
    with PgSession(pg_dsn) as s:
        xmins = s.fetchval(f'SELECT count(DISTINCT xmin::text) FROM "{pg_schema}".consumer_group_offsets')
        applied = s.fetch(f'SELECT version, name FROM "{pg_schema}".zbroker_schema_migrations')
    assert xmins == 1  # all 500 rows were written by one transaction
    assert [tuple(r) for r in applied] == [(1, "consumer_group_offsets"), (2, "cluster_metadata"),
                                           (3, "key_quarantine"), (4, "group_configs")]


@pytest.mark.postgres
@pytest.mark.parametrize("mode", ["reset", "blackhole"])
def test_a_lost_server_fails_within_the_timeout_and_the_store_reconnects(pg_dsn, pg_schema, mode):
    with TcpProxy(dsn_host_port(pg_dsn)) as proxy:
        url = with_schema(dsn_via(pg_dsn, proxy.port), pg_schema)

        async def body():
            store = open_offset_store(url, connect_timeout=0.5, command_timeout=0.5)
            try:
                await store.migrate()
                assert await store.upsert(rows(3, 1)) == 3
                proxy.cut(mode)
                started = time.monotonic()
                with pytest.raises(OffsetStoreError) as info:
                    await store.upsert(rows(3, 2))
                assert time.monotonic() - started < 3
                assert info.value.retriable and info.value.data["operation"] == "upsert"
                with pytest.raises(OffsetStoreError):
                    await store.ping()
                proxy.restore()
                assert await store.upsert(rows(3, 3)) == 3  # a new connection, by itself
                assert {r.committed_offset for r in await store.load_all()} == {3}
                assert store.statistics()["connects"] >= 2
            finally:
                await store.close()

        asyncio.run(body())


@pytest.mark.postgres
def test_throwaway_cluster_starts_and_is_removed():
    bindir = pg_support.find_pg_bindir()
    if bindir is None:
        pytest.skip("no initdb/pg_ctl on this machine")
    cluster = ThrowawayCluster(bindir)
    try:
        dsn = cluster.start()
        assert pg_support.probe(dsn) is None
    finally:
        cluster.stop()
    assert pg_support.probe(dsn, timeout=1) is not None


def test_missing_postgres_is_a_skip_or_with_require_a_failure(monkeypatch):
    monkeypatch.delenv("ZBROKER_REQUIRE_PG", raising=False)
    with pytest.raises(pytest.skip.Exception, match="PostgreSQL not available: gone"):
        pg_support._unavailable("gone")
    monkeypatch.setenv("ZBROKER_REQUIRE_PG", "1")
    with pytest.raises(pytest.fail.Exception, match="ZBROKER_REQUIRE_PG=1"):
        pg_support._unavailable("gone")


def test_dsn_helpers():
    assert with_schema("postgresql://u:p@h:1/db", "s") == "postgresql://u:p@h:1/db?schema=s"
    assert with_schema("postgresql://h/db?sslmode=disable", "s") == "postgresql://h/db?sslmode=disable&schema=s"
    assert dsn_via("postgresql://u:p@h:1/db?x=1", 99) == "postgresql://u:p@127.0.0.1:99/db?x=1"
    assert dsn_host_port("postgresql://u@db.example/x") == ("db.example", 5432)
    assert pg_support.redact("postgresql://u:secret@h/db") == "postgresql://u:***@h/db"


@pytest.mark.postgres
def test_a_flush_racing_a_takeover_waits_for_it_and_is_then_refused(pg_dsn, pg_schema):
    """The FOR SHARE in the fenced upsert: a flush that meets an uncommitted takeover waits for
    it, then re-reads the lease row, finds the new epoch and writes nothing."""
    from zbroker.protocol.errors import StaleEpoch

    app = f"zbt-fence-{pg_schema}"[:63]
    url = with_schema(pg_dsn, pg_schema)

    async def body(session: PgSession):
        store = open_offset_store(url, application_name=app)
        try:
            await store.migrate()
            assert (await store.acquire_or_renew_lease("a", "tcp://a:1", 5000)).epoch == 1
            assert await store.upsert(rows(1, 1), coordinator_epoch=1) == 1
            session.execute("BEGIN")
            session.execute(f'UPDATE "{pg_schema}".zbroker_coordinator_lease '
                            "SET holder = 'b', epoch = epoch + 1, expires_at = now() + interval '5 seconds'")
            flush = asyncio.ensure_future(store.upsert(rows(1, 2), coordinator_epoch=1))
            while not session.fetchval("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 "
                                       "AND wait_event_type = 'Lock'", app):
                assert not flush.done(), flush  # it must wait for the takeover, not pass it
                await asyncio.sleep(0.02)
            session.execute("COMMIT")
            with pytest.raises(StaleEpoch) as refused:
                await flush
            assert refused.value.data == {"epoch": 2, "got": 1, "operation": "upsert"}
            assert [r.committed_offset for r in await store.load_all()] == [1]
        finally:
            await store.close()

    with PgSession(pg_dsn) as session:
        asyncio.run(body(session))
