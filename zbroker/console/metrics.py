"""The /metrics families, built from a `Snapshot` with prometheus_client (pure: no I/O).

prometheus_client formats the text exposition (escaping, `_total`, histogram
`_bucket`/`_sum`/`_count`, HELP/TYPE lines) the way every scraper expects; the
console only decides what the figures are. A custom collector rather than
Gauge/Counter objects: every figure is read from the broker at scrape time, nothing
is counted in the console, so a console restart invents and loses nothing.

Counters come from totals the broker keeps: records produced are the sum of log ends
(offsets never go back, so that one survives every restart); redeliveries and dead
letters are the coordinator's in-memory counts and reset when it restarts, which
Prometheus reads as the counter reset it is; CPU seconds are per pid and reset with it.
"""

from __future__ import annotations

from typing import Iterable

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily)
from prometheus_client.registry import Collector, CollectorRegistry

from zbroker.console.model import _SEVERITY, History, Snapshot, judge_group

PART = ["topic", "partition"]
GROUP_PART = ["group", "topic", "partition"]
ACTOR = ["kind", "actor_id"]


def families(snap: Snapshot, history: History | None = None) -> list:
    out: list = []
    out += _partition_families(snap)
    out += _group_families(snap, history)
    out += _writer_families(snap)
    out += _actor_families(snap)
    return out


def _gauge(name: str, doc: str, labels: list[str], rows: Iterable[tuple[list, float]]) -> GaugeMetricFamily:
    fam = GaugeMetricFamily(name, doc, labels=labels)
    for values, v in rows:
        fam.add_metric([str(x) for x in values], v)
    return fam


def _counter(name: str, doc: str, labels: list[str], rows: Iterable[tuple[list, float]]) -> CounterMetricFamily:
    fam = CounterMetricFamily(name, doc, labels=labels)
    for values, v in rows:
        fam.add_metric([str(x) for x in values], v)
    return fam


def _parts(snap: Snapshot):
    for topic in sorted(snap.topics):
        for p in snap.topics[topic].get("partitions", []):
            yield topic, p


def _partition_families(snap: Snapshot) -> list:
    parts = list(_parts(snap))
    out = [
        _gauge("zbroker_partition_log_end_offset", "The next offset a partition will write.", PART,
               (([t, p["partition"]], p["log_end"]) for t, p in parts if p.get("log_end") is not None)),
        _gauge("zbroker_partition_log_start_offset", "The first offset a partition still holds.", PART,
               (([t, p["partition"]], p["log_start"]) for t, p in parts if p.get("log_start") is not None)),
        _gauge("zbroker_partition_size_bytes", "Bytes a partition's log holds on disk.", PART,
               (([t, p["partition"]], p["bytes"]) for t, p in parts if p.get("bytes") is not None)),
        _counter("zbroker_records_produced", "Records ever produced to a topic (the sum of its log ends).",
                 ["topic"], (([t], snap.produced_total(t)) for t in sorted(snap.topics))),
    ]
    # Payload bytes the partitions' owners appended since their processes started (an older
    # broker does not report them): a partition actor's restart is a counter reset.
    if any("bytes_appended" in p for _, p in parts):
        sums: dict = {}
        for t, p in parts:
            sums[t] = sums.get(t, 0) + (p.get("bytes_appended") or 0)
        out.append(_counter("zbroker_bytes_produced", "Record batch payload bytes produced to a topic.", ["topic"],
                            (([t], n) for t, n in sorted(sums.items()))))
    # Replication figures, when the broker reports them (additive fields of describe_topic).
    if any("isr" in p for _, p in parts):
        out.append(_gauge("zbroker_partition_isr_size", "Replicas in sync.", PART,
                          (([t, p["partition"]], len(p.get("isr") or [])) for t, p in parts if "isr" in p)))
        out.append(_gauge("zbroker_partition_under_replicated", "1 when fewer replicas are in sync than exist.",
                          PART, (([t, p["partition"]], int(len(p.get("isr") or []) < len(p.get("replicas") or [])))
                                 for t, p in parts if "isr" in p)))
    if any("leader_epoch" in p for _, p in parts):
        out.append(_gauge("zbroker_partition_leader_epoch", "The partition leader's epoch.", PART,
                          (([t, p["partition"]], p["leader_epoch"]) for t, p in parts
                           if p.get("leader_epoch") is not None)))
    return out


def _group_families(snap: Snapshot, history: History | None) -> list:
    rows = [(g, p) for g in sorted(snap.groups) for p in snap.groups[g].get("partitions", [])]

    def per(field: str, scale: float = 1.0):
        for g, p in rows:
            if p.get(field) is not None:
                yield [g, p["topic"], p["partition"]], p[field] * scale

    def lag_seconds():
        for g, p in rows:
            if p.get("lag") is not None:
                age = p.get("oldest_unfinished_age_ms")
                yield [g, p["topic"], p["partition"]], 0.0 if not p["lag"] or age is None else age / 1000

    def blocker_age():
        for g, p in rows:
            b = p.get("blocker")
            yield [g, p["topic"], p["partition"]], (b.get("since_ms") or 0) / 1000 if b else 0.0

    def by_reason(field: str):
        sums: dict = {}
        for g, p in rows:
            for reason, n in (p.get(field) or {}).items():
                sums[(g, reason)] = sums.get((g, reason), 0) + n
        return (([g, r], n) for (g, r), n in sorted(sums.items()))

    out = [
        _gauge("zbroker_group_committed_offset", "The group's durable committed offset.", GROUP_PART,
               per("committed")),
        _gauge("zbroker_group_lag", "Records from the committed offset to the log end (as groups describe).",
               GROUP_PART, per("lag")),
        _gauge("zbroker_group_lag_seconds", "How long the first unfinished record has been in the log.",
               GROUP_PART, lag_seconds()),
        _gauge("zbroker_group_in_flight", "Records leased to members and not yet finished (unacked).",
               GROUP_PART, per("in_flight")),
        _gauge("zbroker_group_oldest_unfinished_seconds",
               "How long the record at the committed offset (the commit blocker) has been in its state.",
               GROUP_PART, blocker_age()),
        _gauge("zbroker_group_members", "Live members of a group.", ["group"],
               (([g], len(snap.groups[g].get("members", []))) for g in sorted(snap.groups))),
        _counter("zbroker_redelivered", "Records handed out again, by why they came back.", ["group", "reason"],
                 by_reason("redeliveries_by_reason")),
        _counter("zbroker_dead_lettered", "Records confirmed in a dead-letter topic, by why.", ["group", "reason"],
                 by_reason("dead_letters_by_reason")),
    ]
    if history is not None:
        out.append(_gauge("zbroker_group_status", "Burrow-style status: 0 OK, 1 WARN, 2 STALL, 3 STOP.",
                          ["group"], (([g], _SEVERITY[judge_group(history, g)[0].word]) for g in sorted(snap.groups))))
    return out


def _actor(snap: Snapshot, kind: str) -> dict | None:
    return next((a for a in snap.actors() if a.get("kind") == kind), None)


def _writer_families(snap: Snapshot) -> list:
    writer = _actor(snap, "commit-writer")
    metrics = (writer or {}).get("metrics") or {}
    out = []
    buckets = metrics.get("flush_ms_buckets")
    if buckets:
        cumulative, total = [], 0
        for bound, n in buckets:
            total += n
            cumulative.append(("+Inf" if bound is None else repr(bound / 1000), total))
        fam = HistogramMetricFamily("zbroker_commit_flush_seconds", "Commit writer flush latency.")
        fam.add_metric([], cumulative, sum_value=(metrics.get("flush_ms_sum") or 0) / 1000)
        out.append(fam)
    if "pending_keys" in metrics:
        out.append(_gauge("zbroker_commit_pending_keys", "Offsets advanced but not yet flushed.", [],
                          [([], metrics["pending_keys"])]))
    if "flush_errors" in metrics:
        out.append(_counter("zbroker_commit_flush_errors", "Flushes the offset store refused.", [],
                            [([], metrics["flush_errors"])]))
    coord = _actor(snap, "group-coordinator")
    if coord is not None and coord.get("coordinator_epoch") is not None:  # absent from an older coordinator
        out.append(_gauge("zbroker_coordinator_epoch", "The lease epoch the coordinator decides under.", [],
                          [([], coord["coordinator_epoch"])]))
    stats = (coord or {}).get("statistics") or {}
    if stats:
        out.append(_counter("zbroker_rebalances", "Group rebalances since the coordinator started.", [],
                            [([], stats.get("rebalances", 0))]))
        out.append(_gauge("zbroker_coordinator_range_entries", "Ranges the coordinator keeps for all groups.", [],
                          [([], stats.get("range_entries", 0))]))
    return out


def _actor_families(snap: Snapshot) -> list:
    actors = [a for a in snap.actors() if a.get("kind")]
    up = _gauge("zbroker_actor_up", "1 while an actor is alive and registered.", ACTOR, [])
    healthy = _gauge("zbroker_actor_healthy", "1 while an actor reports itself healthy.", ACTOR, [])
    rss = _gauge("zbroker_actor_resident_memory_bytes", "An actor's resident memory.", ACTOR, [])
    cpu = _counter("zbroker_actor_cpu_seconds", "CPU time (user + system) of an actor's process.", ACTOR, [])
    fds = _gauge("zbroker_actor_open_fds", "Open file descriptors of an actor's process.", ACTOR, [])
    max_fds = _gauge("zbroker_actor_max_fds", "The open files limit of an actor's process.", ACTOR, [])
    for a in actors:
        labels = [a["kind"], a.get("actor_id") or a["kind"]]
        up.add_metric(labels, 1.0 if a.get("alive", True) else 0.0)
        healthy.add_metric(labels, 1.0 if a.get("healthy") else 0.0)
        proc = snap.procs.get(a.get("pid"))
        if proc is not None:
            rss.add_metric(labels, proc.rss_bytes)
            cpu.add_metric(labels, proc.cpu_seconds)
            fds.add_metric(labels, proc.open_fds)
            if proc.max_fds is not None:
                max_fds.add_metric(labels, proc.max_fds)
    return [up, healthy, rss, cpu, fds, max_fds]


class SnapshotCollector(Collector):
    """Hands prometheus_client the families of whatever snapshot `source()` returns."""

    def __init__(self, source) -> None:
        self._source = source

    def collect(self):
        snap, history = self._source()
        if snap is None:
            return iter(())
        return iter(families(snap, history))


def registry_for(source) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(source))
    return registry
