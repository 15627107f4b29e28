"""Coordinator failover benchmark (issue 26): leader SIGKILL to the first successful poll on the new leader.

    python -m bench.coordinator_failover --kills 20

Three `zbroker up` nodes on 127.0.0.1, .2 and .3 (same port, each its own
data directory and ``--advertise-host``) share one PostgreSQL schema, made
for the run and dropped after it. A consumer, given all three URLs, joins a
group and polls (``max_wait_ms`` 100) without pause. Each round reads the
lease row (`storage.offsets.cluster_view`) to find the leading node, SIGKILLs
its whole process group (supervisor and actors: a lost host), and measures,
on the consumer's monotonic clock, the time from the kill to the first poll
answered OK by another node. The killed node is then restarted, and the next
round waits until it is back (a standby again) before it kills the next leader.

The time includes everything a client sees: the lease running out by the
database's clock (``--coordinator-lease-ms``, default 5,000), a standby's
next ask taking it, the new leader loading the store, and the client's own
timeout and redirects (its request timeout, default 5 s, is reported). The
goal (issue 26) is a max under 10 s with default settings.

Prints one JSON object; `run()` serves bench/harness.py (``--only
coordinator_failover``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from zbroker.storage.offsets.urls import split_schema

HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
GOAL_MAX_S = 10.0
TOPIC, GROUP = "failover-bench", "failover-bench"


# -- pure pieces ------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), -(-len(ordered) * q // 100)))
    return ordered[int(rank) - 1]


def summarize(times_s: list[float], goal_max_s: float = GOAL_MAX_S) -> dict:
    if not times_s:
        return {"kills": 0, "p50_s": None, "max_s": None, "goal_max_s": goal_max_s, "goal_met": False}
    return {"kills": len(times_s), "p50_s": round(percentile(times_s, 50), 3), "max_s": round(max(times_s), 3),
            "min_s": round(min(times_s), 3), "goal_max_s": goal_max_s, "goal_met": max(times_s) < goal_max_s}


@dataclass
class FailoverTimer:
    """Kill-to-first-good-poll, from what the consumer saw; times on one monotonic clock.

    A poll answered by the killed node itself does not count (one in flight at the kill
    may still be answered), nor one before the kill."""
    killed_url: str | None = None
    killed_at: float | None = None
    times_s: list[float] = field(default_factory=list)
    failed_polls: int = 0

    def killed(self, url: str, at: float) -> None:
        self.killed_url, self.killed_at = url, at

    def poll_failed(self) -> None:
        if self.killed_at is not None:
            self.failed_polls += 1

    def poll_answered(self, url: str, at: float) -> float | None:
        """The failover time, the first time a poll after the kill is answered elsewhere; else None."""
        if self.killed_at is None or url == self.killed_url or at < self.killed_at:
            return None
        took = at - self.killed_at
        self.times_s.append(took)
        self.killed_url = self.killed_at = None
        return took


def node_urls(port: int) -> list[str]:
    return [f"tcp://{host}:{port}" for host in HOSTS]


def node_command(python: str, index: int, port: int, data_root: Path, offsets_url: str) -> list[str]:
    host = HOSTS[index]
    return [python, "-m", "zbroker", "up", "--host", host, "--advertise-host", host, "--port", str(port),
            "--data", str(data_root / f"node{index + 1}"), "--offsets", offsets_url, "--http", "off",
            "--log-level", "warning"]


def leader_index(view: dict, port: int) -> int | None:
    """Which node holds an unexpired lease, from `cluster_view`; None when no node leads."""
    leader = view.get("leader")
    if not leader or leader.get("expired"):
        return None
    urls = node_urls(port)
    return urls.index(leader["endpoint"]) if leader.get("endpoint") in urls else None


def schema_url(dsn: str, schema: str) -> str:
    base, _ = split_schema(dsn)
    return f"{base}{'&' if '?' in base else '?'}schema={schema}"


# -- effects ----------------------------------------------------------------------------

@contextlib.contextmanager
def bench_schema(dsn: str, keep: bool = False) -> Iterator[str]:
    """A fresh schema for the run; yields the ``--offsets`` URL that uses it, drops it after."""
    import asyncpg

    base, _ = split_schema(dsn)
    schema = f"zbroker_failover_{os.getpid()}_{secrets.token_hex(3)}"

    async def execute(sql: str) -> None:
        conn = await asyncpg.connect(base, timeout=10)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(execute(f'CREATE SCHEMA "{schema}"'))
    try:
        yield schema_url(dsn, schema)
    finally:
        if not keep:
            asyncio.run(execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))


def free_port(hosts: tuple[str, ...] = HOSTS, span: int = 4) -> int:
    """A port p with p .. p+span-1 free on every host (each node binds its port and the next ones)."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = probe.getsockname()[1]
        if port + span < 65536 and all(_free(h, p) for h in hosts for p in range(port, port + span)):
            return port
    raise RuntimeError("no free port block on 127.0.0.1-3")


def _free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


class Nodes:
    """The three node process groups; stopped for good (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, port: int, data_root: Path, offsets_url: str, log_dir: Path) -> None:
        self.port, self.data_root, self.offsets_url, self.log_dir = port, data_root, offsets_url, log_dir
        self.procs: list[subprocess.Popen | None] = [None] * len(HOSTS)

    def start(self, index: int) -> None:
        bound = self.data_root / f"node{index + 1}" / "run" / "coordinator.bound"
        bound.unlink(missing_ok=True)  # left by a killed node; its successor writes it once bound
        log = open(self.log_dir / f"node{index + 1}.log", "ab")
        try:
            self.procs[index] = subprocess.Popen(node_command(sys.executable, index, self.port, self.data_root,
                                                              self.offsets_url),
                                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()

    def bound(self, index: int) -> bool:
        return (self.data_root / f"node{index + 1}" / "run" / "coordinator.bound").exists()

    def kill(self, index: int) -> None:
        """The node whole, as a lost host: every process of its session, the supervisor first
        (so that it restarts nothing). Each actor leads a process group of its own (for the
        terminal's Ctrl-C), so killpg reached the supervisor alone, its actors then stopped
        cleanly, and the failover measured was a clean stop's, not a lost host's."""
        proc = self.procs[index]
        if proc is not None:
            import psutil

            members = []
            for pid in psutil.pids():
                with contextlib.suppress(OSError):
                    if pid != proc.pid and os.getsid(pid) == proc.pid:
                        members.append(pid)
            for pid in [proc.pid, *members]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait(30)
            self.procs[index] = None

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for i, proc in enumerate(self.procs):
            if proc is None:
                continue
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            with contextlib.suppress(ProcessLookupError):  # actors of a group whose supervisor left first
                os.killpg(proc.pid, signal.SIGKILL)
            self.procs[i] = None


def _wait(what: str, condition, timeout_s: float, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value is not None and value is not False:
            return value
        time.sleep(every_s)
    raise RuntimeError(f"{what}: not within {timeout_s:g} s")


class Prober:
    """A group member that polls without pause and tells the timer which node answered."""

    def __init__(self, urls: list[str], request_timeout: float) -> None:
        from zbroker.client.sync import Connection

        self.conn = Connection(",".join(urls), request_timeout=request_timeout)
        self.member_id, self.generation = "", -1

    def poll_once(self) -> str:
        """One poll (joining first when needed); returns the URL that answered. Raises on failure."""
        from zbroker.protocol import messages as m
        from zbroker.protocol.errors import ErrorCode, ZBrokerError

        if self.generation < 0:
            reply = self.conn.coordinator(m.Join(group=GROUP, topics=[TOPIC], member_id=self.member_id))
            self.member_id, self.generation = reply.member_id, reply.generation
        try:
            self.conn.coordinator(m.Poll(group=GROUP, member_id=self.member_id, generation=self.generation,
                                         max_records=100, max_wait_ms=100))
        except ZBrokerError as err:
            if err.code in (ErrorCode.UNKNOWN_MEMBER, ErrorCode.FENCED):
                self.generation = -1  # the new leader does not know this generation: join again
                if err.code is ErrorCode.UNKNOWN_MEMBER:
                    self.member_id = ""
            raise
        # Leases taken are left to time out: the measure is the coordinator answering.
        return self.conn.url

    def close(self) -> None:
        self.conn.close()


def _leader(nodes: Nodes) -> int | None:
    from zbroker.storage.offsets.cluster_view import read_cluster_view

    try:
        return leader_index(asyncio.run(read_cluster_view(nodes.offsets_url)), nodes.port)
    except Exception:  # the tables not made yet (no node has migrated): nobody leads
        return None


def run_bench(args: argparse.Namespace) -> dict:
    from zbroker.actors.runtime import configure_logging
    from zbroker.client import Admin, Producer

    configure_logging("warning")  # the client's redirects are info lines, on stderr; stdout is the JSON
    port = args.port or free_port()
    work = Path(args.work_dir or f"/tmp/zbroker-failover-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    timer = FailoverTimer()
    with bench_schema(args.offsets, keep=args.keep) as offsets_url:
        nodes = Nodes(port, work, offsets_url, work)
        prober = None
        try:
            for i in range(len(HOSTS)):
                nodes.start(i)
            _wait("a leader", lambda: _leader(nodes) is not None, args.start_timeout)
            urls = ",".join(node_urls(port))
            with Admin(urls) as admin:
                admin.create_topic(TOPIC, partitions=3)
            with Producer(urls) as producer:
                for n in range(30):
                    producer.send(TOPIC, f"r{n}".encode(), partition=n % 3)
                producer.flush()
            prober = Prober(node_urls(port), args.request_timeout)
            _wait("a first poll", lambda: _try(prober.poll_once), args.start_timeout)
            for _round in range(args.kills):
                _wait("all nodes bound", lambda: all(nodes.bound(i) for i in range(len(HOSTS))), args.start_timeout)
                leader = _wait("a leader", lambda: _leader(nodes), args.start_timeout)
                killed_url = node_urls(port)[leader]
                timer.killed(killed_url, time.monotonic())
                nodes.kill(leader)
                deadline = time.monotonic() + args.round_timeout
                took = None
                while took is None:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"no poll answered within {args.round_timeout:g} s of killing "
                                           f"{killed_url} (round {_round + 1})")
                    try:
                        url = prober.poll_once()
                    except Exception:
                        timer.poll_failed()
                        time.sleep(0.01)
                        continue
                    took = timer.poll_answered(url, time.monotonic())
                nodes.start(leader)
        finally:
            if prober is not None:
                prober.close()
            nodes.stop_all()
            if not args.keep and not args.work_dir:
                shutil.rmtree(work, ignore_errors=True)
    result = summarize(timer.times_s)
    result.update({"times_s": [round(t, 3) for t in timer.times_s], "failed_polls": timer.failed_polls,
                   "client_request_timeout_s": args.request_timeout, "nodes": len(HOSTS),
                   "lease_ms": 5000, "port": port})  # zbroker up's default --coordinator-lease-ms
    return result


def _try(fn) -> bool:
    try:
        fn()
    except Exception:
        return False
    return True


def run(scale: float = 1.0) -> dict:
    """For bench/harness.py: 20 kills at scale 1 (the issue's minimum), at least 3."""
    return run_bench(_parser().parse_args(["--kills", str(max(3, round(20 * scale)))]))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.coordinator_failover", description=__doc__.split("\n\n")[0])
    p.add_argument("--offsets", default=os.environ.get("ZBROKER_TEST_PG_DSN",
                                                       "postgresql://postgres@127.0.0.1:5432/test"),
                   help="PostgreSQL DSN; a fresh schema in it is made and dropped")
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--port", type=int, default=0, help="the nodes' port on each address (default: a free one)")
    p.add_argument("--request-timeout", type=float, default=5.0, help="the consumer's request timeout, s")
    p.add_argument("--round-timeout", type=float, default=60.0)
    p.add_argument("--start-timeout", type=float, default=90.0)
    p.add_argument("--work-dir", default=None, help="node data directories and logs (default /tmp/...)")
    p.add_argument("--keep", action="store_true", help="keep the schema and the work directory")
    return p


def main(argv: list[str] | None = None) -> None:
    try:
        result = run_bench(_parser().parse_args(argv))
    except RuntimeError as exc:
        raise SystemExit(f"coordinator failover: {exc}") from None
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
