"""Server CPU time from /proc/<pid>/stat.

A phase's server cost is (utime + stime) summed over the server's processes,
read just before and just after the phase. The kernel counts in clock ticks
(usually 100 per second), so short phases measure in steps of 10 ms: the
report says how many records a phase had, and readers should not trust a
per-record figure from a phase that took only a few ticks.

`parse_stat` is pure (text in, numbers out) so it can be tested on any
`comm`, including ones with spaces and parentheses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class ProcStat:
    pid: int
    comm: str
    ppid: int
    utime_ticks: int
    stime_ticks: int
    start_ticks: int  # since boot: tells a recycled pid from the process we sampled

    @property
    def cpu_ticks(self) -> int:
        return self.utime_ticks + self.stime_ticks


def parse_stat(text: str) -> ProcStat:
    """Parse one /proc/<pid>/stat line.

    `comm` is between the first "(" and the LAST ")": it may itself contain
    spaces and parentheses, so splitting the whole line on spaces is wrong.
    """
    open_paren = text.index("(")
    close_paren = text.rindex(")")
    pid = int(text[:open_paren].strip())
    comm = text[open_paren + 1 : close_paren]
    # Fields after comm, numbered as in proc(5): 3 = state, 4 = ppid, ...
    rest = text[close_paren + 1 :].split()

    def field(number: int) -> str:
        return rest[number - 3]

    return ProcStat(
        pid=pid,
        comm=comm,
        ppid=int(field(4)),
        utime_ticks=int(field(14)),
        stime_ticks=int(field(15)),
        start_ticks=int(field(22)),
    )


def read_stat(pid: int, proc_root: str = "/proc") -> ProcStat | None:
    """The process's stat, or None if it is gone."""
    try:
        with open(f"{proc_root}/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return parse_stat(f.read())
    except (FileNotFoundError, ProcessLookupError):
        return None


@dataclass(frozen=True)
class CpuSample:
    """CPU ticks per process at one moment; keyed by (pid, start time)."""

    ticks: dict[tuple[int, int], int]

    @staticmethod
    def take(pids: Iterable[int], proc_root: str = "/proc") -> "CpuSample":
        ticks = {}
        for pid in pids:
            stat = read_stat(pid, proc_root)
            if stat is not None:
                ticks[(stat.pid, stat.start_ticks)] = stat.cpu_ticks
        return CpuSample(ticks)


@dataclass(frozen=True)
class CpuDelta:
    seconds: float
    # Processes present at only one end (restarted, exited or new): their
    # CPU in between is unknown, so the figure is a lower bound when non-zero.
    unmatched: int


def cpu_delta(before: CpuSample, after: CpuSample, ticks_per_s: int = CLOCK_TICKS) -> CpuDelta:
    common = before.ticks.keys() & after.ticks.keys()
    ticks = sum(after.ticks[k] - before.ticks[k] for k in common)
    unmatched = len(before.ticks.keys() ^ after.ticks.keys())
    return CpuDelta(seconds=ticks / ticks_per_s, unmatched=unmatched)


def us_per_record(cpu_seconds: float | None, records: int) -> float | None:
    if cpu_seconds is None or records <= 0:
        return None
    return cpu_seconds * 1e6 / records


def pids_by_name(*names: str) -> list[int]:
    """Pids of processes whose name (comm) or executable basename is one of `names`."""
    import psutil

    wanted = set(names)
    found = []
    for proc in psutil.process_iter(["pid", "name", "exe"]):
        info = proc.info
        exe = os.path.basename(info.get("exe") or "")
        if info.get("name") in wanted or exe in wanted:
            found.append(info["pid"])
    return sorted(found)


def with_descendants(pids: Iterable[int], exclude: Iterable[int] = ()) -> list[int]:
    """`pids` plus all their descendants, minus `exclude` (e.g. our own pid)."""
    import psutil

    result = set()
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            result.add(pid)
            result.update(child.pid for child in proc.children(recursive=True))
        except psutil.NoSuchProcess:
            continue
    return sorted(result - set(exclude))
