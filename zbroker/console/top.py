"""`zbroker top`: a live terminal view of topics and groups, drawn with rich.

It asks the coordinator what the console asks (one snapshot a refresh, through
`BrokerLink`), keeps the same `History`, and renders `model.topic_rows` and
`model.group_rows`: the figures are the console's, the terminal is the only
difference. `q` or Ctrl-C quits; the terminal's mode is restored however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import termios
import time
import tty

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from zbroker.console import model
from zbroker.console.link import BrokerLink
from zbroker.console.views import human_bytes, human_ms

_STYLE = {model.OK: "green", model.WARN: "yellow", model.STALL: "red", model.STOP: "magenta"}


def render(history: model.History, url: str, refreshes: int) -> Group:
    snap = history.latest()
    head = Text(f"zbroker top  {url}  refresh {refreshes}  (q quits)", style="bold")
    if snap is None:
        return Group(head, Text("no answer yet"))
    topics = Table(title="topics", expand=True)
    for col in ("topic", "partitions", "records", "produce/s", "bytes"):
        topics.add_column(col, justify="left" if col == "topic" else "right")
    for r in model.topic_rows(history):
        topics.add_row(r["topic"], str(r["partitions"]), str(r["records"]),
                       "-" if r["rate"] is None else f"{r['rate']:.1f}", human_bytes(r["bytes"]))
    groups = Table(title="groups", expand=True)
    for col in ("group", "status", "members", "lag", "in flight", "done/s", "blocker"):
        groups.add_column(col, justify="left" if col in ("group", "status", "blocker") else "right")
    for r in model.group_rows(history):
        b = r["blocker"]
        blocker = "-" if not b else (f"{b['topic']}/{b['partition']}@{b['offset']} {b.get('state')} "
                                     f"{human_ms(b.get('since_ms'))} x{b.get('attempt', 0)}")
        groups.add_row(r["group"], Text(r["status"], style=_STYLE[r["status"]]), str(r["members"]), str(r["lag"]),
                       str(r["in_flight"]), "-" if r["rate"] is None else f"{r['rate']:.1f}", blocker)
    parts = [head, topics, groups]
    parts += [Text(e, style="red") for e in snap.errors]
    return Group(*parts)


async def _top(url: str, interval_s: float, iterations: int | None, console: Console) -> int:
    link = BrokerLink(url, timeout_s=max(2.0, interval_s * 2))
    history = model.History(120)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    stdin = sys.stdin.fileno() if sys.stdin.isatty() else None

    def on_key() -> None:
        data = os.read(stdin, 64)
        if not data or b"q" in data or b"Q" in data or b"\x03" in data:
            stop.set()

    if stdin is not None:
        loop.add_reader(stdin, on_key)
    refreshes = 0
    try:
        with Live(render(history, url, 0), console=console, screen=console.is_terminal,
                  auto_refresh=False, transient=False) as live:
            while not stop.is_set():
                try:
                    status, topics, groups, errors = await link.gather()
                except Exception as err:
                    status, topics, groups, errors = {}, {}, {}, [f"cannot reach {url}: {err}"]
                history.add(model.Snapshot(time.time(), status, topics, groups, {}, tuple(errors)))
                refreshes += 1
                live.update(render(history, url, refreshes), refresh=True)
                if iterations is not None and refreshes >= iterations:
                    break
                with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), interval_s)
    finally:
        if stdin is not None:
            loop.remove_reader(stdin)
        link.close()
    return 0


def run_top(url: str, interval_s: float = 1.0, iterations: int | None = None) -> int:
    console = Console()
    saved = None
    if sys.stdin.isatty():
        saved = termios.tcgetattr(sys.stdin.fileno())
        tty.setcbreak(sys.stdin.fileno())  # keys arrive one at a time, unechoed
    try:
        return asyncio.run(_top(url, interval_s, iterations, console))
    finally:
        if saved is not None:
            termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, saved)
