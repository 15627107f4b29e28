"""Cluster metadata kept in the offset store: topics, partition states, the coordinator lease.

Theory of operation
-------------------
The store that holds committed offsets also holds what a coordinator on
another host needs to take over (issues 25 and 26): every topic (name,
partition count, log config, replication factor, min in-sync, incarnation)
and every partition's replica state (replicas, leader, leader epoch, ISR).
The coordinator decides; the commit writer, its only gateway to the store,
writes the decision with `OffsetStore.write_metadata` before it takes effect.

Two fences make a write from a deposed coordinator impossible, both checked
inside the writing transaction, where the effect lands:

* the *coordinator epoch*: a lease row (PostgreSQL) whose epoch grows by one
  every time a node takes an expired lease. Every metadata write, and every
  offsets flush that carries an epoch, applies only while that epoch is still
  the lease's current one;
* the *leader epoch* of each partition: an update names the leader epoch it
  read (``expected_leader_epoch``) and applies only if that is still the stored
  one (``WHERE leader_epoch = expected``), so two controllers racing on one
  partition cannot both win even within one coordinator epoch.

A failed condition rolls back the whole change set: `write_metadata` returns
False and nothing is written. The lease is taken and renewed with the
database's clock (``now()``), never a node's, so nodes whose clocks disagree
still agree on who holds it. With SQLite the node is a cluster of one: the
lease is always its own, at `SINGLE_NODE_EPOCH`.

The wire forms (``to_wire``/``from_wire``) are the lists the commit writer's
``load_metadata``/``write_metadata``/``coordinator_lease`` ops carry
(docs/PROTOCOL.md section 16).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from zbroker.protocol.errors import ProtocolError

TOPICS_TABLE = "zbroker_topics"
PARTITIONS_TABLE = "zbroker_partition_states"
LEASE_TABLE = "zbroker_coordinator_lease"
EPOCHS_TABLE = "zbroker_coordinator_epochs"
GROUPS_TABLE = "zbroker_group_configs"

# SQLite has no other node to share a lease with: its one node always holds epoch 1.
SINGLE_NODE_EPOCH = 1

MAX_INT64 = (1 << 63) - 1
# A lease longer than this is a typo, and one shorter than a round trip cannot be renewed.
MIN_LEASE_MS = 100
MAX_LEASE_MS = 10 * 60 * 1000


@dataclasses.dataclass(frozen=True, slots=True)
class TopicMeta:
    name: str
    partitions: int
    config: dict
    replication_factor: int = 1
    min_insync: int = 1
    # A random 63-bit id chosen at creation: a topic deleted and created again under the
    # same name is another topic, and a change meant for the old one must not touch it.
    incarnation: int = 0

    def to_wire(self) -> list:
        return [self.name, self.partitions, self.config, self.replication_factor, self.min_insync,
                self.incarnation]

    @classmethod
    def from_wire(cls, item: Any, op: str = "write_metadata") -> "TopicMeta":
        if not (isinstance(item, list) and len(item) == 6 and isinstance(item[0], str)
                and isinstance(item[2], dict) and all(_is_int(x) for x in (item[1], item[3], item[4], item[5]))):
            raise ProtocolError("topic must be [name, partitions, config, replication_factor, min_insync, "
                                "incarnation]", op=op)
        topic = cls(item[0], item[1], item[2], item[3], item[4], item[5])
        topic.check(op)
        return topic

    def check(self, op: str = "write_metadata") -> None:
        if not (self.name and self.partitions >= 1 and self.replication_factor >= 1
                and 1 <= self.min_insync <= self.replication_factor and 0 <= self.incarnation <= MAX_INT64):
            raise ProtocolError("topic needs a name, partitions >= 1, 1 <= min_insync <= replication_factor "
                                "and a 63-bit incarnation", op=op, topic=self.name[:200])


@dataclasses.dataclass(frozen=True, slots=True)
class PartitionState:
    topic: str
    partition: int
    replicas: tuple[str, ...]  # ordered; the first is the preferred leader
    leader: str | None
    leader_epoch: int
    isr: tuple[str, ...]

    @property
    def key(self) -> tuple[str, int]:
        return (self.topic, self.partition)

    def to_wire(self) -> list:
        return [self.topic, self.partition, list(self.replicas), self.leader, self.leader_epoch, list(self.isr)]

    @classmethod
    def from_wire(cls, item: Any, op: str = "write_metadata") -> "PartitionState":
        if not (isinstance(item, list) and len(item) == 6 and isinstance(item[0], str) and _is_int(item[1])
                and _str_list(item[2]) and (item[3] is None or isinstance(item[3], str)) and _is_int(item[4])
                and _str_list(item[5])):
            raise ProtocolError("partition state must be [topic, partition, replicas, leader, leader_epoch, isr]",
                                op=op)
        state = cls(item[0], item[1], tuple(item[2]), item[3], item[4], tuple(item[5]))
        state.check(op)
        return state

    def check(self, op: str = "write_metadata") -> None:
        if not (self.partition >= 0 and 0 <= self.leader_epoch <= MAX_INT64 and self.replicas
                and len(set(self.replicas)) == len(self.replicas) and set(self.isr) <= set(self.replicas)
                and len(set(self.isr)) == len(self.isr)
                and (self.leader is None or self.leader in self.replicas)):
            raise ProtocolError("partition state needs distinct replicas, an ISR and a leader among them, "
                                "and leader_epoch >= 0", op=op, topic=self.topic[:200], partition=self.partition)


@dataclasses.dataclass(frozen=True, slots=True)
class PartitionUpdate:
    """Write `state` if the stored leader epoch is `expected_leader_epoch`; None: the partition must be new."""
    state: PartitionState
    expected_leader_epoch: int | None

    def to_wire(self) -> list:
        return [*self.state.to_wire(), self.expected_leader_epoch]

    @classmethod
    def from_wire(cls, item: Any, op: str = "write_metadata") -> "PartitionUpdate":
        if not (isinstance(item, list) and len(item) == 7 and (item[6] is None or _is_int(item[6]))):
            raise ProtocolError("partition update must be [topic, partition, replicas, leader, leader_epoch, "
                                "isr, expected_leader_epoch]", op=op)
        update = cls(PartitionState.from_wire(item[:6], op), item[6])
        if update.expected_leader_epoch is not None and update.state.leader_epoch < update.expected_leader_epoch:
            raise ProtocolError("a partition's leader epoch never goes backwards", op=op,
                                topic=update.state.topic[:200], partition=update.state.partition,
                                expected=update.expected_leader_epoch, got=update.state.leader_epoch)
        return update


@dataclasses.dataclass(frozen=True, slots=True)
class MetadataChanges:
    """One atomic change set: all of it applies, or (a condition failed) none of it."""
    create_topics: tuple[TopicMeta, ...] = ()  # each name must not exist
    update_topics: tuple[TopicMeta, ...] = ()  # replaces the topic of that name AND incarnation
    delete_topics: tuple[tuple[str, int], ...] = ()  # (name, incarnation); its partition states go too
    partitions: tuple[PartitionUpdate, ...] = ()
    # (group, config): stored as given; (group, None): the group's config is deleted.
    group_configs: tuple[tuple[str, dict | None], ...] = ()

    def __post_init__(self) -> None:
        for t in (*self.create_topics, *self.update_topics):
            t.check()
        for u in self.partitions:
            u.state.check()
            if u.expected_leader_epoch is not None and u.state.leader_epoch < u.expected_leader_epoch:
                raise ProtocolError("a partition's leader epoch never goes backwards", op="write_metadata",
                                    topic=u.state.topic[:200], partition=u.state.partition)
        names = [t.name for t in (*self.create_topics, *self.update_topics)] + [n for n, _ in self.delete_topics]
        keys = [u.state.key for u in self.partitions]
        groups = [g for g, _c in self.group_configs]
        if not all(isinstance(g, str) and g and (c is None or isinstance(c, dict)) for g, c in self.group_configs):
            raise ProtocolError("group_configs items must be [group, config map | nil]", op="write_metadata")
        if len(set(names)) != len(names) or len(set(keys)) != len(keys) or len(set(groups)) != len(groups):
            raise ProtocolError("a change set names each topic and each partition at most once",
                                op="write_metadata")

    @classmethod
    def from_wire(cls, create_topics: list, update_topics: list, delete_topics: list,
                  partitions: list, group_configs: list = ()) -> "MetadataChanges":
        """From a ``write_metadata`` request's fields; ProtocolError for anything malformed."""
        if not all(isinstance(g, list) and len(g) == 2 for g in group_configs):
            raise ProtocolError("group_configs items must be [group, config map | nil]", op="write_metadata")
        return cls(tuple(TopicMeta.from_wire(t) for t in create_topics),
                   tuple(TopicMeta.from_wire(t) for t in update_topics),
                   tuple((d[0], d[1]) for d in delete_topics),
                   tuple(PartitionUpdate.from_wire(u) for u in partitions),
                   tuple((g[0], g[1]) for g in group_configs))

    def to_wire(self) -> dict:
        return {"create_topics": [t.to_wire() for t in self.create_topics],
                "update_topics": [t.to_wire() for t in self.update_topics],
                "delete_topics": [[n, i] for n, i in self.delete_topics],
                "partitions": [u.to_wire() for u in self.partitions],
                "group_configs": [[g, c] for g, c in self.group_configs]}

    @property
    def empty(self) -> bool:
        return not (self.create_topics or self.update_topics or self.delete_topics or self.partitions
                    or self.group_configs)


@dataclasses.dataclass(frozen=True, slots=True)
class Metadata:
    topics: dict[str, TopicMeta]
    partitions: dict[tuple[str, int], PartitionState]
    group_configs: dict[str, dict] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class LeaseState:
    """The coordinator lease as the database saw it when it answered.

    `remaining_ms` is measured by the database clock: how long the holder's lease
    still runs (ours when `held`). A node must not turn it into a local deadline by
    adding it to the time the answer *arrived*: it is safe only counted from when the
    request was *sent* (see actors/group_coordinator/leadership.py).
    """
    holder: str | None
    holder_endpoint: str | None
    epoch: int
    held: bool
    remaining_ms: int

    def to_wire(self) -> dict:
        return {"holder": self.holder, "holder_endpoint": self.holder_endpoint, "epoch": self.epoch,
                "held": self.held, "remaining_ms": self.remaining_ms}


def metadata_steps(changes: MetadataChanges) -> list[tuple[str, list]]:
    """The statements a change set needs, in order, each with its JSON items (both backends)."""
    steps: list[tuple[str, list]] = []
    if changes.delete_topics:
        deleted = [[name, incarnation] for name, incarnation in changes.delete_topics]
        steps += [("delete_topics", deleted), ("delete_partitions", deleted)]
    if changes.create_topics:
        steps.append(("create_topics", [t.to_wire() for t in changes.create_topics]))
    if changes.update_topics:
        steps.append(("update_topics", [t.to_wire() for t in changes.update_topics]))
    new = [u.state.to_wire() for u in changes.partitions if u.expected_leader_epoch is None]
    if new:
        steps.append(("insert_partitions", new))
    updated = [u.to_wire() for u in changes.partitions if u.expected_leader_epoch is not None]
    if updated:
        steps.append(("update_partitions", updated))
    configs = [[g, c] for g, c in changes.group_configs if c is not None]
    if configs:
        steps.append(("upsert_group_configs", configs))
    deleted_configs = [[g] for g, c in changes.group_configs if c is None]
    if deleted_configs:
        steps.append(("delete_group_configs", deleted_configs))
    return steps


# Steps whose row count may be below their number of items: deleting what is not there is fine.
UNCOUNTED_STEPS = frozenset({"delete_partitions", "delete_group_configs"})


def metadata_from_rows(topics: list, partitions: list, groups: list = ()) -> Metadata:
    """`Metadata` from the rows both backends select, JSON columns as text."""
    return Metadata(
        {r[0]: TopicMeta(r[0], r[1], json.loads(r[2]), r[3], r[4], r[5]) for r in topics},
        {(r[0], r[1]): PartitionState(r[0], r[1], tuple(json.loads(r[2])), r[3], r[4], tuple(json.loads(r[5])))
         for r in partitions},
        {r[0]: json.loads(r[1]) for r in groups})


def check_lease_request(node_id: str, endpoint: str, lease_ms: int) -> None:
    if not node_id or not isinstance(endpoint, str) or not MIN_LEASE_MS <= lease_ms <= MAX_LEASE_MS:
        raise ProtocolError(f"a coordinator lease needs a node id and {MIN_LEASE_MS} <= lease_ms <= "
                            f"{MAX_LEASE_MS}", op="coordinator_lease", node_id=str(node_id)[:200],
                            lease_ms=lease_ms)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _str_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(s, str) and s for s in x)
