"""The offset store contract: one suite, run against every backend (SQLite, PostgreSQL)."""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import asyncpg
import pytest

from zbroker.storage.offsets import OffsetRow, OffsetStoreError, open_offset_store

MAX_INT64 = (1 << 63) - 1


def row(partition=0, committed=0, holes=(), generation=1, epoch=0, group="g", topic="t") -> OffsetRow:
    return OffsetRow(group, topic, partition, committed, list(holes), generation, epoch)


async def _opened(url: str, **kw):
    store = open_offset_store(url, **kw)
    await store.connect()
    await store.migrate()
    return store


def test_migrate_twice_is_idempotent(backend):
    async def body():
        first = open_offset_store(backend.url())
        second = open_offset_store(backend.url())
        try:
            assert await first.migrate() == [1]
            assert await first.migrate() == []
            assert await second.migrate() == []  # another process, same schema
            assert await first.upsert([row(committed=3)]) == 1
            assert await second.migrate() == []
            assert [r.committed_offset for r in await second.load_all()] == [3]  # data untouched
        finally:
            await first.close()
            await second.close()

    asyncio.run(body())


def test_concurrent_migrations_apply_once(backend):
    async def body():
        url = backend.url(backend.new_schema())
        stores = [open_offset_store(url) for _ in range(3)]
        try:
            applied = await asyncio.gather(*(s.migrate() for s in stores))
            assert sorted(applied) == [[], [], [1]]
        finally:
            for s in stores:
                await s.close()

    asyncio.run(body())


def test_round_trip_with_holes(backend):
    rows = [
        row(0, 10, [(12, 13), (15, 20)], generation=3),
        row(1, 0, []),
        row(7, MAX_INT64, [], generation=-1, epoch=MAX_INT64),
        row(2, 5, [(6, 7)], group="grüße-✓", topic="orders.v2"),
        row(0, 1, [(2, MAX_INT64)], group="other"),
        row(2_147_483_647, 3, [], group='a "quoted" \\ name', topic="t"),  # escapes survive the JSON batch
    ]

    async def body():
        store = await _opened(backend.url())
        try:
            assert await store.load_all() == []
            assert await store.upsert(rows) == len(rows)
            loaded = await store.load_all()
        finally:
            await store.close()
        assert loaded == sorted(rows, key=lambda r: r.key)
        assert all(isinstance(h, tuple) for r in loaded for h in r.holes)
        other = next(r for r in loaded if r.group_id == "other")
        assert other.to_wire() == ["other", "t", 0, 1, [[2, MAX_INT64]], 1, 0]  # plain lists on the wire

    asyncio.run(body())


def test_guard_ignores_an_older_offset(backend):
    async def body():
        store = await _opened(backend.url())
        try:
            assert await store.upsert([row(committed=10, holes=[(11, 12)], generation=2)]) == 1
            assert await store.upsert([row(committed=9, holes=[], generation=3)]) == 0
            assert await store.load_all() == [row(committed=10, holes=[(11, 12)], generation=2)]
        finally:
            await store.close()

    asyncio.run(body())


def test_guard_equal_offset_updates_holes(backend):
    async def body():
        store = await _opened(backend.url())
        try:
            await store.upsert([row(committed=10, holes=[(11, 12)])])
            assert await store.upsert([row(committed=10, holes=[(11, 14), (20, 21)], generation=2)]) == 1
            assert await store.load_all() == [row(committed=10, holes=[(11, 14), (20, 21)], generation=2)]
            assert await store.upsert([row(committed=11, holes=[])]) == 1
            assert (await store.load_all())[0].committed_offset == 11
        finally:
            await store.close()

    asyncio.run(body())


def test_reset_epoch_overrides_a_higher_offset_and_fences_stale_advances(backend):
    async def body():
        store = await _opened(backend.url())
        try:
            await store.upsert([row(committed=100, holes=[(101, 102)], epoch=0)])
            assert await store.upsert([row(committed=5, epoch=1)]) == 1  # groups reset
            assert (await store.load_all())[0] == row(committed=5, epoch=1)
            assert await store.upsert([row(committed=150, epoch=0)]) == 0  # late advance, old epoch
            assert (await store.load_all())[0] == row(committed=5, epoch=1)
            assert await store.upsert([row(committed=6, epoch=1)]) == 1
            assert (await store.load_all())[0] == row(committed=6, epoch=1)
        finally:
            await store.close()

    asyncio.run(body())


def test_duplicate_keys_in_one_batch_fold_like_sequential_upserts(backend):
    async def body():
        store = await _opened(backend.url())
        try:
            batch = [row(0, 10), row(0, 5), row(0, 12, [(13, 14)]), row(1, 50, epoch=2), row(1, 9, epoch=3),
                     row(1, 80, epoch=2)]
            assert await store.upsert(batch) == 2
            assert await store.load_all() == [row(0, 12, [(13, 14)]), row(1, 9, epoch=3)]
        finally:
            await store.close()

    asyncio.run(body())


def test_many_keys_in_one_upsert_is_one_statement(backend):
    rows = [row(p, p * 10, [(p * 10 + 1, p * 10 + 2)], group=f"g{p % 7}") for p in range(1500)]

    async def body(store, count):
        try:
            await store.connect()
            await store.migrate()
            await store.upsert([row(0, 0)])  # warm: PostgreSQL prepares the statement once
            count.reset()
            assert await store.upsert(rows) == len(rows)
            assert count.statements == 1
            if hasattr(count, "round_trips"):
                assert count.round_trips == 1
            count.reset()
            assert await store.upsert([dataclasses.replace(r, committed_offset=r.committed_offset + 1)
                                       for r in rows]) == len(rows)
            assert count.statements == 1
            assert len(await store.load_all()) == len(rows) + 1  # and the warm-up row
        finally:
            await store.close()

    with backend.counting_store() as (store, count):
        asyncio.run(body(store, count))


def test_pages_walk_every_row_once_whatever_the_collation_does_with_the_names(backend):
    """Keyset pages (load_page) under the database's own collation: mixed case, accents and
    scripts order differently under C and en_US, and the pages must agree with each other."""
    names = ["a", "B", "b", "Z", "z", "é", "E", "日本", "a-b", "a_b", "ab"]
    rows = [row(p, 10 + p, [(12 + p, 13 + p)] if p % 2 else [], group=g, topic=t)
            for g in names for t in ("t", "T", "ü") for p in range(3)]

    async def body():
        store = await _opened(backend.url())
        try:
            await store.upsert(rows)
            for page_rows in (1, 2, 7, len(rows), len(rows) + 1):
                walked, after = [], None
                while True:
                    page = await store.load_page(after, page_rows)
                    assert len(page) <= page_rows
                    walked += page
                    if len(page) < page_rows:
                        break
                    after = page[-1].key
                assert len(walked) == len(rows), f"pages of {page_rows} skipped or repeated rows"
                assert sorted(walked, key=lambda r: r.key) == sorted(rows, key=lambda r: r.key)
            assert sorted(await store.load_all(page_rows=5), key=lambda r: r.key) == sorted(rows, key=lambda r: r.key)
        finally:
            await store.close()

    asyncio.run(body())


def test_schemas_are_isolated(backend):
    async def body():
        a = await _opened(backend.url(backend.new_schema()))
        b = await _opened(backend.url(backend.new_schema()))
        try:
            await a.upsert([row(0, 10)])
            await b.upsert([row(0, 3), row(1, 4)])
            assert await a.load_all() == [row(0, 10)]
            assert await b.load_all() == [row(0, 3), row(1, 4)]
        finally:
            await a.close()
            await b.close()

    asyncio.run(body())


def test_store_reopens_and_keeps_data(backend):
    async def body():
        store = await _opened(backend.url())
        await store.upsert([row(0, 42, [(43, 44)])])
        await store.close()
        await store.close()  # idempotent
        again = await _opened(backend.url())
        try:
            assert await again.load_all() == [row(0, 42, [(43, 44)])]
            await again.ping()
        finally:
            await again.close()

    asyncio.run(body())


def test_empty_upsert_sends_nothing(backend):
    async def body(store, count):
        try:
            await store.connect()
            await store.migrate()
            count.reset()
            assert await store.upsert([]) == 0
            assert count.statements == 0
        finally:
            await store.close()

    with backend.counting_store() as (store, count):
        asyncio.run(body(store, count))


# -- failures: every backend raises OffsetStoreError, retriable --------------------------

def test_unreachable_store_raises_a_retriable_error(tmp_path, backend):
    if backend.name == "sqlite":
        url = f"sqlite:///{tmp_path}/missing-dir/offsets.db"
    else:
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        url = f"postgresql://postgres@127.0.0.1:{port}/test"

    async def body():
        store = open_offset_store(url)
        try:
            for call in (store.connect, store.ping, store.load_all, lambda: store.upsert([row()])):
                with pytest.raises(OffsetStoreError) as info:
                    await call()
                assert info.value.retriable
                assert info.value.data["backend"] == store.backend
        finally:
            await store.close()

    asyncio.run(body())


@pytest.mark.parametrize("by_hand", ["oops", '"oops"', "{}", "[[5, 3]]", "[[1, 4], [2, 6]]", "[[1]]", "[[-2, 3]]",
                                     '[["1", "4"]]', "[[1.0, 4.0]]", "null"])
def test_holes_written_by_hand_that_upsert_never_writes_read_as_none(backend, by_hand):
    """Refused, such a row would fail every load of the offsets (and so every group) for good;
    passed on, a reversed or overlapping range would corrupt the coordinator's ranges.
    Read as no holes, it only delivers the acked offsets above the committed one again."""
    # PostgreSQL's jsonb column refuses text that is not JSON: there, such a row cannot exist.
    refused_by_the_database = backend.name == "postgres" and by_hand == "oops"

    async def body():
        store = await _opened(backend.url())
        try:
            await store.upsert([row(0, 10, [(12, 13)]), row(1, 4, [(6, 8), (9, 11)])])
            if refused_by_the_database:
                with pytest.raises(asyncpg.PostgresError):
                    backend.set_holes_by_hand(by_hand)
            else:
                backend.set_holes_by_hand(by_hand)
            return await store.load_all()
        finally:
            await store.close()

    loaded = asyncio.run(body())
    expected_holes = ([(12, 13)], [(6, 8), (9, 11)]) if refused_by_the_database else ([], [])
    assert [(r.partition, r.committed_offset, r.holes) for r in loaded] == [
        (0, 10, expected_holes[0]), (1, 4, expected_holes[1])]


def test_holes_that_touch_are_read_as_written(backend):
    async def body():
        store = await _opened(backend.url())
        try:
            await store.upsert([row(0, 1, [(2, 4), (4, 6), (9, 10)])])
            return await store.load_all()
        finally:
            await store.close()

    assert asyncio.run(body())[0].holes == [(2, 4), (4, 6), (9, 10)]
