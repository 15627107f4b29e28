"""The console actor's process: sample the broker once a second, serve HTTP (aiohttp).

HTTP lives here and only here: the coordinator and the partition actors never
parse a request line. The sampler asks the coordinator for a snapshot at a fixed
pace (SAMPLE_S), whatever the number of scrapers or browsers: a scrape reads the
latest snapshot and costs the broker nothing. /proc is read for the actors' pids
(the console runs on the broker's host, started by `zbroker up`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import structlog

from zbroker.console.link import BrokerLink
from zbroker.console.model import History, ProcStat, Snapshot, parse_limits_nofile, parse_proc_stat, parse_status_rss

SAMPLE_S = 1.0
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def read_proc(pid: int) -> ProcStat | None:
    base = Path("/proc") / str(pid)
    try:
        cpu = parse_proc_stat((base / "stat").read_text(), _TICKS)
        rss = parse_status_rss((base / "status").read_text())
        fds = len(os.listdir(base / "fd"))
        limit = parse_limits_nofile((base / "limits").read_text())
    except (OSError, ValueError, IndexError):
        return None  # gone meanwhile, or not ours to read
    return ProcStat(pid, rss, cpu, fds, limit)


class Sampler:
    def __init__(self, link: BrokerLink, *, keep: int = 300, clock=time.time) -> None:
        self.link = link
        self.history = History(keep)
        self.clock = clock
        self.log = structlog.get_logger("zbroker.console")
        self._failing = False
        self.ready = asyncio.Event()

    async def sample_once(self) -> Snapshot:
        errors: list = []
        try:
            status, topics, groups, errors = await self.link.gather()
        except Exception as err:  # the broker is down or restarting: shown, and tried again
            status, topics, groups, errors = {}, {}, {}, [f"cannot reach the coordinator: {err}"]
        pids = {a.get("pid") for a in status.get("actors", []) if a.get("pid")}
        pids.add(os.getpid())
        procs = {pid: p for pid in pids if (p := read_proc(pid)) is not None}
        own = {"kind": "console", "actor_id": "console", "pid": os.getpid(), "healthy": True, "alive": True}
        if status:
            status = dict(status, actors=[*status.get("actors", []), own])
        snap = Snapshot(self.clock(), status, topics, groups, procs, tuple(errors))
        self.history.add(snap)
        failing = bool(errors) and not status
        if failing != self._failing:
            (self.log.warning if failing else self.log.info)("broker.reachable" if not failing
                                                             else "broker.unreachable", errors=errors[:3])
            self._failing = failing
        self.ready.set()
        return snap

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            await self.sample_once()
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, SAMPLE_S - (time.monotonic() - started)))
            except (TimeoutError, asyncio.TimeoutError):
                pass

    def source(self):
        return self.history.latest(), self.history


async def serve(coordinator: str, host: str, port: int, token: str | None, curve=None,
                ready_file: str | None = None) -> None:
    from aiohttp import web

    from zbroker.console.web import make_app

    link = BrokerLink(coordinator, curve=curve)
    sampler = Sampler(link)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    app = make_app(sampler, link, token=token)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    structlog.get_logger("zbroker.console").info("console.listening", url=f"http://{host}:{port}/",
                                                 token=bool(token))
    task = asyncio.create_task(sampler.run(stop))
    await sampler.ready.wait()
    if ready_file:
        Path(ready_file).write_text(str(os.getpid()))
    await stop.wait()
    await task
    await runner.cleanup()
    link.close()


def run(coordinator: str, host: str, port: int, token: str | None = None, log_level: str = "info",
        curve_dir: str | None = None, ready_file: str | None = None) -> None:
    """The supervisor's entry point (`zbroker up` without `--http off`)."""
    from zbroker.actors import runtime

    runtime.configure_logging(log_level, actor="console")
    curve = None
    if curve_dir:
        from zbroker.actors.security import KeyRing
        curve = KeyRing(curve_dir).internal_client()
    asyncio.run(serve(coordinator, host, port, token, curve, ready_file))
