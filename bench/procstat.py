"""Server CPU time from /proc/<pid>/stat.

A phase's server cost is (utime + stime) summed over the server's processes,
read just before and just after the phase. The kernel counts in clock ticks
(usually 100 per second), so short phases would measure in steps of 10 ms;
on Linux each process's POSIX CPU-time clock is read as well, to the
nanosecond, and used when both ends have it (`process_cpu_clock`).

`parse_stat` is pure (text in, numbers out) so it can be tested on any
`comm`, including ones with spaces and parentheses.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
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


def process_cpu_clock(pid: int) -> float | None:
    """Seconds of CPU the whole process `pid` has used, to the nanosecond, or None.

    Linux exposes every process's CPU-time clock as a POSIX clock id (the
    kernel's ``MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)``), readable like
    /proc/<pid>/stat but without its 10 ms ticks, which a 0.1-second phase
    cannot afford: one tick is a tenth of such a phase's CPU.
    """
    if not hasattr(time, "clock_gettime") or not sys.platform.startswith("linux"):
        return None
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except OSError:
        return None


@dataclass(frozen=True)
class CpuSample:
    """CPU ticks per process at one moment; keyed by (pid, start time).

    `precise` holds the same processes' CPU clocks in seconds where they could be
    read (the real /proc only); `cpu_delta` prefers them.
    """

    ticks: dict[tuple[int, int], int]
    precise: dict[tuple[int, int], float] = field(default_factory=dict)

    @staticmethod
    def take(pids: Iterable[int], proc_root: str = "/proc") -> "CpuSample":
        ticks, precise = {}, {}
        for pid in pids:
            stat = read_stat(pid, proc_root)
            if stat is not None:
                key = (stat.pid, stat.start_ticks)
                ticks[key] = stat.cpu_ticks
                clock = process_cpu_clock(pid) if proc_root == "/proc" else None
                if clock is not None:
                    precise[key] = clock
        return CpuSample(ticks, precise)

    def only(self, pid: int) -> "CpuSample":
        """The part of this sample that is about `pid`."""
        return CpuSample({k: v for k, v in self.ticks.items() if k[0] == pid},
                         {k: v for k, v in self.precise.items() if k[0] == pid})


@dataclass(frozen=True)
class CpuDelta:
    seconds: float
    # Processes present at only one end (restarted, exited or new): their
    # CPU in between is unknown, so the figure is a lower bound when non-zero.
    unmatched: int


def cpu_delta(before: CpuSample, after: CpuSample, ticks_per_s: int = CLOCK_TICKS) -> CpuDelta:
    common = before.ticks.keys() & after.ticks.keys()
    unmatched = len(before.ticks.keys() ^ after.ticks.keys())
    if common and all(k in before.precise and k in after.precise for k in common):
        return CpuDelta(seconds=sum(after.precise[k] - before.precise[k] for k in common), unmatched=unmatched)
    ticks = sum(after.ticks[k] - before.ticks[k] for k in common)
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
