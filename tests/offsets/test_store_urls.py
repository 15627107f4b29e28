"""``--offsets`` URLs: which backend, which path, which schema."""

from __future__ import annotations

import pytest

from zbroker.storage.offsets import InvalidOffsetsUrl, open_offset_store
from zbroker.storage.offsets.postgres import PostgresOffsetStore
from zbroker.storage.offsets.sqlite import SQLiteOffsetStore


@pytest.mark.parametrize("url, path, schema", [
    ("sqlite:///offsets.db", "offsets.db", None),
    ("sqlite:///data/offsets.db", "data/offsets.db", None),
    ("sqlite:////var/lib/zbroker/offsets.db", "/var/lib/zbroker/offsets.db", None),
    ("sqlite:///:memory:", ":memory:", None),
    ("sqlite:////tmp/o.db?schema=run_1", "/tmp/o.db", "run_1"),
])
def test_sqlite_urls(url, path, schema):
    store = open_offset_store(url)
    assert isinstance(store, SQLiteOffsetStore)
    assert (store.path, store.schema) == (path, schema)


@pytest.mark.parametrize("url, dsn, schema", [
    ("postgresql://postgres@127.0.0.1:5432/test", "postgresql://postgres@127.0.0.1:5432/test", None),
    ("postgres://u:p@db/x?schema=s1&sslmode=disable", "postgres://u:p@db/x?sslmode=disable", "s1"),
])
def test_postgres_urls(url, dsn, schema):
    store = open_offset_store(url)
    assert isinstance(store, PostgresOffsetStore)
    assert (store.dsn, store.schema) == (dsn, schema)


def test_the_schema_argument_wins_over_the_url():
    assert open_offset_store("sqlite:///o.db?schema=a", schema="b").schema == "b"


@pytest.mark.parametrize("url", ["mysql://x/y", "sqlite://relative.db", "sqlite:///", "offsets.db",
                                 "sqlite:///o.db?schema=bad-name", 'postgresql://h/db?schema=x";drop'])
def test_bad_urls_are_refused_with_a_clear_error(url):
    with pytest.raises(InvalidOffsetsUrl) as info:
        open_offset_store(url)
    assert info.value.code.value == "BAD_REQUEST"
