"""The group coordinator's records of groups, members, leases and waiting polls.

Plain data, owned and mutated by `core.GroupCoordinatorCore`; the only logic
here is configuration validation and the read-only reports that
`describe_group` and `list_groups` return.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any

from zbroker.actors.group_coordinator.partition_state import LogRange, PartitionState
from zbroker.actors.group_coordinator.ranges import RangeSet
from zbroker.protocol.messages import GROUP_MODES, MAX_LEASE_MS, MAX_TOPIC_NAME_CHARS

Key = tuple[str, int]  # (topic, partition)


@dataclass(frozen=True)
class GroupConfig:
    mode: str = "exclusive"          # "exclusive" | "shared" | "key_shared"
    ack_timeout_ms: int = 30_000     # lease length of a delivery
    max_deliveries: int = 5          # deliveries before an expired/nacked record is dead-lettered
    max_in_flight: int = 1000        # leased records, per member and per partition
    dlq: str | None = None           # dead-letter topic; None means "<topic>.dlq"
    start: str = "earliest"          # "earliest" | "latest": where a group without a stored offset begins
    quarantine_after: int = 0        # key_shared, exclusive: failures in a row that park a key; 0 = never
    max_keys: int = 10_000           # key_shared: keys in flight or held back, per partition

    def __post_init__(self) -> None:
        if self.mode not in GROUP_MODES:
            raise ValueError(f"mode must be 'exclusive', 'shared' or 'key_shared', not {self.mode!r}")
        if self.start not in ("earliest", "latest"):
            raise ValueError(f"start must be 'earliest' or 'latest', not {self.start!r}")
        for name in ("ack_timeout_ms", "max_deliveries", "max_in_flight", "max_keys"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1")
        q = self.quarantine_after
        if not isinstance(q, int) or isinstance(q, bool) or q < 0:
            raise ValueError("quarantine_after must be an integer >= 0 (0: never)")
        if self.ack_timeout_ms > MAX_LEASE_MS:
            raise ValueError(f"ack_timeout_ms must be at most {MAX_LEASE_MS} (12 hours)")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "GroupConfig":
        """Rebuild from `to_dict` output; unknown keys (from newer versions) are ignored.

        An ack timeout stored before leases were capped at 12 hours is loaded as 12
        hours: refusing it would keep the coordinator from starting, and keeping it
        would let one delivery hold the group's committed offset for years.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in data.items() if k in names}
        timeout = fields.get("ack_timeout_ms")
        if isinstance(timeout, int) and not isinstance(timeout, bool) and timeout > MAX_LEASE_MS:
            fields["ack_timeout_ms"] = MAX_LEASE_MS
        return cls(**fields)

    def dlq_topic(self, topic: str) -> str:
        return self.dlq or default_dlq_topic(topic)


def default_dlq_topic(topic: str) -> str:
    """``<topic>.dlq``, or for a topic name too long for that, a shortened name that
    stays unique (a digest of the whole name) and valid as a topic name."""
    name = f"{topic}.dlq"
    if len(name) <= MAX_TOPIC_NAME_CHARS:
        return name
    digest = hashlib.sha1(topic.encode()).hexdigest()[:8]
    return f"{topic[:MAX_TOPIC_NAME_CHARS - len(digest) - 5]}-{digest}.dlq"


@dataclass(eq=False)
class Member:
    member_id: str
    topics: tuple[str, ...]
    session_timeout_ms: int
    last_seen_ms: int
    assignment: list[Key] = field(default_factory=list)  # partitions it may lease from
    in_flight: int = 0   # records leased to this member, all partitions
    parked: int = 0      # polls of this member waiting for records
    cursor: int = 0      # round-robin starting point over `assignment`


@dataclass(eq=False)
class ParkedPoll:
    """A poll that found nothing and waits for records, capacity or its deadline."""
    token: Any
    group: str
    member_id: str
    max_records: int
    deadline_ms: int
    # What the acks the poll carried came to; its reply, whenever it goes, reports them.
    acked: int = 0
    stale: list = field(default_factory=list)
    stale_omitted: int = 0


@dataclass(eq=False)
class LeaseRecord:
    """Where lease `lease_id` lives; kept until its last deadline has passed, so an ack
    under it can be told apart as fresh, repeated (idempotent) or stale."""
    lease_id: int
    group: str
    key: Key
    member_id: str
    start: int
    end: int
    deadline_ms: int  # the latest deadline any part of the lease ever had
    acked: RangeSet = field(default_factory=RangeSet)  # what was acked under this lease


class Group:
    def __init__(self, name: str, config: GroupConfig) -> None:
        self.name = name
        self.config = config
        self.generation = 0
        self.reset_epoch = 0
        self.members: dict[str, Member] = {}
        self.owners: dict[Key, str] = {}  # exclusive mode only
        self.partitions: dict[Key, PartitionState] = {}
        self.parked: list[ParkedPoll] = []

    def summary(self) -> dict:
        """One row of `list_groups`."""
        return {"group": self.name, "mode": self.config.mode, "members": len(self.members),
                "generation": self.generation}

    def report(self, logs: dict[Key, LogRange], now_ms: int) -> dict:
        """What `describe_group` shows: config, members, assignment and per-partition lag."""
        members = [{"member_id": mem.member_id, "topics": list(mem.topics),
                    "session_timeout_ms": mem.session_timeout_ms, "last_seen_ms_ago": now_ms - mem.last_seen_ms,
                    "in_flight": mem.in_flight, "assignment": [list(k) for k in mem.assignment]}
                   for mem in self.members.values()]
        return {
            "group": self.name, **self.config.to_dict(), "config": self.config.to_dict(),
            "generation": self.generation, "reset_epoch": self.reset_epoch, "members": members,
            "assignment": [[t, p, owner] for (t, p), owner in sorted(self.owners.items())],
            "partitions": [self._partition_report(self.partitions[k], logs.get(k), now_ms)
                           for k in sorted(self.partitions)],
        }

    def _partition_report(self, state: PartitionState, log: LogRange | None, now_ms: int) -> dict:
        # Lag counts from the durable committed offset: what a restart would resume from.
        # Before the writer has confirmed anything for a new group, the in-memory one.
        durable = state.durable_committed
        base = durable if durable is not None else state.committed
        unfinished = log is not None and state.committed is not None and state.committed < log.end
        seen = log.first_seen_ms(state.committed) if unfinished else None
        return {
            "topic": state.topic, "partition": state.partition,
            "log_start": log.start if log else None, "log_end": log.end if log else None,
            "committed": durable, "committed_pending": state.committed,
            "lag": max(0, log.end - base) if log is not None and base is not None else None,
            "in_flight": state.leased.count(), "ready": state.ready.count() + state.delayed.count(),
            # Offsets leased ahead of the log end (not written yet) and to whom.
            "ahead": (None if state.ahead is None else
                      {"member": state.ahead.member_id, "start": state.next_new, "end": state.ahead.end}),
            "dead_lettering": state.dead_lettering.count(), "holes": state.finished.len_ranges(),
            "oldest_unfinished_age_ms": None if seen is None else now_ms - seen,
            "redeliveries": state.redeliveries, "dead_letters": state.dead_letters,
            "redeliveries_by_reason": dict(state.redeliveries_by_reason),
            "dead_letters_by_reason": dict(state.dead_letters_by_reason),
            "blocker": state.blocker(log, now_ms), "owner": self.owners.get(state.key),
            **({} if state.keys is None else state.keys.report()),
        }
