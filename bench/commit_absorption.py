"""Commit absorption benchmark: how many offset advances the commit writer makes durable per
second, and how many statements that costs the database.

    python -m bench.commit_absorption --offsets postgresql://postgres@127.0.0.1:5432/test --seconds 10

The benchmark plays the coordinator: it binds a ROUTER, starts a real writer
process (multiprocessing spawn) and keeps ``--window`` advance requests of
``--advances-per-request`` advances in flight, over ``--keys`` distinct
(group, topic, partition) keys with ever-growing offsets. An advance counts as
*absorbed* once the writer has replied that it (or something newer for its
key) is durable.

Statements are counted twice: by the writer (flushes; probes are separate),
and, for PostgreSQL, independently from the server: the delta of
``pg_stat_database.xact_commit`` for the database over the run, read after the
writer's backend has exited (a backend flushes its statistics on exit). Every
flush is one single-statement transaction, so commits = statements. That
counter is database-wide: other sessions on the same database inflate it, so
it is an upper bound; ``pg_stat_user_tables`` for the benchmark's own table
gives the rows PostgreSQL wrote. pg_stat_statements is not used: it needs
shared_preload_libraries, i.e. reconfiguring the server.

On PostgreSQL a fresh schema ``zbroker_bench_<pid>_<hex>`` is used and dropped
afterwards (``--keep`` keeps it), unless the URL names one with ``?schema=``.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import secrets
import signal
import sys
import time
from urllib.parse import urlsplit

import asyncpg
import zmq

from zbroker.actors.commit_writer import shell
from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.storage.offsets.urls import split_schema


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)


class _Observer:
    """Reads server-side statistics on short-lived connections, counting its own transactions."""

    def __init__(self, dsn: str, schema: str) -> None:
        self.dsn = dsn
        self.schema = schema
        self.own_xacts = 0

    def _fetchrow(self, sql: str, *args):
        async def go():
            conn = await asyncpg.connect(self.dsn, timeout=10)
            try:
                return await conn.fetchrow(sql, *args)
            finally:
                await conn.close()

        self.own_xacts += 1
        return asyncio.run(go())

    def xact_commit(self) -> int:
        return self._fetchrow("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")[0]

    def table_writes(self) -> tuple[int, int, int]:
        r = self._fetchrow("SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                           "WHERE schemaname = $1 AND relname = 'consumer_group_offsets'", self.schema)
        return tuple(r) if r else (0, 0, 0)

    def writer_backends(self) -> int:
        return self._fetchrow("SELECT count(*) FROM pg_stat_activity "
                              "WHERE application_name = 'zbroker-offsets' AND position($1 in query) > 0",
                              f'"{self.schema}"')[0]

    def execute(self, sql: str) -> None:
        async def go():
            conn = await asyncpg.connect(self.dsn, timeout=10)
            try:
                await conn.execute(sql)
            finally:
                await conn.close()

        self.own_xacts += 1
        asyncio.run(go())


def run_bench(args: argparse.Namespace) -> dict:
    base_url, schema = split_schema(args.offsets)
    is_pg = base_url.startswith(("postgresql://", "postgres://"))
    made_schema = False
    if is_pg and not schema:
        schema = f"zbroker_bench_{os.getpid()}_{secrets.token_hex(3)}"
        made_schema = True
    url = f"{base_url}{'&' if '?' in base_url else '?'}schema={schema}" if schema else base_url
    observer = _Observer(base_url, schema or "public") if is_pg else None

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    endpoint = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    proc = multiprocessing.get_context("spawn").Process(
        target=shell.run, args=(endpoint, url),
        kwargs={"flush_interval_ms": args.flush_interval_ms, "batch_size": args.batch_size,
                "log_level": "warning"}, daemon=True)
    proc.start()
    statuses: list[m.WriterStatus] = []
    replies: dict[int, float] = {}

    def pump(timeout_ms: int) -> None:
        if not sock.poll(timeout_ms):
            return
        while True:
            try:
                _ident, *frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            is_reply, env = codec.decode_any(frames)
            if is_reply:
                if not env.ok:
                    raise RuntimeError(f"writer error: {env.error!r}")
                replies[env.corr_id] = time.perf_counter()
            elif isinstance(env.msg, m.WriterStatus):
                statuses.append(env.msg)

    try:
        deadline = time.monotonic() + 30
        while not (statuses and statuses[-1].healthy):
            if time.monotonic() > deadline or not proc.is_alive():
                raise RuntimeError("writer did not become healthy")
            pump(200)
        if observer:
            xact_before = observer.xact_commit()
            table_before = observer.table_writes()
        metrics_before = statuses[-1].metrics

        keys = args.keys
        per_req = args.advances_per_request
        offsets = [0] * keys
        cursor = 0
        sent_at: dict[int, float] = {}
        latencies: list[float] = []
        corr = 0
        absorbed = 0
        t_start = time.perf_counter()
        t_stop = t_start + args.seconds
        while True:
            now = time.perf_counter()
            sending = now < t_stop
            if not sending and not sent_at:
                break
            while sending and len(sent_at) < args.window:
                items = []
                for _ in range(per_req):
                    k = cursor
                    cursor = (cursor + 1) % keys
                    offsets[k] += 1
                    o = offsets[k]
                    group, partition = f"group-{k % args.groups}", k // args.groups
                    items.append([group, "bench", partition, o, [[o + 1, o + 2]], 1, 0])
                corr += 1
                sock.send_multipart([shell.IDENTITY, *codec.encode_request(m.Advance(advances=items), corr)])
                sent_at[corr] = time.perf_counter()
            pump(5)
            for cid, t in replies.items():
                start = sent_at.pop(cid, None)
                if start is not None:
                    latencies.append((t - start) * 1000)
                    absorbed += per_req
            replies.clear()
            if time.perf_counter() > t_stop + 30:
                raise RuntimeError("writer stopped answering")
        elapsed = time.perf_counter() - t_start

        n_status = len(statuses)
        while len(statuses) <= n_status:  # a status taken after the last reply
            pump(200)
        metrics = statuses[-1].metrics
        flushes = metrics["flushes"] - metrics_before["flushes"]
        rows_flushed = metrics["rows_flushed"] - metrics_before["rows_flushed"]
        result = {
            "offsets": _redact(url),
            "seconds": round(elapsed, 3),
            "keys": keys,
            "advances_per_request": per_req,
            "window": args.window,
            "flush_interval_ms": args.flush_interval_ms,
            "batch_size": args.batch_size,
            "advances_absorbed": absorbed,
            "advances_per_s": round(absorbed / elapsed),
            "requests_per_s": round(absorbed / per_req / elapsed, 1),
            "flushes": flushes,
            "statements_per_s": round(flushes / elapsed, 1),
            "rows_flushed": rows_flushed,
            "advances_per_row": round(absorbed / max(1, rows_flushed), 1),
            "flush_latency_ms_p50": metrics["flush_latency_ms_p50"],
            "flush_latency_ms_p99": metrics["flush_latency_ms_p99"],
            "flush_latency_ms_max": metrics["flush_latency_ms_max"],
            "reply_latency_ms_p50": _percentile(latencies, 0.50),
            "reply_latency_ms_p99": _percentile(latencies, 0.99),
            "writer_probes": metrics["probes"] - metrics_before["probes"],
        }
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGTERM)
        proc.join(15)
        if proc.is_alive():
            proc.kill()
            proc.join()
        sock.close(linger=0)
        ctx.term()

    if observer:
        wait_until = time.monotonic() + 10
        while observer.writer_backends() and time.monotonic() < wait_until:
            time.sleep(0.05)
        time.sleep(0.2)  # the exiting backend's stats flush, and the observer's own
        own = observer.own_xacts  # those before the final read have been flushed by now
        delta = observer.xact_commit() - xact_before
        ins, upd, hot = (a - b for a, b in zip(observer.table_writes(), table_before))
        result.update(
            statement_source="pg_stat_database.xact_commit delta (database-wide upper bound)",
            pg_xact_commit_delta=delta,
            pg_statements_per_s=round(max(0, delta - own) / elapsed, 1),
            pg_rows_inserted=ins,
            pg_rows_updated=upd,
            pg_hot_update_ratio=round(hot / upd, 3) if upd else None,
        )
        if made_schema and not args.keep:
            observer.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    else:
        result["statement_source"] = "writer counter only (no server-side counter for SQLite)"
    stmts = result.get("pg_statements_per_s", result["statements_per_s"])
    result["goal_met"] = result["advances_per_s"] >= 100_000 and stmts <= 100
    return result


def _redact(url: str) -> str:
    password = urlsplit(url).password if "://" in url else None
    return url.replace(f":{password}@", ":***@") if password else url


def run(scale: float = 1.0) -> dict:
    """For bench/harness.py: the default workload for 10 s (times ``scale``, at least 2 s)."""
    return run_bench(_parser().parse_args(["--seconds", str(max(2.0, 10.0 * scale))]))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.commit_absorption",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--offsets", default=os.environ.get("ZBROKER_TEST_PG_DSN",
                                                       "postgresql://postgres@127.0.0.1:5432/test"))
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--keys", type=int, default=1000, help="distinct (group, topic, partition) keys")
    p.add_argument("--groups", type=int, default=10, help="keys are spread over this many groups")
    p.add_argument("--advances-per-request", type=int, default=200)
    p.add_argument("--window", type=int, default=32, help="advance requests in flight")
    p.add_argument("--flush-interval-ms", type=float, default=10.0)
    p.add_argument("--batch-size", type=int, default=1000)
    p.add_argument("--keep", action="store_true", help="keep the benchmark schema")
    return p


def main(argv: list[str] | None = None) -> None:
    try:
        result = run_bench(_parser().parse_args(argv))
    except RuntimeError as exc:  # raised, not SystemExit, so that the harness records a failed phase
        raise SystemExit(f"commit absorption: {exc}") from None
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
