"""Server CPU time from /proc/<pid>/stat.

A phase's server cost is (utime + stime) summed over the server's processes,
read just before and just after the phase, plus the CPU of their children
that exited and were reaped meanwhile (cutime + cstime: Redis forks one to
rewrite its AOF) and of processes that started during the phase. The kernel counts in clock ticks
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
    children_ticks: int = 0  # cutime + cstime: children that exited and were waited for

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
        children_ticks=int(field(16)) + int(field(17)),
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
    # Reaped children's CPU (cutime + cstime) per process, in ticks.
    children: dict[tuple[int, int], int] = field(default_factory=dict)
    # Each process's parent pid: a child reaped between two samples is in its parent's cutime.
    ppids: dict[tuple[int, int], int] = field(default_factory=dict)
    # When the sample was taken, in clock ticks since boot (None if unknown): a process
    # that started later is new, and all of its CPU falls after this sample.
    taken_at_ticks: int | None = None

    @staticmethod
    def take(pids: Iterable[int], proc_root: str = "/proc") -> "CpuSample":
        taken_at = uptime_ticks(proc_root)
        ticks, precise, children, ppids = {}, {}, {}, {}
        for pid in pids:
            stat = read_stat(pid, proc_root)
            if stat is not None:
                key = (stat.pid, stat.start_ticks)
                ticks[key] = stat.cpu_ticks
                children[key] = stat.children_ticks
                ppids[key] = stat.ppid
                clock = process_cpu_clock(pid) if proc_root == "/proc" else None
                if clock is not None:
                    precise[key] = clock
        return CpuSample(ticks, precise, children, ppids, taken_at)

    def only(self, pid: int) -> "CpuSample":
        """The part of this sample that is about `pid`."""
        def mine(d: dict) -> dict:
            return {k: v for k, v in d.items() if k[0] == pid}
        return CpuSample(mine(self.ticks), mine(self.precise), mine(self.children), mine(self.ppids),
                         self.taken_at_ticks)

    def merged(self, other: "CpuSample") -> "CpuSample":
        """This sample and `other` (other processes, read a moment later) as one."""
        return CpuSample({**self.ticks, **other.ticks}, {**self.precise, **other.precise},
                         {**self.children, **other.children}, {**self.ppids, **other.ppids},
                         self.taken_at_ticks)


def uptime_ticks(proc_root: str = "/proc") -> int | None:
    """Clock ticks since boot (the unit of a process's start time), or None."""
    try:
        with open(f"{proc_root}/uptime", encoding="ascii") as f:
            return round(float(f.read().split()[0]) * CLOCK_TICKS)
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class CpuDelta:
    seconds: float
    # Processes present at only one end (restarted, exited or new): their
    # CPU in between is unknown, so the figure is a lower bound when non-zero.
    unmatched: int
    # Processes whose CPU is in `seconds` (present at both ends, or started in between).
    # 0 means nothing was measured: `seconds` is then no figure, not zero CPU.
    measured: int = 0


def cpu_delta(before: CpuSample, after: CpuSample, ticks_per_s: int = CLOCK_TICKS) -> CpuDelta:
    """CPU used between two samples by the processes in them.

    Processes in both: their own CPU, plus what their reaped children used
    meanwhile. Processes only in `after` that started after `before` was taken:
    all of their CPU. Anything else present at one end only (exited, or a pid
    the first sample missed) is counted in `unmatched`.

    A parent's cutime grows by a reaped child's whole life; when that child was
    in `before` (alive then, perhaps counted in full as new by the phase before),
    what it had used by then is not this interval's and is taken off again.
    """
    common = before.ticks.keys() & after.ticks.keys()
    started = before.taken_at_ticks
    new = {k for k in after.ticks.keys() - before.ticks.keys() if started is not None and k[1] >= started}
    unmatched = len(before.ticks.keys() ^ after.ticks.keys()) - len(new)
    parent_key = {k[0]: k for k in common}
    counted_before: dict[tuple[int, int], int] = {}
    for k in before.ticks.keys() - after.ticks.keys():
        parent = parent_key.get(before.ppids.get(k, -1))
        if parent is not None:
            counted_before[parent] = counted_before.get(parent, 0) + before.ticks[k] + before.children.get(k, 0)
    children = sum(max(0, after.children.get(k, 0) - before.children.get(k, 0) - counted_before.get(k, 0))
                   for k in common)
    children += sum(after.children.get(k, 0) for k in new)
    if all(k in before.precise and k in after.precise for k in common) and all(k in after.precise for k in new):
        own = sum(after.precise[k] - before.precise[k] for k in common) + sum(after.precise[k] for k in new)
        if common or new:
            return CpuDelta(seconds=own + children / ticks_per_s, unmatched=unmatched,
                            measured=len(common) + len(new))
    ticks = sum(after.ticks[k] - before.ticks[k] for k in common) + sum(after.ticks[k] for k in new)
    return CpuDelta(seconds=(ticks + children) / ticks_per_s, unmatched=unmatched,
                    measured=len(common) + len(new))


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
