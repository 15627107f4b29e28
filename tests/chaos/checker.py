"""The chaos checker: histories in, a verdict out. Pure: no sockets, no processes, no clock.

Theory of operation
-------------------
A chaos run leaves five histories, all timed with ``time.monotonic_ns()``
(CLOCK_MONOTONIC is one clock for every process on a Linux machine):

* producer acks: record id -> (partition, offset, ack time); a record counts
  as *acknowledged* once `Producer.flush` returned its offset;
* consumer finishes: (record id, partition, offset, time, consumer); a
  consumer journals a record (write to an fd, no fsync: a SIGKILL keeps the
  page cache) *before* it acks it, so a finish time precedes every effect of
  the ack;
* deliveries (optional): which consumer received which offsets, when (and
  when it had asked: the lease was granted in between);
* committed-offset samples: (time, source, group, topic, partition,
  committed, holes), read from the ``consumer_group_offsets`` table
  (source ``pg``) and from ``describe_group`` (``describe``: what the
  coordinator reports durable; ``describe_pending``: its in-memory value).
  A sample's time is taken *after* the answer arrived, so the value existed
  at that time;
* nemesis events: what was killed, cut or started, and when;

plus the partition logs as read at the end (record id at every offset).

The checks:

* **lost**: an acknowledged record that no consumer ever finished, or whose
  acknowledged offset holds something else in the log. Must be 0.
* **regressions**: per (source, group, topic, partition), a durable source
  (``pg``, ``describe``) never shows a committed offset lower than an earlier
  sample of the same source (the run never resets a group); and the table
  never shows less than what ``describe`` reported durable before the table
  was read (source ``describe>pg``: the writer answers "durable" only after
  its statement committed). Must be 0.
* **committed past unfinished**: at a sample taken at time t with committed
  C, every offset below C that exists in the log has a finish at or before t;
  and so does every offset inside a stored hole (acked ranges above C, which a
  restarted coordinator skips). Checked for every source. Must be 0. One
  violation is counted per offending sample; the first offending offset is
  named. A committed offset beyond the log end is reported separately, also 0.
* **duplicates**: every finish of a record id after its first. Allowed, and
  explained: two consumers (or one, twice) were handed the record, so the
  earlier lease was lost between the two deliveries, and something that can
  cause that (see `REDELIVERING`) happened in between. A coordinator kill in
  between is the cause (it forgets all that was not durable); else the
  latest such event; a ``rebalance`` (a consumer saw a new generation,
  journaled by the consumers) is traced back to the redelivering event that
  preceded it within `REBALANCE_ROOT_S`. None means nothing could have
  caused it but a lease that expired. Each nemesis event is shown with what was *in
  flight* when it happened, from the latest ``pg`` sample before it: records
  delivered but not durably committed, and the subset already finished (what
  a lost ack or a revoked lease can make a consumer do twice). Deliveries of
  offsets that the table already showed finished are counted apart: no crash
  explains those.

A replicated run (``History.min_insync`` > 0) adds each replica's log as
read from its data directory after the run (record id and a digest of the
stored batch's bytes at every offset), the high watermark each replica is
vouched for (the final leader's, for the members of the final ISR), and the
controller's view sampled through the run (leader, leader epoch, ISR, high
watermark per partition). Three more checks, each must be 0:

* **under-replicated acks**: an acknowledged record that fewer than
  ``min_insync`` replicas hold at its offset byte for byte (same record,
  same batch digest). The final logs are the evidence: a record acknowledged
  while only one replica had it is gone from the others, or was never there,
  once that replica lost its disk or was truncated.
* **divergence**: two replicas whose logs differ at an offset below the
  smaller of their two high watermarks (or one that lacks an offset below
  its own high watermark). A replica's high watermark is the highest it was
  ever vouched for: the final one, or one the controller showed while the
  replica was in the ISR (since its disk was last lost), see
  `vouched_high_watermarks`. Above it, a divergent tail is allowed: it is
  what truncation by leader epoch removes.
* **epoch regressions**: a partition's leader epoch, sampled from the
  controller, lower than an earlier sample's.

A cluster run (``History.epochs`` not empty: several nodes, one coordinator
lease in PostgreSQL) adds what the store holds about its writers: every
coordinator epoch ever taken, with when the database took it
(``zbroker_coordinator_epochs``), and the stored writes, each with the
epoch of the coordinator that wrote it and the database's time of the
write. Those come from the rows as they stand after the run and from an
audit trigger the test puts on the fenced tables, which also records the
lease row's epoch as the write landed. One more check, must be 0:

* **stale-epoch writes**: a stored write whose epoch is lower than the
  lease row's when it landed (the trigger saw it), or lower than the epoch
  in force at its time by the epoch history (the latest taken at or before
  it), or higher than that (an epoch not yet taken). Fencing (the lease row
  locked ``FOR SHARE`` in every fenced statement) must make these
  impossible: a former leader that wakes up can change nothing.

`check(history)` returns a `Report`; `Report.to_json()` and
`Report.to_table()` render it.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from array import array
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterable

NEVER = (1 << 63) - 1  # "finished at" of a record that never was
DURABLE_SOURCES = ("pg", "describe")
# Nemesis events, shown with what was in flight when they happened.
ROOT_KINDS = ("kill-actor", "kill-consumer", "start-consumer", "pg-cut", "kill-node", "pause-node", "failover")
# Those that can make a finished record be delivered again: the coordinator forgets acks that
# were not durable, a dead consumer's acks never arrive, and a consumer that comes or goes
# makes the group rebalance, which revokes leases whose acks then arrive stale. Killing a
# partition actor or the writer, or cutting the database, only delays: the acks stay in the
# coordinator's memory. A duplicate is blamed on one of these directly, or through a rebalance
# that followed one within REBALANCE_ROOT_S. In a cluster, the leading node killed or paused,
# and a ``failover`` (the run saw a new coordinator epoch in the lease row, whatever caused it),
# are a coordinator restart on another node: the leases of the former leader end.
REDELIVERING = (("kill-actor", "coordinator"), ("kill-consumer", None), ("start-consumer", None),
                ("kill-node", None), ("pause-node", None), ("failover", None))
COORDINATOR_LOST = ("kill-actor", "kill-node", "pause-node", "failover")
REBALANCE = "rebalance"
REBALANCE_ROOT_S = 15.0
DETAIL_LIMIT = 50  # violations listed in full per kind (all are counted)


# -- inputs ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ProducerAck:
    record_id: int
    partition: int
    offset: int
    time_ns: int


@dataclass(frozen=True, slots=True)
class ConsumerFinish:
    record_id: int
    partition: int
    offset: int
    time_ns: int
    consumer: str


@dataclass(frozen=True, slots=True)
class Delivery:
    consumer: str
    partition: int
    offset: int
    time_ns: int  # when the consumer had the record in hand
    polled_ns: int | None = None  # when it asked: the lease was granted between the two

    @property
    def leased_after_ns(self) -> int:
        return self.time_ns if self.polled_ns is None else self.polled_ns


@dataclass(frozen=True, slots=True)
class CommitSample:
    time_ns: int
    source: str  # "pg" | "describe" | "describe_pending"
    group: str
    topic: str
    partition: int
    committed: int | None
    holes: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class NemesisEvent:
    time_ns: int
    kind: str  # kill-actor | kill-consumer | start-consumer | pg-cut | pg-restore | rebalance
    target: str  # the actor, the consumer, "postgresql"
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ReplicaEntry:
    """One offset of one replica's log: whose record it is, and a digest of its stored batch's bytes."""
    record_id: int | None
    batch_digest: str


@dataclass(frozen=True, slots=True)
class LeaderSample:
    """The controller's view of one partition (`describe_topic`), at a time."""
    time_ns: int
    partition: int
    leader: str | None
    leader_epoch: int
    isr: tuple[str, ...]
    high_watermark: int | None


@dataclass(frozen=True, slots=True)
class EpochTaken:
    """One row of ``zbroker_coordinator_epochs``: an epoch, its node, when the database took it."""
    epoch: int
    holder: str
    taken_at_us: int  # the database's clock, microseconds since 1970


@dataclass(frozen=True, slots=True)
class StoredWrite:
    """A write to a fenced table, as the store shows it."""
    table: str
    key: str
    coordinator_epoch: int  # the writer's (0: written without an epoch, unfenced)
    written_at_us: int  # the database's clock
    lease_epoch: int | None = None  # the lease row's epoch as it landed (the audit trigger); None: a final row


def can_redeliver(event: NemesisEvent) -> bool:
    return any(event.kind == kind and target in (None, event.target) for kind, target in REDELIVERING)


@dataclass
class History:
    topic: str
    group: str
    log: dict[int, list[int | None]]  # partition -> record id at offset 0 .. log_end-1 (None: not ours)
    acks: list[ProducerAck] = field(default_factory=list)
    finishes: list[ConsumerFinish] = field(default_factory=list)
    samples: list[CommitSample] = field(default_factory=list)
    events: list[NemesisEvent] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    produce_failures: int = 0  # records a producer sent without getting an offset back
    meta: dict = field(default_factory=dict)  # passed through to the report (seed, duration, ...)
    # A replicated run only (min_insync > 0):
    min_insync: int = 0
    replica_logs: dict[str, dict[int, list[ReplicaEntry]]] = field(default_factory=dict)  # replica -> partition
    replica_hw: dict[str, dict[int, int]] = field(default_factory=dict)  # replica -> partition -> vouched HW
    leadership: list[LeaderSample] = field(default_factory=list)
    # A cluster run only (epochs not empty):
    epochs: list[EpochTaken] = field(default_factory=list)
    stored_writes: list[StoredWrite] = field(default_factory=list)


# -- outputs -----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Lost:
    record_id: int
    partition: int
    offset: int
    reason: str


@dataclass(frozen=True, slots=True)
class Regression:
    source: str
    group: str
    topic: str
    partition: int
    before_ns: int
    before: int
    at_ns: int
    committed: int


@dataclass(frozen=True, slots=True)
class PastUnfinished:
    source: str
    group: str
    topic: str
    partition: int
    at_ns: int
    committed: int
    offset: int  # the first offending offset of this sample
    record_id: int | None
    finished_ns: int | None  # its first finish (after at_ns), or None: never
    where: str  # "below committed" | "in hole [s, e)"
    offending: int  # offending offsets in this sample (counted for the first DETAIL_LIMIT samples only)


@dataclass(frozen=True, slots=True)
class BeyondLogEnd:
    source: str
    partition: int
    at_ns: int
    committed: int
    log_end: int


@dataclass(frozen=True, slots=True)
class DurableRedelivery:
    """A delivery of an offset that a ``pg`` sample had already shown durably finished."""

    consumer: str
    partition: int
    offset: int
    at_ns: int  # the consumer asked for records at this time, and got this one
    durable_since_ns: int


@dataclass(frozen=True, slots=True)
class UnderReplicated:
    """An acknowledged record that fewer than min_insync replicas hold byte for byte."""
    record_id: int
    partition: int
    offset: int
    copies: int  # replicas holding it with one batch digest (the largest such set)
    holders: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Divergence:
    partition: int
    replica: str
    other: str  # "" when `replica` lacks an offset below its own high watermark
    offset: int  # the first offset where they differ
    below: int  # the high watermark both are vouched for


@dataclass(frozen=True, slots=True)
class EpochRegression:
    partition: int
    before_ns: int
    before: int
    at_ns: int
    epoch: int


@dataclass(frozen=True, slots=True)
class StaleWrite:
    """A stored write by a coordinator epoch that was not the current one when it landed."""
    table: str
    key: str
    coordinator_epoch: int
    written_at_us: int
    current_epoch: int  # the lease row's (evidence "lease row"), or the history's ("epoch history")
    evidence: str


@dataclass(slots=True)
class EventRow:
    time_ns: int
    kind: str
    target: str
    in_flight: int | None  # delivered, not durably committed (None: no pg sample yet, or not a root)
    finished_not_durable: int | None
    duplicates: int = 0  # duplicate finishes attributed to this event
    via_rebalance: int = 0  # ... of which through a rebalance that followed it

    @property
    def label(self) -> str:
        return f"{self.kind} {self.target}" if self.kind == "kill-actor" else self.kind


@dataclass
class Report:
    meta: dict
    counts: dict
    partitions: list[dict]
    lost: list[Lost]
    regressions: list[Regression]
    committed_past_unfinished: list[PastUnfinished]
    committed_beyond_log_end: list[BeyondLogEnd]
    events: list[EventRow]
    duplicates_by_cause: dict[str, int]
    redelivered_after_durable: list[DurableRedelivery] = field(default_factory=list)
    under_replicated: list[UnderReplicated] = field(default_factory=list)
    divergences: list[Divergence] = field(default_factory=list)
    epoch_regressions: list[EpochRegression] = field(default_factory=list)
    replicated: bool = False
    stale_writes: list[StaleWrite] = field(default_factory=list)
    clustered: bool = False

    @property
    def ok(self) -> bool:
        return not (self.lost or self.regressions or self.committed_past_unfinished
                    or self.committed_beyond_log_end or self.under_replicated or self.divergences
                    or self.epoch_regressions or self.stale_writes)

    def summary(self) -> dict:
        return {
            "verdict": "PASS" if self.ok else "FAIL",
            "lost": len(self.lost),
            "regressions": len(self.regressions),
            "committed_past_unfinished": len(self.committed_past_unfinished),
            "committed_beyond_log_end": len(self.committed_beyond_log_end),
            **({"under_replicated": len(self.under_replicated), "divergences": len(self.divergences),
                "epoch_regressions": len(self.epoch_regressions)} if self.replicated else {}),
            **({"stale_writes": len(self.stale_writes)} if self.clustered else {}),
            **self.counts,
        }

    def to_dict(self) -> dict:
        by_kind: dict[str, dict] = {}
        for ev in self.events:
            row = by_kind.setdefault(ev.label, {"events": 0, "duplicates": 0, "via_rebalance": 0,
                                                "in_flight": 0, "finished_not_durable": 0})
            row["events"] += 1
            row["duplicates"] += ev.duplicates
            row["via_rebalance"] += ev.via_rebalance
            row["in_flight"] += ev.in_flight or 0
            row["finished_not_durable"] += ev.finished_not_durable or 0
        return {
            "meta": self.meta,
            "summary": self.summary(),
            "partitions": self.partitions,
            "duplicates_by_cause": self.duplicates_by_cause,
            "events_by_kind": by_kind,
            "violations": {
                "lost": [dataclasses.asdict(v) for v in self.lost[:DETAIL_LIMIT]],
                "regressions": [dataclasses.asdict(v) for v in self.regressions[:DETAIL_LIMIT]],
                "committed_past_unfinished": [dataclasses.asdict(v)
                                              for v in self.committed_past_unfinished[:DETAIL_LIMIT]],
                "committed_beyond_log_end": [dataclasses.asdict(v)
                                             for v in self.committed_beyond_log_end[:DETAIL_LIMIT]],
                "under_replicated": [dataclasses.asdict(v) for v in self.under_replicated[:DETAIL_LIMIT]],
                "divergences": [dataclasses.asdict(v) for v in self.divergences[:DETAIL_LIMIT]],
                "epoch_regressions": [dataclasses.asdict(v) for v in self.epoch_regressions[:DETAIL_LIMIT]],
                "stale_writes": [dataclasses.asdict(v) for v in self.stale_writes[:DETAIL_LIMIT]],
            },
            "redelivered_after_durable": [dataclasses.asdict(v)
                                          for v in self.redelivered_after_durable[:DETAIL_LIMIT]],
            "events": [dataclasses.asdict(e) for e in self.events],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    def to_table(self) -> str:
        return render_table(self)


# -- the check ---------------------------------------------------------------------------

def check(history: History) -> Report:
    log = history.log
    first_finish = _first_finish_times(history)
    prefix_max = {p: _prefix_max(first_finish[p]) for p in log}
    range_max = {p: _BlockMax(first_finish[p]) for p in log}

    lost = _lost(history)
    samples = sorted((s for s in history.samples if s.topic == history.topic and s.group == history.group),
                     key=lambda s: s.time_ns)
    regressions = _regressions(samples)
    past, beyond = _past_unfinished(samples, log, first_finish, prefix_max, range_max)
    events, by_cause, dup_counts = _duplicates(history, samples)
    after_durable = _redelivered_after_durable(history, samples)

    acked_ids = {a.record_id for a in history.acks}
    finished_ids = {f.record_id for f in history.finishes}
    counts = {
        "acked": len(acked_ids),
        "produce_failures": history.produce_failures,
        "log_records": sum(len(v) for v in log.values()),
        "unacked_in_log": sum(1 for ids in log.values() for rid in ids if rid is not None and rid not in acked_ids),
        "finished_records": len(finished_ids),
        "finishes": len(history.finishes),
        "duplicates": dup_counts["total"],
        "duplicate_records": dup_counts["records"],
        "redelivered_offsets": dup_counts["same_offset"],
        "stored_twice": dup_counts["other_offset"],
        "redelivered_after_durable": len(after_durable),
        "events": len(events),
        "rebalances_seen": dup_counts["rebalances"],
        "samples": len(samples),
    }
    partitions = _partition_rows(history, samples)
    replicated = history.min_insync > 0
    if replicated:
        counts["replicas"] = len(history.replica_logs)
        counts["replica_records"] = sum(len(v) for logs in history.replica_logs.values() for v in logs.values())
        counts["leader_samples"] = len(history.leadership)
        counts["leader_changes"] = _leader_changes(history.leadership)
    clustered = bool(history.epochs)
    if clustered:
        counts["epochs_taken"] = len(history.epochs)
        counts["stored_writes"] = len(history.stored_writes)
        counts["audited_writes"] = sum(1 for w in history.stored_writes if w.lease_epoch is not None)
    return Report(meta=dict(history.meta), counts=counts, partitions=partitions, lost=lost,
                  regressions=regressions, committed_past_unfinished=past, committed_beyond_log_end=beyond,
                  events=events, duplicates_by_cause=by_cause, redelivered_after_durable=after_durable,
                  under_replicated=_under_replicated(history) if replicated else [],
                  divergences=_divergences(history) if replicated else [],
                  epoch_regressions=_epoch_regressions(history.leadership) if replicated else [],
                  replicated=replicated, stale_writes=_stale_writes(history) if clustered else [],
                  clustered=clustered)


def _stale_writes(history: History) -> list[StaleWrite]:
    """Writes whose epoch was not the lease's when they landed (see the module doc).

    An unfenced write (epoch 0) in a cluster is one too: the lease's epoch is at least 1."""
    taken = sorted(history.epochs, key=lambda e: (e.taken_at_us, e.epoch))
    times = [e.taken_at_us for e in taken]
    highest, running = [], 0
    for e in taken:
        running = max(running, e.epoch)
        highest.append(running)
    out = []
    for w in sorted(history.stored_writes, key=lambda w: w.written_at_us):
        if w.lease_epoch is not None and w.coordinator_epoch != w.lease_epoch:
            out.append(StaleWrite(w.table, w.key, w.coordinator_epoch, w.written_at_us, w.lease_epoch,
                                  "lease row"))
            continue
        i = bisect.bisect_right(times, w.written_at_us) - 1
        current = highest[i] if i >= 0 else 0
        if w.coordinator_epoch != current:
            out.append(StaleWrite(w.table, w.key, w.coordinator_epoch, w.written_at_us, current, "epoch history"))
    return out


def _under_replicated(history: History) -> list[UnderReplicated]:
    out = []
    for a in sorted(history.acks, key=lambda a: (a.partition, a.offset)):
        by_digest: dict[str, list[str]] = defaultdict(list)
        for replica, logs in sorted(history.replica_logs.items()):
            entries = logs.get(a.partition, [])
            if a.offset < len(entries) and entries[a.offset].record_id == a.record_id:
                by_digest[entries[a.offset].batch_digest].append(replica)
        holders = max(by_digest.values(), key=len, default=[])
        if len(holders) < history.min_insync:
            out.append(UnderReplicated(a.record_id, a.partition, a.offset, len(holders), tuple(holders)))
    return out


def vouched_high_watermarks(history: History) -> dict[str, dict[int, int]]:
    """Per replica and partition, the highest high watermark it was ever vouched for.

    The final ``replica_hw``, raised by the ISR history: a controller sample that lists a
    replica in the ISR with high watermark H says that replica then held the leader's
    records below H (the leader counts a follower's log end only from a fetch that does
    not diverge, and an ISR shrink takes effect only once the controller recorded it, so
    H never passes a member of the recorded ISR). Those records may never change again on
    that replica, except with its disk: samples before its last ``wipe-disk`` event count
    for nothing."""
    out = {r: dict(hws) for r, hws in history.replica_hw.items()}
    wiped: dict[str, int] = defaultdict(lambda: -1)
    for e in history.events:
        if e.kind == "wipe-disk":
            wiped[e.target] = max(wiped[e.target], e.time_ns)
    for s in history.leadership:
        if s.high_watermark is None:
            continue
        for r in s.isr:
            if r in history.replica_logs and s.time_ns > wiped[r]:
                hws = out.setdefault(r, {})
                hws[s.partition] = max(hws.get(s.partition, 0), s.high_watermark)
    return out


def _divergences(history: History) -> list[Divergence]:
    out = []
    vouched = vouched_high_watermarks(history)
    replicas = sorted(history.replica_logs)
    partitions = sorted({p for logs in history.replica_logs.values() for p in logs})
    for p in partitions:
        for r in replicas:
            hw, entries = vouched.get(r, {}).get(p, 0), history.replica_logs[r].get(p, [])
            if len(entries) < hw:
                out.append(Divergence(p, r, "", len(entries), hw))
        for i, a in enumerate(replicas):
            for b in replicas[i + 1:]:
                below = min(vouched.get(a, {}).get(p, 0), vouched.get(b, {}).get(p, 0))
                ea, eb = history.replica_logs[a].get(p, []), history.replica_logs[b].get(p, [])
                upto = min(below, len(ea), len(eb))
                first = next((o for o in range(upto) if ea[o] != eb[o]), None)
                if first is not None:
                    out.append(Divergence(p, a, b, first, below))
    return out


def _epoch_regressions(samples: list[LeaderSample]) -> list[EpochRegression]:
    highest: dict[int, LeaderSample] = {}
    out = []
    for s in sorted(samples, key=lambda s: s.time_ns):
        prev = highest.get(s.partition)
        if prev is not None and s.leader_epoch < prev.leader_epoch:
            out.append(EpochRegression(s.partition, prev.time_ns, prev.leader_epoch, s.time_ns, s.leader_epoch))
        elif prev is None or s.leader_epoch > prev.leader_epoch:
            highest[s.partition] = s
    return out


def _leader_changes(samples: list[LeaderSample]) -> int:
    """Leader epochs seen beyond each partition's first."""
    epochs: dict[int, set[int]] = defaultdict(set)
    for s in samples:
        epochs[s.partition].add(s.leader_epoch)
    return sum(len(e) - 1 for e in epochs.values())


def _first_finish_times(history: History) -> dict[int, array]:
    """Per partition: the earliest time each offset was finished (NEVER if it was not)."""
    out = {p: array("q", [NEVER]) * len(ids) for p, ids in history.log.items()}
    for f in history.finishes:
        times = out.get(f.partition)
        if times is not None and 0 <= f.offset < len(times) and f.time_ns < times[f.offset]:
            times[f.offset] = f.time_ns
    return out


def _prefix_max(times: array) -> array:
    """prefix[c] = latest first-finish among offsets [0, c)."""
    out = array("q", [0]) * (len(times) + 1)
    running = 0
    for i, t in enumerate(times):
        if t > running:
            running = t
        out[i + 1] = running
    return out


class _BlockMax:
    """Range maximum over a fixed array, in blocks: small memory, fast enough for holes."""

    BLOCK = 256

    def __init__(self, values: array) -> None:
        self.values = values
        b = self.BLOCK
        self.blocks = array("q", (max(values[i:i + b]) for i in range(0, len(values), b)))

    def max(self, start: int, end: int) -> int:
        values, b = self.values, self.BLOCK
        best = 0
        i = start
        while i < end and i % b:
            best = max(best, values[i])
            i += 1
        while i + b <= end:
            best = max(best, self.blocks[i // b])
            i += b
        while i < end:
            best = max(best, values[i])
            i += 1
        return best


def _lost(history: History) -> list[Lost]:
    finished_ids = {f.record_id for f in history.finishes}
    out = []
    for a in sorted(history.acks, key=lambda a: (a.partition, a.offset)):
        ids = history.log.get(a.partition)
        if ids is None or a.offset >= len(ids):
            reason = "acknowledged offset is beyond the log end"
        elif ids[a.offset] != a.record_id:
            reason = f"acknowledged offset holds record {ids[a.offset]}"
        elif a.record_id not in finished_ids:
            reason = "never finished by a consumer"
        else:
            continue
        out.append(Lost(a.record_id, a.partition, a.offset, reason))
    return out


def _regressions(samples: list[CommitSample]) -> list[Regression]:
    last: dict[tuple, CommitSample] = {}
    out = []
    for s in samples:
        if s.source not in DURABLE_SOURCES or s.committed is None:
            continue
        key = (s.source, s.group, s.topic, s.partition)
        prev = last.get(key)
        if prev is not None and s.committed < prev.committed:
            out.append(Regression(s.source, s.group, s.topic, s.partition, prev.time_ns, prev.committed,
                                  s.time_ns, s.committed))
        if prev is None or s.committed >= prev.committed:
            last[key] = s  # compare with the highest seen, so one dip is reported once per sample
        if s.source == "pg":
            # What the coordinator reported durable before this read must be in the table by now.
            claim = last.get(("describe", s.group, s.topic, s.partition))
            if claim is not None and claim.time_ns < s.time_ns and s.committed < claim.committed:
                out.append(Regression("describe>pg", s.group, s.topic, s.partition, claim.time_ns,
                                      claim.committed, s.time_ns, s.committed))
    return out


def _past_unfinished(samples: list[CommitSample], log: dict, first_finish: dict, prefix_max: dict,
                     range_max: dict) -> tuple[list[PastUnfinished], list[BeyondLogEnd]]:
    past: list[PastUnfinished] = []
    beyond: list[BeyondLogEnd] = []
    for s in samples:
        if s.committed is None:
            continue
        ids = log.get(s.partition)
        if ids is None:
            continue
        times = first_finish[s.partition]
        log_end = len(ids)
        if s.committed > log_end:
            beyond.append(BeyondLogEnd(s.source, s.partition, s.time_ns, s.committed, log_end))
        spans = [(0, min(s.committed, log_end), "below committed")]
        spans += [(max(a, 0), min(b, log_end), f"in hole [{a}, {b})") for a, b in s.holes]
        offending = 0
        first: tuple[int, str] | None = None
        for start, end, where in spans:
            if start >= end:
                continue
            if start == 0:
                prefix = prefix_max[s.partition]
                if prefix[end] <= s.time_ns:
                    continue
                # prefix is non-decreasing: the first offending offset is where it passes t.
                lowest = bisect.bisect_right(prefix, s.time_ns, 0, end + 1) - 1
            else:
                if range_max[s.partition].max(start, end) <= s.time_ns:
                    continue
                lowest = next(o for o in range(start, end) if times[o] > s.time_ns)
            if len(past) < DETAIL_LIMIT:
                offending += sum(1 for o in range(lowest, end) if times[o] > s.time_ns)
            if first is None:
                first = (lowest, where)
        if first is not None:
            offset, where = first
            t = times[offset]
            past.append(PastUnfinished(s.source, s.group, s.topic, s.partition, s.time_ns, s.committed, offset,
                                       ids[offset], None if t == NEVER else t, where, offending))
    return past, beyond


def _duplicates(history: History, samples: list[CommitSample]) -> tuple[list[EventRow], dict[str, int], dict]:
    everything = sorted(history.events, key=lambda e: e.time_ns)
    events = [e for e in everything if e.kind != REBALANCE]
    rows = [EventRow(e.time_ns, e.kind, e.target, None, None) for e in events]
    roots = [i for i, e in enumerate(events) if can_redeliver(e)]
    root_times = [events[i].time_ns for i in roots]
    coordinator_roots = [j for j, i in enumerate(roots) if events[i].kind in COORDINATOR_LOST]
    coordinator_times = [root_times[j] for j in coordinator_roots]
    rebalances = [e.time_ns for e in everything if e.kind == REBALANCE]
    window = int(REBALANCE_ROOT_S * 1e9)

    deliveries: dict[tuple[str, int, int], list[Delivery]] = defaultdict(list)
    for d in history.deliveries:
        deliveries[(d.consumer, d.partition, d.offset)].append(d)
    for ds in deliveries.values():
        ds.sort(key=lambda d: d.time_ns)
    received_at = {k: [d.time_ns for d in ds] for k, ds in deliveries.items()}

    def lease(f: ConsumerFinish) -> tuple[int, int]:
        """When the lease behind finish `f` was granted: after the first, before the second time."""
        ds = deliveries.get((f.consumer, f.partition, f.offset))
        if not ds:
            return f.time_ns, f.time_ns
        i = bisect.bisect_right(received_at[(f.consumer, f.partition, f.offset)], f.time_ns) - 1
        return (ds[i].leased_after_ns, ds[i].time_ns) if i >= 0 else (f.time_ns, f.time_ns)

    def latest(times: list[int], after: int, upto: int) -> int | None:
        i = bisect.bisect_right(times, upto) - 1
        return i if i >= 0 and times[i] > after else None

    by_record: dict[int, list[ConsumerFinish]] = defaultdict(list)
    for f in history.finishes:
        by_record[f.record_id].append(f)
    by_cause: Counter[str] = Counter()
    counts = {"total": 0, "records": 0, "same_offset": 0, "other_offset": 0}
    for finishes in by_record.values():
        if len(finishes) < 2:
            continue
        finishes.sort(key=lambda f: f.time_ns)
        counts["records"] += 1
        seen_offsets = {(finishes[0].partition, finishes[0].offset)}
        for prev, cur in zip(finishes, finishes[1:]):
            counts["total"] += 1
            where = (cur.partition, cur.offset)
            counts["same_offset" if where in seen_offsets else "other_offset"] += 1
            seen_offsets.add(where)
            # Both were leased the record; the earlier lease was lost before the later one began.
            (a_from, a_to), (b_from, b_to) = lease(prev), lease(cur)
            lower, upper = min(a_from, b_from), max(a_to, b_to)
            root = latest(coordinator_times, lower, upper)
            if root is not None:
                # A restarted coordinator forgets whatever was not durable: nothing explains more.
                root = coordinator_roots[root]
                rebalance = None
            else:
                root = latest(root_times, lower, upper)
                rebalance = latest(rebalances, lower, upper)
            if rebalance is not None and (root is None or rebalances[rebalance] > root_times[root]):
                # The lease went in a rebalance: blame what made the group rebalance.
                at = rebalances[rebalance]
                root = latest(root_times, at - window, at)
                if root is None:
                    by_cause[REBALANCE] += 1
                    continue
                row = rows[roots[root]]
                row.via_rebalance += 1
            elif root is None:
                by_cause["none"] += 1
                continue
            row = rows[roots[root]]
            row.duplicates += 1
            by_cause[row.label] += 1
    _fill_in_flight(history, samples, events, rows)
    counts["rebalances"] = len(rebalances)
    return rows, dict(sorted(by_cause.items())), counts


def _redelivered_after_durable(history: History, samples: list[CommitSample]) -> list[DurableRedelivery]:
    """Deliveries of offsets that the table already showed finished (below committed, or in a hole).

    Not a violation (at-least-once allows any duplicate), but not one that a crash explains either:
    durable progress is what a restarted coordinator starts from, so a high count here means some
    path forgets it.
    """
    durable_at = {p: array("q", [NEVER]) * len(ids) for p, ids in history.log.items()}
    covered = defaultdict(int)  # partition -> offsets below this are stamped
    for s in samples:  # in time order
        if s.source != "pg" or s.committed is None or s.partition not in durable_at:
            continue
        times = durable_at[s.partition]
        top = min(s.committed, len(times))
        for o in range(covered[s.partition], top):
            times[o] = min(times[o], s.time_ns)
        covered[s.partition] = max(covered[s.partition], top)
        for a, b in s.holes:
            for o in range(max(a, covered[s.partition]), min(b, len(times))):
                if s.time_ns < times[o]:
                    times[o] = s.time_ns
    out = []
    for d in sorted(history.deliveries, key=lambda d: d.time_ns):
        times = durable_at.get(d.partition)
        # Leased after it was durable: a reply that merely arrived late (a stale lease) is not counted.
        if times is not None and 0 <= d.offset < len(times) and times[d.offset] < d.leased_after_ns:
            out.append(DurableRedelivery(d.consumer, d.partition, d.offset, d.leased_after_ns, times[d.offset]))
    return out


def _fill_in_flight(history: History, samples: list[CommitSample], events: list[NemesisEvent],
                    rows: list[EventRow]) -> None:
    """For each nemesis event: delivered-but-not-durable records, and the finished part of those.

    Group-wide even for a consumer kill: the rebalance that follows it revokes other members'
    leases too."""
    pg = defaultdict(list)  # partition -> [(time, committed, holes)]
    for s in samples:
        if s.source == "pg" and s.committed is not None:
            pg[s.partition].append((s.time_ns, s.committed, s.holes))
    pg_times = {p: [x[0] for x in v] for p, v in pg.items()}

    # Earliest delivery / finish per (partition, offset), overall and per consumer.
    delivered: dict[tuple[int, int], int] = {}
    for d in history.deliveries:
        k = (d.partition, d.offset)
        if d.time_ns < delivered.get(k, NEVER):
            delivered[k] = d.time_ns
    finished: dict[tuple[int, int], int] = {}
    for f in history.finishes:
        k = (f.partition, f.offset)
        if f.time_ns < finished.get(k, NEVER):
            finished[k] = f.time_ns
    # Highest offset delivered by time t, per partition: bounds the scan above the committed offset.
    reach: dict[int, tuple[list[int], list[int]]] = {}
    for p in history.log:
        pairs = sorted((t, o) for (pp, o), t in delivered.items() if pp == p)
        times, highs, high = [], [], -1
        for t, o in pairs:
            high = max(high, o)
            times.append(t)
            highs.append(high)
        reach[p] = (times, highs)

    for ev, row in zip(events, rows):
        if ev.kind not in ROOT_KINDS:
            continue
        got, done = delivered, finished
        in_flight = settled_bound = 0
        known = False
        for p in history.log:
            i = bisect.bisect_right(pg_times.get(p, []), ev.time_ns) - 1
            if i < 0:
                continue
            known = True
            _t, committed, holes = pg[p][i]
            times, highs = reach[p]
            j = bisect.bisect_right(times, ev.time_ns) - 1
            if j < 0:
                continue
            for o in range(committed, highs[j] + 1):
                if any(a <= o < b for a, b in holes):
                    continue
                if got.get((p, o), NEVER) <= ev.time_ns:
                    in_flight += 1
                    if done.get((p, o), NEVER) <= ev.time_ns:
                        settled_bound += 1
        if known:
            row.in_flight, row.finished_not_durable = in_flight, settled_bound


def _partition_rows(history: History, samples: list[CommitSample]) -> list[dict]:
    acked = Counter(a.partition for a in history.acks)
    finished: dict[int, set] = defaultdict(set)
    finishes = Counter()
    for f in history.finishes:
        finished[f.partition].add(f.offset)
        finishes[f.partition] += 1
    final: dict[tuple[str, int], int | None] = {}
    for s in samples:
        if s.source in DURABLE_SOURCES and s.committed is not None:
            final[(s.source, s.partition)] = s.committed
    rows = []
    for p in sorted(history.log):
        rows.append({
            "partition": p,
            "log_end": len(history.log[p]),
            "acked": acked[p],
            "finished_offsets": len(finished[p]),
            "finishes": finishes[p],
            "final_committed_pg": final.get(("pg", p)),
            "final_committed_describe": final.get(("describe", p)),
        })
    return rows


# -- rendering ---------------------------------------------------------------------------

def _table(headers: list[str], rows: Iterable[list]) -> list[str]:
    rows = [["-" if v is None else str(v) for v in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths)))
    out = [line, "  ".join("-" * w for w in widths)]
    for r in rows:
        out.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))))
    return out


def _secs(t_ns: int, origin: int) -> str:
    return f"{(t_ns - origin) / 1e9:.3f}"


def render_table(report: Report) -> str:
    s = report.summary()
    origin = report.meta.get("origin_ns", 0)
    out = [f"chaos check: {s['verdict']}   lost {s['lost']}   regressions {s['regressions']}   "
           f"committed past unfinished {s['committed_past_unfinished']}   "
           f"committed beyond log end {s['committed_beyond_log_end']}", ""]
    if report.replicated:
        out[0] += (f"   under-replicated acks {s['under_replicated']}   divergences {s['divergences']}   "
                   f"epoch regressions {s['epoch_regressions']}")
        out.append(f"replicas: {s['replicas']} logs read from their data directories, {s['replica_records']} "
                   f"records in them; {s['leader_changes']} leader changes seen in {s['leader_samples']} "
                   f"samples of the controller")
    if report.clustered:
        out[0] += f"   stale-epoch writes {s['stale_writes']}"
        out.append(f"cluster: {s['epochs_taken']} coordinator epochs taken; {s['stored_writes']} stored writes "
                   f"checked against them, {s['audited_writes']} of them seen landing by the audit trigger")
    out.append(f"records: {s['acked']} acknowledged to producers, {s['produce_failures']} sends without an ack, "
               f"{s['log_records']} in the logs ({s['unacked_in_log']} of them never acknowledged)")
    out.append(f"consumers: {s['finished_records']} records finished, {s['finishes']} finishes, "
               f"{s['duplicates']} duplicates over {s['duplicate_records']} records "
               f"({s['redelivered_offsets']} redeliveries of an offset, {s['stored_twice']} of a record stored "
               f"twice; {s['redelivered_after_durable']} deliveries of an offset already durably finished); "
               f"{s['samples']} committed-offset samples, {s['events']} nemesis events, "
               f"{s['rebalances_seen']} generation changes seen by consumers")
    out.append("")
    out += _table(["partition", "log end", "acked", "finished", "finishes", "committed (pg)",
                   "committed (describe)"],
                  [[p["partition"], p["log_end"], p["acked"], p["finished_offsets"], p["finishes"],
                    p["final_committed_pg"], p["final_committed_describe"]] for p in report.partitions])
    by_kind: dict[str, list[int]] = {}
    for ev in report.events:
        row = by_kind.setdefault(ev.label, [0, 0, 0, 0, 0])
        row[0] += 1
        row[1] += ev.duplicates
        row[2] += ev.via_rebalance
        row[3] += ev.in_flight or 0
        row[4] += ev.finished_not_durable or 0
    if report.events or report.duplicates_by_cause:
        out.append("")
        rows = [[k, v[0], v[1], v[2], f"{v[1] / v[0]:.1f}", v[3], v[4]] for k, v in sorted(by_kind.items())]
        for cause, title in ((REBALANCE, "(rebalance, no event)"), ("none", "(no event)")):
            if report.duplicates_by_cause.get(cause):
                n = report.duplicates_by_cause[cause]
                rows.append([title, "-", n, n if cause == REBALANCE else 0, "-", "-", "-"])
        out += _table(["nemesis event", "count", "duplicates", "via rebalance", "dup/event", "in flight",
                       "finished, not durable"], rows)
        top = sorted((e for e in report.events if e.duplicates), key=lambda e: -e.duplicates)[:10]
        if top:
            out.append("")
            out.append("events that caused the most duplicates:")
            out += _table(["t (s)", "event", "target", "duplicates", "via rebalance", "in flight",
                           "finished, not durable"],
                          [[_secs(e.time_ns, origin), e.kind, e.target, e.duplicates, e.via_rebalance,
                            e.in_flight, e.finished_not_durable] for e in top])
    for title, items in (("LOST", report.lost), ("REGRESSIONS", report.regressions),
                         ("COMMITTED PAST UNFINISHED", report.committed_past_unfinished),
                         ("COMMITTED BEYOND LOG END", report.committed_beyond_log_end),
                         ("ACKNOWLEDGED ON FEWER THAN MIN-INSYNC REPLICAS", report.under_replicated),
                         ("REPLICAS DISAGREEING BELOW THE HIGH WATERMARK", report.divergences),
                         ("LEADER EPOCH REGRESSIONS", report.epoch_regressions),
                         ("WRITES BY A COORDINATOR EPOCH THAT WAS NOT CURRENT", report.stale_writes)):
        if not items:
            continue
        out.append("")
        out.append(f"{title} ({len(items)}, first {min(len(items), 20)}):")
        for v in items[:20]:
            out.append("  " + _describe(v, origin))
    return "\n".join(out)


def _describe(v, origin: int) -> str:
    if isinstance(v, Lost):
        return f"record {v.record_id} acked at {v.partition}@{v.offset}: {v.reason}"
    if isinstance(v, Regression):
        return (f"{v.source} {v.group}/{v.topic}/{v.partition}: {v.before} at {_secs(v.before_ns, origin)}s "
                f"then {v.committed} at {_secs(v.at_ns, origin)}s")
    if isinstance(v, PastUnfinished):
        when = "never finished" if v.finished_ns is None else f"finished only at {_secs(v.finished_ns, origin)}s"
        return (f"{v.source} {v.group}/{v.topic}/{v.partition}: committed {v.committed} at "
                f"{_secs(v.at_ns, origin)}s but offset {v.offset} (record {v.record_id}, {v.where}) was {when}; "
                f"{v.offending} offending offset(s)")
    if isinstance(v, BeyondLogEnd):
        return f"{v.source} partition {v.partition}: committed {v.committed} at {_secs(v.at_ns, origin)}s, " \
               f"log end {v.log_end}"
    if isinstance(v, UnderReplicated):
        return (f"record {v.record_id} acked at {v.partition}@{v.offset}: on {v.copies} replica(s) byte for "
                f"byte ({', '.join(v.holders) or 'none'})")
    if isinstance(v, Divergence):
        if not v.other:
            return f"partition {v.partition}: {v.replica} ends at {v.offset}, below its high watermark {v.below}"
        return (f"partition {v.partition}: {v.replica} and {v.other} differ at offset {v.offset}, below "
                f"the high watermark {v.below}")
    if isinstance(v, EpochRegression):
        return (f"partition {v.partition}: leader epoch {v.before} at {_secs(v.before_ns, origin)}s, then "
                f"{v.epoch} at {_secs(v.at_ns, origin)}s")
    if isinstance(v, StaleWrite):
        return (f"{v.table} {v.key}: written by epoch {v.coordinator_epoch} at {v.written_at_us} us (database "
                f"clock) while epoch {v.current_epoch} was current ({v.evidence})")
    return repr(v)
