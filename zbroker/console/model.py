"""What the console knows, and the judgements it makes from it: pure, no sockets, no clock.

Theory of operation. Once a second (and on demand, at most that often) the console's
shell asks the coordinator for `status`, `list_topics` + `describe_topic` per topic and
`list_groups` + `describe_group` per group, and reads /proc for each actor's pid. Those
answers become one `Snapshot`. Everything the console shows, /metrics included, is
computed from the latest snapshot and a short history of earlier ones:

* rates (produce, commit) are differences of monotone totals between two snapshots:
  the total records produced to a topic is the sum of its partitions' log ends (offsets
  start at 0 and never go back), so it survives every actor restart;
* a partition's status word follows Burrow's rules (OK / WARN / STALL / STOP) over a
  window of samples of its committed offset and lag, and says how it was judged.

The cost of a snapshot follows the number of topics, partitions, groups and the ranges
the coordinator keeps, never the number of records.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Iterable

OK, WARN, STALL, STOP = "OK", "WARN", "STALL", "STOP"
_SEVERITY = {OK: 0, WARN: 1, STALL: 2, STOP: 3}


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The broker as seen at `at_s` (seconds, the shell's clock)."""
    at_s: float
    status: dict  # the `status` reply's fields
    topics: dict  # name -> describe_topic reply
    groups: dict  # name -> describe_group reply ("group" field of the reply)
    procs: dict = dataclasses.field(default_factory=dict)  # pid -> ProcStat
    errors: tuple = ()  # what could not be asked (shown, not hidden)

    def produced_total(self, topic: str | None = None) -> int:
        """Records ever produced (to `topic`, or to every topic but dead-letter ones)."""
        names = [topic] if topic is not None else list(self.topics)
        return sum(p.get("log_end") or 0 for t in names for p in self.topics.get(t, {}).get("partitions", []))

    def committed_total(self) -> int:
        """The sum of every group's committed offsets: its growth is what consumers finished."""
        return sum(p.get("committed") or 0 for g in self.groups.values() for p in g.get("partitions", []))

    def actors(self) -> list[dict]:
        return list(self.status.get("actors", []))


# -- rates -----------------------------------------------------------------------------------

class History:
    """The last `keep` snapshots, oldest first (the charts' minutes and the status window)."""

    def __init__(self, keep: int = 300) -> None:
        self._snaps: deque[Snapshot] = deque(maxlen=keep)

    def add(self, snap: Snapshot) -> None:
        self._snaps.append(snap)

    def latest(self) -> Snapshot | None:
        return self._snaps[-1] if self._snaps else None

    def __iter__(self):
        return iter(self._snaps)

    def __len__(self) -> int:
        return len(self._snaps)

    def series(self) -> dict:
        """[times], [produced/s], [committed/s]: one point per pair of snapshots."""
        snaps = list(self._snaps)
        times, produced, committed = [], [], []
        for a, b in zip(snaps, snaps[1:]):
            times.append(round(b.at_s, 3))
            produced.append(rate(a.produced_total(), b.produced_total(), a.at_s, b.at_s))
            committed.append(rate(a.committed_total(), b.committed_total(), a.at_s, b.at_s))
        return {"t": times, "produced": produced, "committed": committed}

    def topic_rate(self, topic: str, span_s: float = 10.0) -> float | None:
        pair = self._span(span_s)
        if pair is None:
            return None
        a, b = pair
        return rate(a.produced_total(topic), b.produced_total(topic), a.at_s, b.at_s)

    def group_rate(self, group: str, span_s: float = 10.0) -> float | None:
        """Records a group finished per second (its committed offsets' growth)."""
        pair = self._span(span_s)
        if pair is None:
            return None
        a, b = pair

        def total(s: Snapshot) -> int:
            return sum(p.get("committed") or 0 for p in s.groups.get(group, {}).get("partitions", []))
        return rate(total(a), total(b), a.at_s, b.at_s)

    def _span(self, span_s: float) -> tuple[Snapshot, Snapshot] | None:
        if len(self._snaps) < 2:
            return None
        last = self._snaps[-1]
        first = next((s for s in self._snaps if last.at_s - s.at_s <= span_s), self._snaps[0])
        if first is last:
            first = self._snaps[-2]
        return first, last


def rate(before: int, after: int, t0: float, t1: float) -> float:
    """Per second; a total that went down was reset (a topic recreated): counted from 0."""
    if t1 <= t0:
        return 0.0
    grown = after - before if after >= before else after
    return round(grown / (t1 - t0), 3)


# -- status words (Burrow's evaluation rules, on committed offsets and lag) -------------------

@dataclasses.dataclass(frozen=True)
class Judgement:
    word: str
    why: str

    @property
    def severity(self) -> int:
        return _SEVERITY[self.word]


def judge_partition(samples: list[tuple[int | None, int | None]], live_members: int,
                    window: int = 10) -> Judgement:
    """Burrow's rules over the last `window` samples of (committed, lag), oldest first.

    * lag 0 at the latest sample: OK, whatever came before (the consumer is caught up);
    * committed did not move over the window, lag > 0: STOP with no live member
      (nobody is consuming), else STALL (a member holds the group but the offset is
      stuck: a record that is never finished);
    * committed moved but lag grew at every step of the window: WARN (falling behind);
    * otherwise OK.
    Fewer than two samples judge on lag alone ("too few samples" says so).
    """
    samples = [s for s in samples[-window:] if s[0] is not None and s[1] is not None]
    if not samples:
        return Judgement(OK, "no committed offset yet")
    committed, lag = samples[-1]
    if lag == 0:
        return Judgement(OK, "lag is 0")
    if len(samples) < 2:
        if live_members == 0:
            return Judgement(STOP, f"lag {lag} and no live member (too few samples to see progress)")
        return Judgement(OK, f"lag {lag}; too few samples ({len(samples)}) to judge progress")
    first_committed = samples[0][0]
    span = len(samples)
    if committed == first_committed:
        if live_members == 0:
            return Judgement(STOP, f"committed stayed at {committed} over {span} samples, lag {lag}, no live member")
        return Judgement(STALL, f"committed stayed at {committed} over {span} samples with lag {lag} "
                                f"while {live_members} member(s) are live")
    lags = [s[1] for s in samples]
    if len(lags) >= 3 and all(b > a for a, b in zip(lags, lags[1:])):
        return Judgement(WARN, f"committed moves but lag grew at each of {span} samples "
                               f"({lags[0]} to {lags[-1]})")
    return Judgement(OK, f"committed moved {first_committed} to {committed} over {span} samples")


def judge_group(history: Iterable[Snapshot], group: str, window: int = 10) -> tuple[Judgement, dict]:
    """The group's word (its worst partition's) and each partition's judgement."""
    snaps = list(history)[-window:]
    if not snaps or group not in snaps[-1].groups:
        return Judgement(OK, "unknown group"), {}
    latest = snaps[-1].groups[group]
    live = len(latest.get("members", []))
    per: dict = {}
    for part in latest.get("partitions", []):
        key = (part["topic"], part["partition"])
        samples = []
        for s in snaps:
            for p in s.groups.get(group, {}).get("partitions", []):
                if (p["topic"], p["partition"]) == key:
                    samples.append((p.get("committed"), p.get("lag")))
        per[key] = judge_partition(samples, live, window)
    if not per:
        return Judgement(OK, "no partitions consumed yet"), per
    worst_key = max(per, key=lambda k: per[k].severity)
    worst = per[worst_key]
    if worst.word == OK:
        return Judgement(OK, "every partition OK"), per
    return Judgement(worst.word, f"{worst_key[0]}/{worst_key[1]}: {worst.why}"), per


# -- process figures from /proc -------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ProcStat:
    pid: int
    rss_bytes: int
    cpu_seconds: float
    open_fds: int
    max_fds: int | None


def parse_proc_stat(text: str, clock_ticks: int) -> float:
    """CPU seconds (user + system) from /proc/<pid>/stat; the command may hold spaces."""
    fields = text[text.rindex(")") + 2:].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / clock_ticks


def parse_status_rss(text: str) -> int:
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def parse_limits_nofile(text: str) -> int | None:
    """The soft limit of open files from /proc/<pid>/limits (None for unlimited)."""
    for line in text.splitlines():
        if line.startswith("Max open files"):
            soft = line[len("Max open files"):].split()[0]
            return None if soft == "unlimited" else int(soft)
    return None


# -- what the pages and `zbroker top` show ---------------------------------------------------

def group_rows(history: History, window: int = 10) -> list[dict]:
    """One row per group: its word, lag, in flight and the oldest blocker."""
    snap = history.latest()
    if snap is None:
        return []
    rows = []
    for name in sorted(snap.groups):
        g = snap.groups[name]
        verdict, _ = judge_group(history, name, window)
        parts = g.get("partitions", [])
        blockers = [dict(p["blocker"], topic=p["topic"], partition=p["partition"])
                    for p in parts if p.get("blocker")]
        blocker = max(blockers, key=lambda b: b.get("since_ms") or 0, default=None)
        rows.append({"group": name, "mode": g.get("mode"), "members": len(g.get("members", [])),
                     "lag": sum(p.get("lag") or 0 for p in parts),
                     "in_flight": sum(p.get("in_flight") or 0 for p in parts),
                     "rate": history.group_rate(name), "status": verdict.word, "why": verdict.why,
                     "blocker": blocker})
    return rows


def topic_rows(history: History) -> list[dict]:
    snap = history.latest()
    if snap is None:
        return []
    rows = []
    for name in sorted(snap.topics):
        t = snap.topics[name]
        parts = t.get("partitions", [])
        rows.append({"topic": name, "partitions": len(parts), "records": snap.produced_total(name),
                     "retained": sum((p.get("log_end") or 0) - (p.get("log_start") or 0) for p in parts),
                     "bytes": sum(p.get("bytes") or 0 for p in parts), "rate": history.topic_rate(name),
                     "config": t.get("config", {})})
    return rows


def worst(words: Iterable[str]) -> str:
    return max(words, key=_SEVERITY.__getitem__, default=OK)
