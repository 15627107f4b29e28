"""The PostgreSQL-queue peers, for real on the shared server at a tiny scale.

Each must enqueue, complete and time what it says, and leave nothing behind: its
database is gone after `teardown`, whatever the workload did.
"""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from bench.adapter import Phase, ProduceSpec
from bench.peers import PEERS
from bench.peers.pg_queues import ADMIN_DSN, read_text_stamp, text_stamp

pytestmark = [pytest.mark.postgres, pytest.mark.processes]

COUNT = 300


def _databases() -> set[str]:
    async def go() -> set[str]:
        conn = await asyncpg.connect(ADMIN_DSN)
        try:
            return {r["datname"] for r in await conn.fetch("SELECT datname FROM pg_database")}
        finally:
            await conn.close()

    return asyncio.run(go())


def _phase(target: int, timeout_s: float = 60) -> Phase:
    return Phase(system="t", workload="t", target=target, timeout_s=timeout_s, server_pids=list)


def test_text_stamp_round_trips_and_has_the_size_asked_for():
    assert read_text_stamp(text_stamp(100, 1_764_619_200_123_456_789)) == 1_764_619_200_123_456_789
    assert len(text_stamp(100, 5)) == 100


@pytest.mark.parametrize("name", ["pgqueuer", "procrastinate", "pgmq"])
def test_each_queue_enqueues_completes_times_and_drops_its_database(name):
    adapter = PEERS[name]()
    adapter.check()  # a missing library or server fails here: CI installs the bench extra
    assert adapter.version and "PostgreSQL" in adapter.version
    assert all("synchronous_commit=on" in adapter.durability[w] for w in ("produce", "consume_ack", "latency"))
    adapter.setup()
    try:
        assert adapter.database in _databases()
        produced = _phase(COUNT)
        adapter.produce(ProduceSpec("produce", COUNT, 100), produced)
        assert produced.records == COUNT and produced.seconds is not None
        completed = _phase(COUNT)
        adapter.consume_ack(COUNT, completed)
        assert completed.records >= COUNT and completed.seconds is not None
        timed = _phase(200, timeout_s=30)
        summary = adapter.latency(200, 1.0, 100, timed)
        assert summary["publisher"].get("error") is None, summary["publisher"]
        assert summary["received"] == summary["publisher"]["sent"] == 200
        assert 0 < summary["latency_ms"]["p50"] <= summary["latency_ms"]["p99"]
    finally:
        adapter.teardown()
    assert adapter.database not in _databases()


def test_a_task_that_ignores_its_cancellation_is_abandoned_not_waited_for():
    """procrastinate's listener sometimes does not stop when cancelled; asyncio.run then hung."""
    from bench.peers.pg_queues import run_bounded

    async def stubborn():
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue  # refuses to stop

    async def workload():
        asyncio.get_running_loop().create_task(stubborn())
        await asyncio.sleep(0)
        return "measured"

    assert run_bounded(workload(), cleanup_s=0.1) == "measured"  # asyncio.run never returns here
