"""PostgreSQL job queues through their usual Python clients: PgQueuer, procrastinate, pgmq.

Python shops that need "never lose a job" often keep their jobs in the
PostgreSQL they already run instead of running a broker. Each of the three runs
here against the shared server, in a database of its own
(`zbench_<run>_<system>`) that `setup` creates and `teardown` drops with
`WITH (FORCE)`, so none of their tables, functions or types remain after the
run. pgmq is installed from the SQL file its Python package ships (no
extension), into the schema `pgmq` of that database.

Durability is each library's default on a server with `synchronous_commit`
on: every enqueue call and every completion is a committed transaction, so a
job acknowledged to the caller survives a PostgreSQL crash. `check` refuses to
measure a server with `synchronous_commit` off rather than print a figure that
means something else.

The settings are each library's documented high-throughput ones:

- PgQueuer: `Queries.enqueue` with lists (one INSERT per 1,000 jobs);
  `QueueManager.run(batch_size=1000)` dequeues 1,000 jobs per statement and
  logs their completion in batches; LISTEN/NOTIFY wakes the worker.
- procrastinate: `Task.batch_defer_async` (one INSERT per 1,000 jobs); the
  worker fetches one job per statement (the library has no batched fetch),
  so it runs with `concurrency=CONCURRENCY` coroutines; LISTEN/NOTIFY on.
- pgmq: `send_batch` (1,000 messages per call); `read(qty=1000)` then one
  `delete_batch` per read.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Any

from bench.adapter import Adapter, Phase, ProduceSpec, Skipped
from bench.latency import LatencyRecorder, Pacer, PublisherProcess, paced_loop
from bench.procstat import pids_by_name

ADMIN_DSN = os.environ.get("ZBROKER_BENCH_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
BATCH = 1000
# procrastinate's worker fetches one job per statement and awaits each fetch before the
# next, so one worker's rate is one job per commit round trip (measured here: about 100
# jobs/s whatever its `concurrency`). Its documented way to go faster is more workers:
# WORKERS of them, in this process's event loop, each running CONCURRENCY jobs at once.
WORKERS = 8
CONCURRENCY = 8
ENTRYPOINT = "zbench_noop"
QUEUE = "zbench"

# Payloads are text for the JSON-based queues: the publish stamp as 19 decimal digits, padded.
_STAMP_DIGITS = 19
# How long a workload's leftover tasks get to stop once cancelled (`run_bounded`).
CLEANUP_S = 10.0


def text_stamp(size: int, now_ns: int) -> str:
    return str(now_ns).rjust(_STAMP_DIGITS, "0") + "x" * max(0, size - _STAMP_DIGITS)


def read_text_stamp(payload: str) -> int:
    return int(payload[:_STAMP_DIGITS])


def _dsn_for(database: str) -> str:
    base, _, query = ADMIN_DSN.partition("?")
    root = base.rsplit("/", 1)[0]
    return f"{root}/{database}" + (f"?{query}" if query else "")


async def _admin(sql: str) -> Any:
    import asyncpg

    conn = await asyncpg.connect(ADMIN_DSN, timeout=5)
    try:
        return await conn.fetchval(sql)
    finally:
        await conn.close()


class PgQueue(Adapter):
    """What the three share: a database per run, the server's pids, the workload shapes."""

    library = ""  # the importable client library

    def __init__(self) -> None:
        super().__init__()
        self.run_id = uuid.uuid4().hex[:8]
        self.database = f"zbench_{self.run_id}_{self.name}"
        self.dsn = _dsn_for(self.database)
        self._created = False

    # -- lifecycle -----------------------------------------------------------
    def check(self) -> None:
        try:
            __import__(self.library)
        except ImportError as exc:
            raise Skipped(f"{self.library} not installed ({exc}): pip install -e '.[bench]'") from exc
        try:
            version = asyncio.run(_admin("SHOW server_version"))
            sync_commit = asyncio.run(_admin("SHOW synchronous_commit"))
        except Exception as exc:
            raise Skipped(f"PostgreSQL not reachable at {ADMIN_DSN} ({type(exc).__name__}: {exc})")
        if sync_commit != "on":
            raise Skipped(f"synchronous_commit is {sync_commit!r} on this server: its rows would not be "
                          f"durable the way the other rows are")
        self.version = f"{self.library_version()} on PostgreSQL {version.split()[0]}"
        self.durability = {
            "produce": f"synchronous_commit=on; {self.produce_how}",
            "consume_ack": f"synchronous_commit=on; {self.consume_how}",
            "latency": f"synchronous_commit=on; {self.latency_how}",
        }

    def library_version(self) -> str:
        from importlib.metadata import version

        return f"{self.library} {version(self.library)}"

    def setup(self) -> None:
        asyncio.run(_admin(f'CREATE DATABASE "{self.database}"'))
        self._created = True
        asyncio.run(self.install())

    def teardown(self) -> None:
        if self._created:
            asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)'))
            self._created = False

    def server_pids(self) -> list[int]:
        return pids_by_name("postgres")

    # -- workloads -----------------------------------------------------------
    # Each runs under `run_bounded`, not asyncio.run: procrastinate's listener task does not
    # always stop when cancelled ("Abandoning tasks that did not stop when cancelled"), and
    # asyncio.run then waits for it for ever (the 2026-12-05 04:33 UTC run hung 13 minutes in
    # its latency row's cleanup until it was killed).
    def produce(self, spec: ProduceSpec, phase: Phase) -> None:
        if spec.workload != "produce":
            raise Skipped("the PostgreSQL queues run the produce, consume and latency rows only")
        run_bounded(self.enqueue(spec.count, spec.size, phase))

    def prefill(self, count: int, size: int) -> None:
        phase = Phase(system=self.name, workload="prefill", target=count, timeout_s=600, server_pids=list)
        run_bounded(self.enqueue(count, size, phase))

    def consume_ack(self, count: int, phase: Phase) -> None:
        run_bounded(self.complete(count, phase))

    def latency(self, rate: float, seconds: float, size: int, phase: Phase) -> dict[str, Any]:
        # A fresh database: jobs an earlier phase left when it reached its time bound (at
        # scale 0.5 procrastinate completes a few hundred a second) would be read first, as
        # payloads with no stamp, and their backlog timed as latency.
        self.teardown()
        self.setup()
        recorder = LatencyRecorder()
        publisher = PublisherProcess(paced_publisher, {"system": self.name, "dsn": self.dsn, "rate": rate,
                                                       "seconds": seconds, "size": size})
        expected = Pacer(rate, seconds, 0.0).total
        run_bounded(self.receive_stamps(expected, phase, recorder, publisher))
        return {**recorder.summary(), "publisher": publisher.finish()}

    # -- what each library does ------------------------------------------------
    produce_how = consume_how = latency_how = ""

    async def install(self) -> None:
        raise NotImplementedError

    async def enqueue(self, count: int, size: int, phase: Phase) -> None:
        raise NotImplementedError

    async def complete(self, count: int, phase: Phase) -> None:
        raise NotImplementedError

    async def receive_stamps(self, expected: int, phase: Phase, recorder: LatencyRecorder,
                             publisher: PublisherProcess) -> None:
        raise NotImplementedError


def run_bounded(coro: Any, cleanup_s: float = CLEANUP_S) -> Any:
    """`asyncio.run`, except that the tasks still running when ``coro`` ends get ``cleanup_s``
    seconds to stop once cancelled, and are then abandoned with the loop."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.wait(pending, timeout=cleanup_s))
            for shutdown in (loop.shutdown_asyncgens(), loop.shutdown_default_executor()):
                loop.run_until_complete(asyncio.wait([loop.create_task(shutdown)], timeout=cleanup_s))
        finally:
            loop.close()


def _record_text(recorder: LatencyRecorder, payload: str) -> None:
    # LatencyRecorder reads a binary stamp; the JSON queues carry it as text.
    recorder.histogram.record_value(max(1, (time.time_ns() - read_text_stamp(payload)) // 1000))
    recorder.received += 1


async def _start_after_listen(publisher: PublisherProcess) -> None:
    # The worker starting beside this task issues its LISTEN within its first turns; a
    # job enqueued before that is still found by the worker's first dequeue, only later.
    await asyncio.sleep(0.2)
    await asyncio.to_thread(publisher.start)


async def _enqueue_in_batches(count: int, phase: Phase, send_batch) -> None:
    phase.begin()
    sent = 0
    while sent < count and not phase.expired:
        n = min(BATCH, count - sent)
        await send_batch(n)
        sent += n
        phase.advance(n)
    phase.end()


# ======================================================================================
# PgQueuer
# ======================================================================================

class PgQueuer(PgQueue):
    name = "pgqueuer"
    library = "pgqueuer"
    produce_how = f"Queries.enqueue with lists of {BATCH} (one INSERT each)"
    consume_how = f"QueueManager.run(batch_size={BATCH}), no-op entrypoint, completion logged in batches"
    latency_how = f"paced Queries.enqueue; QueueManager woken by LISTEN/NOTIFY, batch_size={BATCH}"

    async def _queries(self):
        import asyncpg
        from pgqueuer.db import AsyncpgDriver
        from pgqueuer.queries import Queries

        conn = await asyncpg.connect(self.dsn)
        return conn, Queries(AsyncpgDriver(conn))

    async def install(self) -> None:
        conn, queries = await self._queries()
        try:
            await queries.install()
        finally:
            await conn.close()

    async def enqueue(self, count: int, size: int, phase: Phase) -> None:
        conn, queries = await self._queries()
        payload = os.urandom(size)
        try:
            async def send_batch(n: int) -> None:
                await queries.enqueue([ENTRYPOINT] * n, [payload] * n, [0] * n)

            await _enqueue_in_batches(count, phase, send_batch)
        finally:
            await conn.close()

    async def _run_worker(self, count: int, phase: Phase, on_job) -> None:
        import asyncpg
        from pgqueuer.db import AsyncpgDriver
        from pgqueuer.qm import QueueManager
        from pgqueuer.types import QueueExecutionMode

        from pgqueuer.queries import Queries

        conn = await asyncpg.connect(self.dsn)
        qm = QueueManager(Queries(AsyncpgDriver(conn)))
        done = 0

        @qm.entrypoint(ENTRYPOINT)
        async def noop(job) -> None:
            nonlocal done
            on_job(job)
            done += 1
            phase.advance(1)
            if done >= count or phase.expired:
                qm.shutdown.set()

        try:
            phase.begin()
            await qm.run(batch_size=BATCH, mode=QueueExecutionMode.continuous)
            phase.end()  # after run() returns: its completion buffer is flushed
        finally:
            await conn.close()

    async def complete(self, count: int, phase: Phase) -> None:
        await self._run_worker(count, phase, lambda job: None)

    async def receive_stamps(self, expected, phase, recorder, publisher) -> None:
        task = asyncio.create_task(_start_after_listen(publisher))
        await self._run_worker(expected, phase, lambda job: recorder.record(job.payload, time.time_ns()))
        await task


# ======================================================================================
# procrastinate
# ======================================================================================

class Procrastinate(PgQueue):
    name = "procrastinate"
    library = "procrastinate"
    produce_how = f"Task.batch_defer_async of {BATCH} jobs (one INSERT each)"
    consume_how = (f"{WORKERS} x App.run_worker_async(concurrency={CONCURRENCY}, wait=False): one job per "
                   f"fetch (no batched fetch in the library), no-op task")
    latency_how = f"paced batch_defer_async; {WORKERS} workers with LISTEN/NOTIFY, concurrency={CONCURRENCY}"

    def _app(self, on_job=None):
        import procrastinate

        app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=self.dsn))

        @app.task(name=ENTRYPOINT, queue=QUEUE)
        async def noop(v: str) -> None:
            if on_job is not None:
                on_job(v)

        return app, noop

    async def install(self) -> None:
        app, _ = self._app()
        async with app.open_async():
            await app.schema_manager.apply_schema_async()

    async def enqueue(self, count: int, size: int, phase: Phase) -> None:
        app, noop = self._app()
        value = "x" * size
        async with app.open_async():
            async def send_batch(n: int) -> None:
                await noop.batch_defer_async(*({"v": value} for _ in range(n)))

            await _enqueue_in_batches(count, phase, send_batch)

    async def _work(self, count: int, phase: Phase, on_value, *, wait: bool) -> None:
        done = 0
        stop = asyncio.Event()

        def on_job(v: str) -> None:
            nonlocal done
            on_value(v)
            done += 1
            phase.advance(1)
            if done >= count or phase.expired:
                stop.set()

        app, _ = self._app(on_job)
        async with app.open_async():
            phase.begin()
            workers = {asyncio.create_task(app.run_worker_async(
                queues=[QUEUE], name=f"zbench-{i}", concurrency=CONCURRENCY, wait=wait,
                install_signal_handlers=False)) for i in range(WORKERS)}
            stopper = asyncio.create_task(stop.wait())
            # Without `wait`, a worker ends when it finds the queue empty: done once all have.
            # The phase's time bound is checked here too, not only as jobs complete: a run
            # whose handler kept failing (no job ever counted) ran for 35 minutes past it.
            while not stop.is_set() and not phase.expired and not all(w.done() for w in workers):
                await asyncio.wait(workers | {stopper}, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
            for worker in workers:
                worker.cancel()  # graceful: jobs running finish, their completion is written
            await asyncio.gather(*workers, return_exceptions=True)
            phase.end()
            stopper.cancel()

    async def complete(self, count: int, phase: Phase) -> None:
        await self._work(count, phase, lambda v: None, wait=False)

    async def receive_stamps(self, expected, phase, recorder, publisher) -> None:
        task = asyncio.create_task(_start_after_listen(publisher))
        await self._work(expected, phase, lambda v: _record_text(recorder, v), wait=True)
        await task


# ======================================================================================
# pgmq (SQL-only install)
# ======================================================================================

class Pgmq(PgQueue):
    name = "pgmq"
    library = "pgmq"
    produce_how = f"send_batch of {BATCH} (SQL-only install, logged queue table)"
    consume_how = f"read(qty={BATCH}, vt=30) then one delete_batch per read"
    latency_how = f"paced send_batch; read_with_poll(qty={BATCH}, poll_interval_ms=10)"

    async def _queue(self):
        from pgmq.async_queue import PGMQueue

        queue = PGMQueue(conn_string=self.dsn, init_extension=False, pool_size=2)
        await queue.init()
        return queue

    async def install(self) -> None:
        from pgmq.install import get_embedded_install_sql

        import asyncpg

        conn = await asyncpg.connect(self.dsn)
        try:
            async with conn.transaction():
                await conn.execute(get_embedded_install_sql())
        finally:
            await conn.close()
        queue = await self._queue()
        try:
            await queue.create_queue(QUEUE)
        finally:
            await queue.close()

    async def enqueue(self, count: int, size: int, phase: Phase) -> None:
        queue = await self._queue()
        message = {"v": "x" * size}
        try:
            await _enqueue_in_batches(count, phase, lambda n: queue.send_batch(QUEUE, [message] * n))
        finally:
            await queue.close()

    async def _drain(self, count: int, phase: Phase, on_value, *, poll: bool) -> None:
        queue = await self._queue()
        try:
            phase.begin()
            while phase.records < count and not phase.expired:
                if poll:
                    messages = await queue.read_with_poll(QUEUE, vt=30, qty=BATCH, max_poll_seconds=1,
                                                          poll_interval_ms=10)
                else:
                    messages = await queue.read(QUEUE, vt=30, qty=BATCH)
                if not messages:
                    continue
                for message in messages:
                    on_value(message.message["v"])
                await queue.delete_batch(QUEUE, [message.msg_id for message in messages])
                phase.advance(len(messages))
            phase.end()
        finally:
            await queue.close()

    async def complete(self, count: int, phase: Phase) -> None:
        await self._drain(count, phase, lambda v: None, poll=False)

    async def receive_stamps(self, expected, phase, recorder, publisher) -> None:
        await asyncio.to_thread(publisher.start)
        await self._drain(expected, phase, lambda v: _record_text(recorder, v), poll=True)


# ======================================================================================
# The paced publisher (a child process, as for every system)
# ======================================================================================

async def _publish(args: dict, ready, go, results) -> None:
    system, size = args["system"], args["size"]
    if system == "pgqueuer":
        import asyncpg
        from bench.latency import stamp
        from pgqueuer.db import AsyncpgDriver
        from pgqueuer.queries import Queries

        conn = await asyncpg.connect(args["dsn"])
        queries = Queries(AsyncpgDriver(conn))

        async def publish(n: int) -> None:
            await queries.enqueue([ENTRYPOINT] * n, [stamp(size, time.time_ns()) for _ in range(n)], [0] * n)

        close = conn.close
    elif system == "procrastinate":
        import procrastinate

        app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=args["dsn"]))

        @app.task(name=ENTRYPOINT, queue=QUEUE)
        async def noop(v: str) -> None:  # pragma: no cover - runs in the worker
            pass

        await app.open_async()

        async def publish(n: int) -> None:
            await noop.batch_defer_async(*({"v": text_stamp(size, time.time_ns())} for _ in range(n)))

        close = app.close_async
    else:
        from pgmq.async_queue import PGMQueue

        queue = PGMQueue(conn_string=args["dsn"], init_extension=False, pool_size=1)
        await queue.init()

        async def publish(n: int) -> None:
            await queue.send_batch(QUEUE, [{"v": text_stamp(size, time.time_ns())} for _ in range(n)])

        close = queue.close
    ready.set()
    await asyncio.to_thread(go.wait)
    pacer = Pacer(args["rate"], args["seconds"], time.monotonic())
    loop = asyncio.get_running_loop()
    pending: list[asyncio.Future] = []

    def publish_n(n: int) -> None:
        # paced_loop is synchronous: run each publish to completion on this loop's thread.
        pending.append(asyncio.run_coroutine_threadsafe(publish(n), loop))
        pending[-1].result()

    await asyncio.to_thread(paced_loop, pacer, publish_n)
    results.put({"sent": pacer.sent, "max_lag_ms": pacer.max_lag_s * 1000})
    await close()


def paced_publisher(args: dict, ready, go, results) -> None:
    """Child process: enqueue stamped jobs at `rate` per second for `seconds`."""
    try:
        asyncio.run(_publish(args, ready, go, results))
    except Exception as exc:
        results.put({"error": f"{type(exc).__name__}: {exc}"})
