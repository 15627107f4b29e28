"""`zbroker status`'s view of a cluster, read from the store (issue 26): the pure shape, then
PostgreSQL after real lease takes, and the CLI printing it."""

from __future__ import annotations

import asyncio
import json

import pytest

from zbroker.storage.offsets import open_offset_store
from zbroker.storage.offsets.cluster_view import cluster_view, read_cluster_view
from tests.support.pg import PgSession, with_schema


def lease(holder="n2", epoch=3, remaining_ms=4000):
    return {"holder": holder, "endpoint": f"tcp://{holder}:7400", "epoch": epoch, "lease_age_ms": 300,
            "held_for_ms": 9000, "remaining_ms": remaining_ms}


def epoch_rows():  # newest first, as EPOCHS_SQL orders them
    return [{"holder": "n2", "endpoint": "tcp://n2:7400", "last_epoch": 3, "epochs_taken": 2, "last_taken_ms_ago": 9000},
            {"holder": "n1", "endpoint": "tcp://n1:7400", "last_epoch": 2, "epochs_taken": 1, "last_taken_ms_ago": 60000}]


def test_the_lease_holder_leads_and_every_node_that_led_is_listed():
    view = cluster_view("postgresql", lease(), epoch_rows())
    assert view["leader"] == {"node_id": "n2", "endpoint": "tcp://n2:7400", "epoch": 3, "lease_age_ms": 300,
                              "held_for_ms": 9000, "remaining_ms": 4000, "expired": False}
    assert [(n["node_id"], n["leading"], n["last_epoch"]) for n in view["nodes"]] == [("n2", True, 3), ("n1", False, 2)]


def test_an_expired_lease_leaves_no_node_leading():
    view = cluster_view("postgresql", lease(remaining_ms=0), epoch_rows())
    assert view["leader"]["expired"] and not any(n["leading"] for n in view["nodes"])


def test_no_lease_yet_and_sqlite_as_a_cluster_of_one():
    assert cluster_view("postgresql", None, []) == {"backend": "postgresql", "leader": None, "nodes": [],
                                                    "source": "store", "cluster_of_one": False}
    one = cluster_view("sqlite", None, [], endpoint="tcp://127.0.0.1:7400")
    assert one["cluster_of_one"] and one["leader"]["endpoint"] == "tcp://127.0.0.1:7400"
    assert [n["leading"] for n in one["nodes"]] == [True]


def test_an_offsets_url_of_no_known_backend_is_refused():
    with pytest.raises(ValueError, match="sqlite:///PATH or postgresql"):
        asyncio.run(read_cluster_view("mysql://x"))


@pytest.mark.postgres
def test_the_view_of_real_lease_takes_and_a_takeover(pg_dsn, pg_schema):
    url = with_schema(pg_dsn, pg_schema)

    async def body():
        assert (await read_cluster_view(url))["leader"] is None  # no tables yet: nothing led
        store = open_offset_store(url)
        try:
            await store.migrate()
            assert (await read_cluster_view(url))["nodes"] == []
            assert (await store.acquire_or_renew_lease("n1", "tcp://127.0.0.1:7400", 5000)).held
            assert not (await store.acquire_or_renew_lease("n2", "tcp://127.0.0.2:7400", 5000)).held
            first = await read_cluster_view(url)
            with PgSession(pg_dsn) as s:  # n1's lease ran out (as if killed 10 s ago)
                s.execute(f'UPDATE "{pg_schema}".zbroker_coordinator_lease '
                          "SET expires_at = now() - interval '1 second'")
            expired = await read_cluster_view(url)
            taken = await store.acquire_or_renew_lease("n2", "tcp://127.0.0.2:7400", 5000)
            assert taken.held and taken.epoch == 2
            return first, expired, await read_cluster_view(url)
        finally:
            await store.close()

    first, expired, second = asyncio.run(body())
    assert first["leader"]["node_id"] == "n1" and first["leader"]["epoch"] == 1
    assert 0 < first["leader"]["remaining_ms"] <= 5000 and first["leader"]["lease_age_ms"] >= 0
    assert [(n["node_id"], n["leading"]) for n in first["nodes"]] == [("n1", True)]
    assert expired["leader"]["expired"] and expired["leader"]["remaining_ms"] == 0
    assert second["leader"]["node_id"] == "n2" and second["leader"]["epoch"] == 2
    assert [(n["node_id"], n["leading"], n["last_epoch"]) for n in second["nodes"]] == [("n2", True, 2),
                                                                                        ("n1", False, 1)]


@pytest.mark.postgres
def test_status_prints_the_cluster_even_when_no_node_answers(pg_dsn, pg_schema, capsys, monkeypatch):
    from zbroker import cli

    # Its logging setup would point structlog at this test's captured stderr for the session.
    monkeypatch.setattr(cli, "_client_logging", lambda: None)

    url = with_schema(pg_dsn, pg_schema)

    async def take():
        store = open_offset_store(url)
        try:
            await store.migrate()
            await store.acquire_or_renew_lease("n1", "tcp://127.0.0.2:7400", 5000)
        finally:
            await store.close()

    asyncio.run(take())
    # Nothing listens at port 9 (discard): the client finds no connection.
    with pytest.raises(SystemExit) as exited:
        cli.main(["status", "--broker", "tcp://127.0.0.1:9", "--offsets", url, "--json"])
    assert exited.value.code == 1
    out = capsys.readouterr()
    shown = json.loads(out.out.splitlines()[0])["cluster"]
    assert shown["leader"]["node_id"] == "n1" and shown["leader"]["epoch"] == 1
    assert out.err.startswith("error: UNAVAILABLE")
