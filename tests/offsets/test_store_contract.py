"""The offset store contract: one suite, run against every backend (SQLite, PostgreSQL)."""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import asyncpg
import pytest

from zbroker.protocol.errors import ProtocolError, StaleEpoch
from zbroker.storage.offsets import OffsetRow, OffsetStoreError, open_offset_store
from zbroker.storage.offsets.metadata import Metadata, MetadataChanges, PartitionState, PartitionUpdate, TopicMeta

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
            assert await first.migrate() == [1, 2, 3, 4]
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
            assert sorted(applied) == [[], [], [1, 2, 3, 4]]
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


def test_the_quarantine_travels_with_the_holes_and_is_cleared_by_a_row_without_one(backend):
    parked = [[4_000_000_000, 3, "nack:bad ✓ \"quoted\""], [17, 1, "timeout"]]

    async def body():
        store = await _opened(backend.url())
        try:
            await store.upsert([dataclasses.replace(row(committed=5, holes=[(6, 7)]), quarantine=parked)])
            loaded = await store.load_all()
            assert loaded[0].quarantine == parked and loaded[0].holes == [(6, 7)]
            assert loaded[0].to_wire()[7] == parked
            await store.upsert([row(committed=5, holes=[(6, 8)])])  # released: no quarantine now
            loaded = await store.load_all()
            assert loaded[0].quarantine == [] and len(loaded[0].to_wire()) == 7
        finally:
            await store.close()

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


# -- cluster metadata, the coordinator lease and fencing (issues 25, 26) ------------------

def topic(name="orders", partitions=2, rf=3, min_insync=2, incarnation=7, **config) -> TopicMeta:
    return TopicMeta(name, partitions, dict(config) or {"segment_bytes": 1 << 20}, rf, min_insync, incarnation)


def pstate(topic_name="orders", partition=0, leader="a", epoch=0, isr=("a", "b", "c"),
           replicas=("a", "b", "c")) -> PartitionState:
    return PartitionState(topic_name, partition, tuple(replicas), leader, epoch, tuple(isr))


def created(*topics: TopicMeta) -> MetadataChanges:
    """The topics with every partition new, led by its first replica at leader epoch 0."""
    return MetadataChanges(create_topics=topics, partitions=tuple(
        PartitionUpdate(pstate(t.name, p), None) for t in topics for p in range(t.partitions)))


async def _epoch(store, node="n1") -> int:
    lease = await store.acquire_or_renew_lease(node, f"tcp://{node}:5555", 5000)
    assert lease.held
    return lease.epoch


def test_metadata_round_trips_topics_and_partition_states(backend):
    async def body():
        store = await _opened(backend.url())
        try:
            assert await store.load_metadata() == Metadata({}, {})
            epoch = await _epoch(store)
            orders = topic(config_with="ünïcode ✓", retention_ms=None, nested={"a": [1, 2]})
            single = topic("logs", partitions=1, rf=1, min_insync=1, incarnation=MAX_INT64)
            assert await store.write_metadata(created(orders, single), epoch)
            meta = await store.load_metadata()
        finally:
            await store.close()
        assert meta.topics == {"orders": orders, "logs": single}
        assert meta.partitions == {("orders", 0): pstate("orders", 0), ("orders", 1): pstate("orders", 1),
                                   ("logs", 0): pstate("logs", 0)}

    asyncio.run(body())


def test_group_configs_are_stored_replaced_and_deleted_with_the_metadata(backend):
    async def body():
        store = await _opened(backend.url())
        try:
            epoch = await _epoch(store)
            dlq = {"mode": "shared", "dlq": "billing.dlq", "max_deliveries": 5, "note": "ünïcode"}
            assert await store.write_metadata(MetadataChanges(group_configs=(("billing", dlq), ("x", {}))), epoch)
            first = (await store.load_metadata()).group_configs
            assert await store.write_metadata(MetadataChanges(
                group_configs=(("billing", {**dlq, "max_deliveries": 9}), ("x", None), ("never", None))), epoch)
            second = (await store.load_metadata()).group_configs
            # Fenced like every metadata write: another epoch writes nothing.
            refused = not await store.write_metadata(MetadataChanges(group_configs=(("y", {}),)), epoch + 1)
            third = (await store.load_metadata()).group_configs
        finally:
            await store.close()
        assert first == {"billing": dlq, "x": {}}
        assert second == {"billing": {**dlq, "max_deliveries": 9}}
        assert refused and third == second

    asyncio.run(body())


def test_partition_update_applies_only_over_the_leader_epoch_it_expects(backend):
    async def body():
        store = await _opened(backend.url())
        try:
            epoch = await _epoch(store)
            assert await store.write_metadata(created(topic()), epoch)
            moved = pstate(leader="b", epoch=1, isr=("b", "c"))
            assert await store.write_metadata(MetadataChanges(partitions=(PartitionUpdate(moved, 0),)), epoch)
            # A second controller that read epoch 0 too loses: its change is not applied.
            rival = pstate(leader="c", epoch=1, isr=("c",))
            assert not await store.write_metadata(MetadataChanges(partitions=(PartitionUpdate(rival, 0),)), epoch)
            # An ISR change keeps the leader epoch and names it.
            shrunk = pstate(leader="b", epoch=1, isr=("b",))
            assert await store.write_metadata(MetadataChanges(partitions=(PartitionUpdate(shrunk, 1),)), epoch)
            # A partition that exists cannot be created again, nor one of a topic that does not exist.
            assert not await store.write_metadata(
                MetadataChanges(partitions=(PartitionUpdate(pstate(), None),)), epoch)
            assert not await store.write_metadata(
                MetadataChanges(partitions=(PartitionUpdate(pstate("nosuch"), None),)), epoch)
            meta = await store.load_metadata()
        finally:
            await store.close()
        assert meta.partitions[("orders", 0)] == shrunk
        assert meta.partitions[("orders", 1)] == pstate("orders", 1)

    asyncio.run(body())


def test_a_change_set_with_one_failed_condition_writes_nothing(backend):
    async def body():
        store = await _opened(backend.url())
        try:
            epoch = await _epoch(store)
            assert await store.write_metadata(created(topic()), epoch)
            before = await store.load_metadata()
            failing = MetadataChanges(
                create_topics=(topic("new", partitions=1),),
                update_topics=(dataclasses.replace(topic(), partitions=4),),
                partitions=(PartitionUpdate(pstate("new", 0), None),
                            PartitionUpdate(pstate(partition=0, leader="b", epoch=1), 0),
                            PartitionUpdate(pstate(partition=1, leader="b", epoch=6), 5)))  # stored: 0
            assert not await store.write_metadata(failing, epoch)
            assert await store.load_metadata() == before
            rows = backend.fetch("SELECT count(*) FROM {s}.zbroker_topics WHERE name = 'new'")
        finally:
            await store.close()
        assert rows == [(0,)]

    asyncio.run(body())


def test_topics_are_created_once_and_changed_or_deleted_by_incarnation(backend):
    async def body():
        store = await _opened(backend.url())
        try:
            epoch = await _epoch(store)
            assert await store.write_metadata(created(topic()), epoch)
            assert not await store.write_metadata(created(topic(incarnation=8)), epoch)  # the name is taken
            grown = dataclasses.replace(topic(), partitions=3, config={"segment_bytes": 1})
            assert not await store.write_metadata(
                MetadataChanges(update_topics=(dataclasses.replace(grown, incarnation=8),)), epoch)
            assert await store.write_metadata(MetadataChanges(
                update_topics=(grown,), partitions=(PartitionUpdate(pstate(partition=2), None),)), epoch)
            assert (await store.load_metadata()).topics["orders"] == grown
            # A deletion meant for an older incarnation of the name deletes nothing.
            assert not await store.write_metadata(MetadataChanges(delete_topics=(("orders", 8),)), epoch)
            assert await store.write_metadata(MetadataChanges(delete_topics=(("orders", 7),)), epoch)
            assert await store.load_metadata() == Metadata({}, {})  # its partition states went with it
            assert await store.write_metadata(created(topic(incarnation=9)), epoch)
            assert (await store.load_metadata()).topics["orders"].incarnation == 9
        finally:
            await store.close()

    asyncio.run(body())


def test_concurrent_controllers_bumping_one_leader_epoch_only_one_wins(backend):
    async def body():
        url = backend.url()
        setup = await _opened(url)
        stores = [open_offset_store(url) for _ in range(4)]
        try:
            epoch = await _epoch(setup)
            assert await setup.write_metadata(created(topic()), epoch)
            for s in stores:
                await s.connect()
            changes = [MetadataChanges(partitions=(PartitionUpdate(pstate(leader=leader, epoch=1), 0),))
                       for leader in ("a", "b", "c", "b")]
            won = await asyncio.gather(*(s.write_metadata(c, epoch) for s, c in zip(stores, changes)))
            meta = await setup.load_metadata()
        finally:
            await setup.close()
            for s in stores:
                await s.close()
        assert sorted(won) == [False, False, False, True]
        winner_leader = ("a", "b", "c", "b")[won.index(True)]
        assert meta.partitions[("orders", 0)] == pstate(leader=winner_leader, epoch=1)

    asyncio.run(body())


def test_the_first_lease_is_held_at_epoch_one_and_renewing_keeps_it(backend):
    async def body():
        store = await _opened(backend.url())
        try:
            first = await store.acquire_or_renew_lease("n1", "tcp://127.0.0.2:5555", 5000)
            again = await store.acquire_or_renew_lease("n1", "tcp://127.0.0.2:5555", 5000)
        finally:
            await store.close()
        assert (first.holder, first.holder_endpoint, first.epoch, first.held) == ("n1", "tcp://127.0.0.2:5555", 1, True)
        assert again.epoch == 1 and again.held
        assert 0 < first.remaining_ms <= 5000 and 0 < again.remaining_ms <= 5000

    asyncio.run(body())


def test_an_unexpired_lease_cannot_be_taken_and_an_expired_one_is_taken_at_the_next_epoch(backend):
    if backend.single_node:  # no other node exists: whoever asks holds epoch 1
        return _assert_a_cluster_of_one(backend)

    async def body():
        url = backend.url()
        a, b = await _opened(url), await _opened(url)
        try:
            assert (await a.acquire_or_renew_lease("a", "tcp://a:1", 5000)).epoch == 1
            refused = await b.acquire_or_renew_lease("b", "tcp://b:1", 5000)
            assert (refused.held, refused.holder, refused.holder_endpoint, refused.epoch) == (False, "a", "tcp://a:1", 1)
            assert 0 < refused.remaining_ms <= 5000  # a's lease, by the database clock
            backend.expire_lease_by_hand()
            taken = await b.acquire_or_renew_lease("b", "tcp://b:1", 5000)
            assert (taken.held, taken.holder, taken.epoch) == (True, "b", 2)
            late = await a.acquire_or_renew_lease("a", "tcp://a:1", 5000)  # a woke up: too late
            assert (late.held, late.holder, late.epoch) == (False, "b", 2)
            backend.expire_lease_by_hand()
            # Even its own holder retakes an expired lease at a new epoch: it stood down meanwhile.
            assert (await b.acquire_or_renew_lease("b", "tcp://b:1", 5000)).epoch == 3
        finally:
            await a.close()
            await b.close()
        history = backend.fetch("SELECT epoch, holder FROM {s}.zbroker_coordinator_epochs ORDER BY epoch")
        assert history == [(1, "a"), (2, "b"), (3, "b")]

    asyncio.run(body())


def _assert_a_cluster_of_one(backend):
    async def body():
        store = await _opened(backend.url())
        try:
            leases = [await store.acquire_or_renew_lease(n, f"tcp://{n}:1", 1000) for n in ("a", "b", "a")]
            assert not await store.write_metadata(created(topic()), 2)
            with pytest.raises(StaleEpoch):
                await store.upsert([row(committed=1)], coordinator_epoch=2)
        finally:
            await store.close()
        assert [(lease.held, lease.epoch, lease.remaining_ms) for lease in leases] == [(True, 1, 1000)] * 3

    asyncio.run(body())


def test_nodes_racing_for_a_free_lease_only_one_takes_it(backend):
    async def body():
        url = backend.url()
        setup = await _opened(url)
        stores = [open_offset_store(url) for _ in range(5)]
        try:
            for s in stores:
                await s.connect()
            answers = await asyncio.gather(*(s.acquire_or_renew_lease(f"n{i}", f"tcp://n{i}:1", 5000)
                                             for i, s in enumerate(stores)))
        finally:
            await setup.close()
            for s in stores:
                await s.close()
        if backend.single_node:
            assert all(a.held and a.epoch == 1 for a in answers)  # a cluster of one: nobody to race
            return
        held = [a for a in answers if a.held]
        assert len(held) == 1 and held[0].epoch == 1
        assert all(a.holder == held[0].holder and a.epoch == 1 for a in answers)

    asyncio.run(body())


def test_a_lease_request_out_of_range_is_refused(backend):
    async def body():
        store = await _opened(backend.url())
        try:
            for node, ms in (("", 5000), ("n", 0), ("n", 10**9)):
                with pytest.raises(ProtocolError):
                    await store.acquire_or_renew_lease(node, "tcp://n:1", ms)
        finally:
            await store.close()

    asyncio.run(body())


def test_metadata_and_offset_writes_of_an_older_coordinator_epoch_are_refused(backend):
    """Proved by a query: the rows, read outside the store, are what the current epoch wrote."""
    async def body():
        store = await _opened(backend.url())
        try:
            old = await _epoch(store, "a")
            assert await store.write_metadata(created(topic()), old)
            assert await store.upsert([row(committed=5)], coordinator_epoch=old) == 1
            if backend.single_node:
                stale, current = old + 1, old  # no other node can exist: any other epoch is foreign
            else:
                backend.expire_lease_by_hand()
                current = await _epoch(store, "b")
                stale = old
                assert current == old + 1
            assert not await store.write_metadata(
                MetadataChanges(partitions=(PartitionUpdate(pstate(leader="b", epoch=1), 0),)), stale)
            assert not await store.write_metadata(created(topic("other")), stale)
            with pytest.raises(StaleEpoch) as refused:
                await store.upsert([row(committed=9), row(partition=1, committed=9)], coordinator_epoch=stale)
            assert refused.value.data["got"] == stale
            assert refused.value.data["epoch"] == current
            assert await store.upsert([row(committed=7)], coordinator_epoch=current) == 1
        finally:
            await store.close()
        assert backend.fetch("SELECT partition, committed_offset, coordinator_epoch FROM {s}.consumer_group_offsets"
                             " ORDER BY partition") == [(0, 7, current)]
        assert backend.fetch("SELECT leader, leader_epoch, coordinator_epoch FROM {s}.zbroker_partition_states"
                             " WHERE partition = 0") == [("a", 0, old)]
        assert backend.fetch("SELECT name FROM {s}.zbroker_topics") == [("orders",)]

    asyncio.run(body())


def test_a_fenced_write_before_any_lease_is_refused(backend):
    async def body():
        store = await _opened(backend.url())
        try:
            if backend.single_node:  # holds its lease from the start, at epoch 1 only
                assert await store.upsert([row(committed=1)], coordinator_epoch=1) == 1
                assert await store.write_metadata(created(topic()), 1)
                return
            with pytest.raises(StaleEpoch) as refused:
                await store.upsert([row(committed=1)], coordinator_epoch=1)
            assert not await store.write_metadata(created(topic()), 1)
        finally:
            await store.close()
        assert refused.value.data["epoch"] is None
        assert backend.fetch("SELECT count(*) FROM {s}.consumer_group_offsets") == [(0,)]

    asyncio.run(body())


def test_a_fenced_flush_is_still_one_statement(backend):
    async def body():
        with backend.counting_store() as (store, count):
            try:
                await store.migrate()
                epoch = await _epoch(store)
                count.reset()
                assert await store.upsert([row(p, 3) for p in range(200)], coordinator_epoch=epoch) == 200
                fenced_statements = count.statements
                count.reset()
                assert await store.upsert([row(p, 4) for p in range(200)]) == 200
                plain_statements = count.statements
            finally:
                await store.close()
        assert fenced_statements == plain_statements == 1

    asyncio.run(body())
