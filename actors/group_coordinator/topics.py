"""Topic registry and partition placement: which partition-log actor owns what.

Theory of operation
-------------------
Topics (name, partition count, log config) are created here and persisted by
the shell as a snapshot. Partition-log actors register once a second with
their endpoint and a *storage id* (host + data directory). Placement rules:

* A partition is placed on the live actor with the fewest partitions.
* Once placed, a partition is bound to that actor's storage: its segment
  files live there, so it may only move to another actor on the same storage
  (the flock in the partition-log shell guarantees one writer at a time).
* A new actor on a storage shared with others takes partitions from the most
  loaded of them until the counts differ by at most one: that is how
  `zbroker partition --broker URL` scales out.
* An actor silent for ``actor_timeout_ms`` is considered dead and its
  partitions move to live actors on the same storage; with none, they wait
  for it (clients get NOT_OWNER/UNAVAILABLE meanwhile, nothing is lost).
  An actor that stops on purpose says so (`deregister`) once its logs are
  closed, and its partitions move at once.

Every placement change yields an `AssignActor` effect: the shell sends that
actor its complete new assignment.

Replicated topics (replication factor R > 1) follow other rules, in
controller.py: each partition has R replicas on actors with distinct storage,
one leader (its `owner` here, so everything that routes to the owner routes to
the leader) and an ISR. Their decisions are *durable before effective*: each
one is a `WriteMetadata` effect, and the assigns and replies that carry it are
held until the shell confirms the write (`on_metadata_written`). Until then the
partition keeps its previous state (`replication`) for every reader, and
decisions build on the newest one (`proposed`).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Iterable

from zbroker.actors.group_coordinator import controller as ctl
from zbroker.actors.group_coordinator.controller import ReplicaSet
from zbroker.actors.group_coordinator.effects import Reply as _Reply
from zbroker.protocol import messages as m
from zbroker.protocol.errors import InvalidPartitions, NotEnoughReplicas, ProtocolError, TopicExists, Unavailable, UnknownTopic
from zbroker.protocol.messages import validate_topic_name
from zbroker.storage.log.config import InvalidSetting
from zbroker.storage.log.partition_log import LogConfig

Key = tuple[str, int]


@dataclasses.dataclass(frozen=True)
class AssignActor:
    actor_id: str


@dataclasses.dataclass(frozen=True)
class PersistTopics:
    pass


@dataclasses.dataclass(frozen=True)
class DeletePartitionsOn:
    """Send `delete_partitions` for these [[topic, partition]] to the actor; its answer
    goes to `TopicRegistry.on_partitions_deleted`."""
    actor_id: str
    partitions: list = dataclasses.field(hash=False)


@dataclasses.dataclass(frozen=True)
class WriteMetadata:
    """Record these decisions in the store, then call `TopicRegistry.on_metadata_written`.

    `create_topics`: [[name, partitions, config, replication_factor, min_insync, incarnation]];
    `partitions`: [[topic, partition, replicas, leader, leader_epoch, isr, expected_leader_epoch]]
    (storage.offsets.metadata wire forms; expected None: a new partition)."""
    write_id: int
    create_topics: list = dataclasses.field(hash=False)
    partitions: list = dataclasses.field(hash=False)
    coordinator_epoch: int = 1


@dataclasses.dataclass(frozen=True)
class ReloadMetadata:
    """A metadata write was refused: what this coordinator holds is not what the store holds."""


@dataclasses.dataclass(frozen=True)
class LogEvent:
    event: str
    fields: dict = dataclasses.field(hash=False)


@dataclasses.dataclass
class ActorInfo:
    actor_id: str
    endpoint: str
    storage_id: str
    pid: int
    last_seen_ms: int
    alive: bool = True
    # From its latest registration: assigned partitions it has not opened, and why.
    not_open: list = dataclasses.field(default_factory=list)
    not_open_count: int = 0
    rack: str | None = None


@dataclasses.dataclass
class PartitionInfo:
    owner: str | None = None  # a replicated partition's effective leader
    storage_id: str | None = None  # unreplicated only: the storage its segments live on
    log_start: int = 0
    log_end: int = 0  # replicated: the leader's high watermark
    size_bytes: int = 0
    replication: ReplicaSet | None = None  # replicated: the durable, effective state
    proposed: ReplicaSet | None = None  # replicated: decided, its write not confirmed yet
    replica_log_ends: dict = dataclasses.field(default_factory=dict)  # actor_id -> log end it reported
    high_watermark: int | None = None  # replicated: as the current leader last reported it
    # replicated: how many ISR members keep up, as the current leader last reported it (None:
    # not reported). Below min_insync it refuses produce though the recorded ISR holds M.
    keeping_up: int | None = None
    bytes_appended: int = 0  # payload bytes its owner appended since that process started

    @property
    def replicated(self) -> bool:
        return self.replication is not None or self.proposed is not None

    @property
    def newest(self) -> ReplicaSet | None:
        return self.proposed or self.replication


# The registry is bounded: registrations beyond MAX_ACTORS are refused, and an
# actor dead for FORGET_DEAD_ACTOR_MS that owns nothing is forgotten. Without
# --curve the internal endpoint trusts any local process, and a stream of
# forged registrations must not grow the coordinator without limit.
MAX_ACTORS = 1024
FORGET_DEAD_ACTOR_MS = 10 * 60 * 1000
MAX_REPLICATION_FACTOR = 16
# A deleted partition's files are asked to be removed again this often, while the actor
# holding them has not confirmed it (it was down, or another actor still had the log open).
DELETE_RESEND_MS = 1000


def isr_reply(topic: str, partition: int, rs: ReplicaSet) -> m.AlterIsrReply:
    return m.AlterIsrReply(topic=topic, partition=partition, leader_epoch=rs.leader_epoch, isr=list(rs.isr))


def reassign_reply(topic: str, partition: int, rs: ReplicaSet) -> m.ReassignPartitionReply:
    return m.ReassignPartitionReply(topic=topic, partition=partition, replicas=list(rs.replicas),
                                    target=list(rs.target or rs.replicas), done=rs.target is None)


class TopicRegistry:
    def __init__(self, *, actor_timeout_ms: int = 5000, unclean_leader_election: bool = False,
                 coordinator_epoch: int = 1) -> None:
        self.actor_timeout_ms = actor_timeout_ms
        self.unclean_leader_election = unclean_leader_election
        # The lease epoch this coordinator decides under (a single node: always 1).
        self.coordinator_epoch = coordinator_epoch
        # name -> {"partitions": n, "config": {...}} (+ replication_factor, min_insync, incarnation if R > 1)
        self.topics: dict[str, dict[str, Any]] = {}
        self.partitions: dict[Key, PartitionInfo] = {}
        self.actors: dict[str, ActorInfo] = {}
        # write_id -> (the partition states it records, the effects held until it is durable)
        self._writes: dict[int, tuple[list[tuple[Key, ReplicaSet]], list]] = {}
        self._write_ids = 0
        # After a restart no actor has registered yet: the replicas of restored partitions
        # count as live until they have had actor_timeout_ms to do so, or every partition
        # would change leader to whichever replica registered first.
        self._restored = False
        self._grace_until_ms: int | None = None
        self._now_ms = 0
        # Partitions of deleted topics -> the actors whose copy of the files is not known to
        # be removed yet; the name cannot be used again until this is empty (a new topic
        # opening the old directory would inherit its records). Persisted with the snapshot.
        self.deleting: dict[Key, set[str]] = {}
        self._deletes_sent_ms: dict[str, int] = {}

    # -- persistence ------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """Everything decided, pending writes included (written first, effective once confirmed)."""
        return {
            "topics": self.topics,
            "placement": [[t, p, info.owner, info.storage_id] for (t, p), info in sorted(self.partitions.items())
                          if not info.replicated],
            "replicated": [info.newest.to_wire(t, p) for (t, p), info in sorted(self.partitions.items())
                           if info.replicated],
            "deleting": [[t, p, sorted(actors)] for (t, p), actors in sorted(self.deleting.items())],
        }

    def restore(self, snapshot: dict) -> None:
        self.topics = {}
        for name, t in snapshot.get("topics", {}).items():
            entry = {"partitions": int(t["partitions"]), "config": dict(t.get("config") or {})}
            if int(t.get("replication_factor", 1)) > 1:
                entry.update(replication_factor=int(t["replication_factor"]), min_insync=int(t["min_insync"]),
                             incarnation=int(t.get("incarnation", 0)))
            self.topics[name] = entry
        for name, t in self.topics.items():
            for p in range(t["partitions"]):
                self.partitions[(name, p)] = PartitionInfo()
        for t, p, owner, storage in snapshot.get("placement", []):
            if (t, p) in self.partitions:
                self.partitions[(t, p)].owner = owner
                self.partitions[(t, p)].storage_id = storage
        self.deleting = {(t, p): set(actors) for t, p, actors in snapshot.get("deleting", [])}
        self._restored = bool(snapshot.get("replicated"))
        for t, p, replicas, leader, leader_epoch, isr in snapshot.get("replicated", []):
            if (t, p) in self.partitions and "min_insync" in self.topics[t]:
                part = self.partitions[(t, p)]
                part.replication = ReplicaSet(tuple(replicas), leader, int(leader_epoch), tuple(isr),
                                              self.topics[t]["min_insync"])
                part.owner = leader

    # -- topics -----------------------------------------------------------------------------

    def create_topic(self, name: str, partitions: int, config: dict | None, now_ms: int, *,
                     replication_factor: int = 1, min_insync: int | None = None, token: Any = None) -> list:
        """Effects of creating a topic. With R > 1 (see `_create_replicated`) the reply to
        `token` is among them, held until the placement is durable; with R = 1 the caller
        replies once the effects are applied."""
        validate_topic_name(name)
        if name in self.topics:
            existing = self.topics[name]["partitions"]
            raise TopicExists(f"topic {name!r} already exists", topic=name, partitions=existing)
        pending = self.pending_deletion(name)
        if pending:
            raise Unavailable(f"topic {name!r} was deleted and {len(pending)} partition(s) of it are still on "
                              f"disk (actor {pending[0][1]} has not removed them yet); retry once it has",
                              topic=name, pending=pending)
        try:
            log_config = LogConfig.from_dict(config)
        except (ValueError, TypeError) as exc:
            where = {"field": f"config.{exc.field}", "got": exc.got} if isinstance(exc, InvalidSetting) else {}
            raise ProtocolError(f"invalid topic config: {exc}", topic=name, **where) from None
        if replication_factor != 1 or min_insync not in (None, 1):
            return self._create_replicated(name, partitions, log_config.to_dict(), replication_factor,
                                           min_insync, token)
        self.topics[name] = {"partitions": partitions, "config": log_config.to_dict()}
        for p in range(partitions):
            self.partitions[(name, p)] = PartitionInfo()
        return [PersistTopics()] + self._place_unplaced()

    def _create_replicated(self, name: str, partitions: int, config: dict, replication_factor: int,
                           min_insync: int | None, token: Any) -> list:
        if not 1 <= replication_factor <= MAX_REPLICATION_FACTOR:
            raise ProtocolError(f"'replication_factor' must be between 1 and {MAX_REPLICATION_FACTOR}",
                                op="create_topic", field="replication_factor", got=replication_factor)
        min_insync = min(2, replication_factor) if min_insync is None else min_insync
        if not 1 <= min_insync <= replication_factor:
            raise ProtocolError("'min_insync' must be between 1 and the replication factor", op="create_topic",
                                field="min_insync", got=min_insync, replication_factor=replication_factor)
        self._check_placeable(replication_factor)
        incarnation = random.getrandbits(63)
        self.topics[name] = {"partitions": partitions, "config": config, "replication_factor": replication_factor,
                             "min_insync": min_insync, "incarnation": incarnation}
        decisions = self._place_replicated(name, range(partitions), replication_factor, min_insync)
        actors = {a for _key, rs in decisions for a in rs.replicas}
        held = self._assign_effects(actors)
        if token is not None:
            held.append(_Reply(token, m.CreateTopicReply(topic=name, partitions=partitions)))
        topic = [name, partitions, config, replication_factor, min_insync, incarnation]
        return self._decide(decisions, held, create_topics=[topic])

    def _check_placeable(self, replication_factor: int) -> None:
        candidates = self._candidates()
        if ctl.qualifying(candidates) < replication_factor:
            ctl.place(candidates, replication_factor)  # raises NOT_ENOUGH_REPLICAS, naming what qualifies

    def _place_replicated(self, name: str, partitions: Iterable[int], replication_factor: int,
                          min_insync: int) -> list[tuple[Key, ReplicaSet]]:
        """New partitions of a replicated topic, each on `replication_factor` actors spread as
        `ctl.place` spreads them (counting the ones placed before it); leader epoch 0."""
        candidates = self._candidates()
        decisions = []
        for p in partitions:
            replicas = ctl.place(candidates, replication_factor)
            self.partitions[(name, p)] = PartitionInfo()
            decisions.append(((name, p), ReplicaSet(tuple(replicas), replicas[0], 0, tuple(replicas), min_insync)))
            candidates = [dataclasses.replace(c, replicas=c.replicas + (c.actor_id in replicas),
                                              leaders=c.leaders + (c.actor_id == replicas[0])) for c in candidates]
        return decisions

    # -- the controller: replicated partitions ------------------------------------------------

    def _decide(self, decisions: list[tuple[Key, ReplicaSet]], held: list, create_topics: list | None = None) -> list:
        """Record `decisions` (WriteMetadata); `held` is what may happen once they are durable."""
        if not decisions and not create_topics:
            return held
        self._write_ids += 1
        rows = []
        for key, rs in decisions:
            part = self.partitions[key]
            before = part.newest
            rows.append(rs.to_wire(*key) + [None if before is None else before.leader_epoch])
            part.proposed = rs
        self._writes[self._write_ids] = (decisions, held)
        return [WriteMetadata(self._write_ids, list(create_topics or []), rows, self.coordinator_epoch)]

    def on_metadata_written(self, write_id: int, ok: bool, now_ms: int) -> list:
        """The store's answer to a `WriteMetadata`: its decisions take effect, or none of them do."""
        entry = self._writes.pop(write_id, None)
        if entry is None:
            return []
        decisions, held = entry
        if not ok:
            for key, rs in decisions:
                part = self.partitions.get(key)
                if part is not None and part.proposed is rs:
                    part.proposed = None
            # Another coordinator (or a stale read) got there first: what we decided is void.
            return [LogEvent("metadata.write_refused", {"write_id": write_id, "partitions": len(decisions)}),
                    ReloadMetadata()]
        for key, rs in decisions:
            part = self.partitions.get(key)
            if part is None:
                continue
            if part.replication is not None and part.replication.leader != rs.leader:
                part.high_watermark = None
                part.keeping_up = None
            part.replication = rs
            part.owner = rs.leader
            if part.proposed is rs:
                part.proposed = None
        return held

    def pending_writes(self) -> int:
        return len(self._writes)

    def _candidates(self) -> list[ctl.Candidate]:
        replicas = {a: 0 for a, info in self.actors.items() if info.alive}
        leaders = dict.fromkeys(replicas, 0)
        for part in self.partitions.values():
            rs = part.newest
            members = rs.replicas if rs is not None else (part.owner,)
            for a in members:
                if a in replicas:
                    replicas[a] += 1
            lead = rs.leader if rs is not None else part.owner
            if lead in leaders:
                leaders[lead] += 1
        return [ctl.Candidate(a, self.actors[a].storage_id, ctl.host_of(self.actors[a].endpoint),
                              self.actors[a].rack, replicas[a], leaders[a]) for a in sorted(replicas)]

    def _clock(self, now_ms: int) -> bool:
        """Note the time; True once, when the post-restart grace ends."""
        self._now_ms = now_ms
        if not self._restored:
            return False
        if self._grace_until_ms is None:
            self._grace_until_ms = now_ms + self.actor_timeout_ms
        if now_ms < self._grace_until_ms:
            return False
        self._restored = False
        return True

    def _live(self) -> set[str]:
        live = {a for a, info in self.actors.items() if info.alive}
        if self._restored:  # still in the grace after a restart: not seen is not dead yet
            live |= {a for part in self.partitions.values() if part.replication is not None
                     for a in part.replication.replicas if a not in self.actors}
        return live

    def _reelect(self, only_actor: str | None = None, restarted: str | None = None) -> list:
        """Re-decide every replicated partition's leader (those `only_actor` holds, if given),
        `restarted` having come back as a new process (controller.restarted)."""
        live = self._live()
        decisions = []
        touched: set[str] = set()
        for key, part in sorted(self.partitions.items()):
            rs = part.newest
            if rs is None or (only_actor is not None and only_actor not in rs.replicas):
                continue
            new = ctl.restarted(rs, restarted, live) if restarted is not None else rs
            new = ctl.finish_reassign(ctl.elect(new, live, unclean=self.unclean_leader_election), live)
            if new is not rs:
                decisions.append((key, new))
                touched.update(rs.replicas, new.replicas)
        effects = []
        for key, new in decisions:
            old = self.partitions[key].newest
            event = "controller.unclean_election" if new.leader is not None and new.leader not in old.isr \
                else "controller.leader_elected" if new.leader is not None else "controller.partition_offline"
            effects.append(LogEvent(event, {"topic": key[0], "partition": key[1], "leader": new.leader,
                                            "leader_epoch": new.leader_epoch, "isr": list(new.isr),
                                            "previous_leader": old.leader}))
        return effects + self._decide(decisions, self._assign_effects(touched))

    def alter_isr(self, actor_id: str, topic: str, partition: int, leader_epoch: int, isr: list[str],
                  token: Any) -> list:
        """The leader's ISR proposal; the reply (the recorded state) waits until it is durable."""
        part = self.partitions.get((topic, partition))
        rs = part.newest if part is not None else None
        if rs is None:
            raise UnknownTopic(f"{topic}/{partition} is not a replicated partition", topic=topic,
                               partition=partition)
        if part.proposed is not None and not set(isr) <= set(part.proposed.replicas):
            # The leader proposes from the replica set it was assigned; a move decided since
            # (not durable yet, so not sent to it) may drop one of those replicas. Its proposal
            # is not malformed (PROTOCOL_ERROR), only early: the leader proposes again after
            # ISR_RETRY_MS, by then from the new assignment. Found by the controller's
            # Hypothesis test: reassign to a,b,d, confirmed, back to a,b,c, then an ISR of a,b,d.
            raise Unavailable(f"the replica set of {topic}/{partition} is changing; propose again once it is "
                              f"recorded", topic=topic, partition=partition, replicas=list(part.proposed.replicas),
                              got=list(isr))
        new = ctl.finish_reassign(ctl.alter_isr(rs, actor_id, leader_epoch, isr, topic=topic,
                                                partition=partition), self._live())
        reply = _Reply(token, isr_reply(topic, partition, new))
        if new is rs:
            return [reply]
        held = [reply]
        if new.replicas != rs.replicas or new.leader != rs.leader:
            held = self._assign_effects(set(rs.replicas) | set(new.replicas)) + held
        return [LogEvent("controller.isr_changed", {"topic": topic, "partition": partition, "isr": list(new.isr),
                                                    "leader_epoch": new.leader_epoch})] + \
            self._decide([((topic, partition), new)], held)

    def reassign(self, topic: str, partition: int, replicas: list[str], token: Any) -> list:
        """Start moving a replicated partition to `replicas` (see controller.start_reassign)."""
        self.require_topic(topic)
        part = self.partitions.get((topic, partition))
        if part is None:
            raise ProtocolError(f"{topic} has no partition {partition}", op="reassign_partition", topic=topic,
                                partition=partition)
        rs = part.newest
        if rs is None:
            raise ProtocolError("only a replicated topic's partitions are reassigned: an unreplicated one "
                                "lives on its storage", op="reassign_partition", topic=topic, partition=partition)
        unknown = [a for a in replicas if a not in self.actors]
        storages = [self.actors[a].storage_id for a in replicas if a in self.actors]
        if not replicas or unknown or len(set(replicas)) != len(replicas) or len(set(storages)) != len(storages):
            raise ProtocolError("reassign needs distinct, registered partition actors on distinct data "
                                "directories", op="reassign_partition", topic=topic, partition=partition,
                                got=list(replicas), unknown=unknown)
        if len(replicas) < rs.min_insync:
            raise NotEnoughReplicas(f"{len(replicas)} replicas are fewer than min_insync {rs.min_insync}",
                                    topic=topic, partition=partition, qualifying=len(replicas))
        if tuple(replicas) == rs.replicas and rs.target is None:
            return [_Reply(token, reassign_reply(topic, partition, rs))]
        new = ctl.finish_reassign(ctl.start_reassign(rs, replicas), self._live())
        held = self._assign_effects(set(rs.replicas) | set(new.replicas))
        held.append(_Reply(token, reassign_reply(topic, partition, new)))
        return [LogEvent("controller.reassign", {"topic": topic, "partition": partition, "target": replicas,
                                                 "replicas": list(new.replicas)})] + \
            self._decide([((topic, partition), new)], held)

    def on_replica_states(self, actor_id: str, states: list) -> None:
        """Each replica's [topic, partition, leader_epoch, log_end, high_watermark] from its actor."""
        for item in states:
            if not (isinstance(item, list) and len(item) >= 5):
                continue
            topic, partition, _epoch, log_end, high_watermark = item[:5]
            part = self.partitions.get((topic, partition))
            rs = part.replication if part is not None else None
            if rs is None or actor_id not in rs.replicas:
                continue
            part.replica_log_ends[actor_id] = log_end
            if actor_id == rs.leader:
                part.high_watermark = high_watermark
                part.keeping_up = item[5] if len(item) > 5 else None

    def replicas_for(self, actor_id: str) -> list[list]:
        """`assign`'s `replicas` entries for one actor: the effective state of each replica it holds."""
        out = []
        for (t, p), part in sorted(self.partitions.items()):
            rs = part.replication
            if rs is None or actor_id not in rs.replicas:
                continue
            leader_id = rs.leader
            if (leader_id == actor_id and part.proposed is not None
                    and part.proposed.leader_epoch > rs.leader_epoch):
                # Its leadership is being replaced (it came back as a new process, perhaps
                # on an empty disk whose epoch cache cannot tell that it led this epoch):
                # told to lead the old epoch until the write lands, it would take produce
                # at offsets the ISR already holds, and followers fetching from it would
                # cut their logs back to its end. It waits, leaderless, for the new state.
                leader_id = None
            leader = self.actors.get(leader_id) if leader_id is not None else None
            out.append([t, p, {"leader_epoch": rs.leader_epoch, "leader": leader_id,
                               "leader_endpoint": leader.endpoint if leader is not None else None,
                               "replicas": list(rs.replicas), "isr": list(rs.isr), "min_insync": rs.min_insync,
                               "replica_endpoints": {a: self.actors[a].endpoint for a in rs.replicas
                                                     if a in self.actors},
                               # The last HW a leader published: a new leader's reads start there.
                               "high_watermark": part.log_end}])
        return out

    def replication_status(self) -> list[dict]:
        """Replicated partitions with fewer in-sync replicas than replicas, or no leader."""
        out = []
        for (t, p), part in sorted(self.partitions.items()):
            rs = part.replication
            if rs is None:
                continue
            keeping_up = len(rs.isr) if part.keeping_up is None else min(part.keeping_up, len(rs.isr))
            if not (rs.under_replicated or rs.leader is None or keeping_up < len(rs.isr)):
                continue
            out.append({"topic": t, "partition": p, "leader": rs.leader, "leader_epoch": rs.leader_epoch,
                        "replicas": list(rs.replicas), "isr": list(rs.isr), "min_insync": rs.min_insync,
                        "keeping_up": keeping_up,
                        "below_min_insync": rs.below_min_insync or keeping_up < rs.min_insync,
                        "offline": rs.leader is None})
        return out

    def require_topic(self, name: str) -> dict:
        topic = self.topics.get(name)
        if topic is None:
            raise UnknownTopic(f"unknown topic {name!r}; create it first (auto-create is off)", topic=name)
        return topic

    def partition_count(self, name: str) -> int:
        return self.require_topic(name)["partitions"]

    def alter_topic(self, name: str, partitions: int | None, config_changes: dict, now_ms: int) -> list:
        """Grow `name` to `partitions` and/or change its log config; returns effects.

        Partitions only grow: shrinking would move keyed records to other partitions and
        strand the offsets of the ones removed. A config change is sent to the actors
        owning the topic (their assignment carries it), which apply it to the open logs.
        """
        topic = self.require_topic(name)
        current = topic["partitions"]
        if partitions is not None and partitions < current:
            raise InvalidPartitions(f"topic {name!r} has {current} partitions; partitions can only grow",
                                    topic=name, partitions=current, got=partitions)
        try:
            config = LogConfig.from_dict({**topic["config"], **config_changes}).to_dict()
        except (ValueError, TypeError) as exc:
            where = {"field": exc.field, "got": exc.got} if isinstance(exc, InvalidSetting) else {}
            raise ProtocolError(f"invalid topic config: {exc}", topic=name, **where) from None
        effects: list = []
        if config != topic["config"]:
            topic["config"] = config
            owners = {part.owner for (t, _p), part in self.partitions.items() if t == name and part.owner}
            effects += self._assign_effects({a for a in owners if a in self.actors})
        if partitions is not None and partitions > current and "replication_factor" in topic:
            # The new partitions are replicated as the topic's first ones are: placed on
            # R actors, held until their replica sets are durable (as create_topic's are).
            self._check_placeable(topic["replication_factor"])
            topic["partitions"] = partitions
            decisions = self._place_replicated(name, range(current, partitions), topic["replication_factor"],
                                               topic["min_insync"])
            held = self._assign_effects({a for _key, rs in decisions for a in rs.replicas})
            return [PersistTopics()] + effects + self._decide(decisions, held)
        if partitions is not None and partitions > current:
            topic["partitions"] = partitions
            for p in range(current, partitions):
                self.partitions[(name, p)] = PartitionInfo()
            placed = self._place_unplaced()
            effects += [e for e in placed if e not in effects]
        return [PersistTopics()] + effects

    def delete_topic(self, name: str, now_ms: int) -> list:
        """Forget `name` and have every actor holding a copy of its partitions delete the
        files (DeletePartitionsOn, resent until confirmed: `on_partitions_deleted`).
        The actors are sent their assignment first (the same socket keeps the order), so
        they close the logs and stop serving them before the delete arrives."""
        topic = self.require_topic(name)
        holders: set[str] = set()
        for p in range(topic["partitions"]):
            part = self.partitions.pop((name, p))
            actors = {part.owner} if part.owner is not None and not part.replicated else set()
            for rs in (part.replication, part.proposed):
                if rs is not None:
                    actors.update(rs.replicas, rs.target or ())
            actors.discard(None)
            if actors:
                self.deleting[(name, p)] = actors
                holders |= actors
        del self.topics[name]
        for actor_id in holders:
            self._deletes_sent_ms.pop(actor_id, None)
        return [PersistTopics()] + self._assign_effects({a for a in holders if a in self.actors}) \
            + self._deletion_requests(now_ms)

    def pending_deletion(self, name: str) -> list[list]:
        """[[partition, actor_id], ...] of `name`'s deleted partitions still on some disk."""
        return [[p, a] for (t, p), actors in sorted(self.deleting.items()) if t == name for a in sorted(actors)]

    def on_partitions_deleted(self, actor_id: str, deleted: list) -> list:
        changed = False
        for item in deleted:
            key = (item[0], item[1])
            actors = self.deleting.get(key)
            if actors is not None and actor_id in actors:
                actors.discard(actor_id)
                changed = True
                if not actors:
                    del self.deleting[key]
        return [PersistTopics()] if changed else []

    def _deletion_requests(self, now_ms: int) -> list:
        """One DeletePartitionsOn per live actor with deletions to confirm, at most every
        DELETE_RESEND_MS (an unanswered or partly failed one goes again)."""
        if not self.deleting:
            return []
        wanted: dict[str, list] = {}
        for (t, p), actors in sorted(self.deleting.items()):
            for actor_id in actors:
                info = self.actors.get(actor_id)
                if info is not None and info.alive:
                    wanted.setdefault(actor_id, []).append([t, p])
        out = []
        for actor_id, parts in sorted(wanted.items()):
            sent = self._deletes_sent_ms.get(actor_id)
            if sent is None or now_ms - sent >= DELETE_RESEND_MS:
                self._deletes_sent_ms[actor_id] = now_ms
                out.append(DeletePartitionsOn(actor_id, parts))
        return out

    # -- actors -----------------------------------------------------------------------------

    def register(self, actor_id: str, endpoint: str, storage_id: str, pid: int, reported: list,
                 now_ms: int, not_open: list | None = None, not_open_count: int = 0, rack: str | None = None,
                 replica_states: list | None = None) -> list:
        """A partition actor's (re-)registration, once a second. Returns effects."""
        self._clock(now_ms)
        info = self.actors.get(actor_id)
        if info is None and len(self.actors) >= MAX_ACTORS:
            self._forget_dead(now_ms, older_than_ms=0)
            if len(self.actors) >= MAX_ACTORS:
                raise Unavailable("too many partition actors registered", actor_id=actor_id, limit=MAX_ACTORS)
        is_new = info is None or not info.alive or info.endpoint != endpoint or info.pid != pid
        # A pid this coordinator saw before tells a restart. One it never saw (it restarted or
        # took over since) tells nothing, but the replica states do: a process that ran
        # through the takeover reports every replica it was assigned, a new one none. Kept
        # as leader at the same epoch, a new process refuses to lead it (replica.py), and
        # the partition would wait for an election that never comes.
        restarted = (info is not None and (not info.alive or info.pid != pid)) or \
            (info is None and not replica_states and self._holds_replicas(actor_id))
        self.actors[actor_id] = ActorInfo(actor_id, endpoint, storage_id, pid, now_ms, True,
                                          list(not_open or []), not_open_count, rack)
        self.on_report(actor_id, reported, now_ms)
        if replica_states:
            self.on_replica_states(actor_id, replica_states)
        if not is_new:
            return []
        effects = self._place_unplaced()
        effects += self._rebalance_storage(storage_id)
        effects += self._reelect(only_actor=actor_id, restarted=actor_id if restarted else None)
        return effects

    def _holds_replicas(self, actor_id: str) -> bool:
        return any(part.newest is not None and actor_id in part.newest.replicas for part in self.partitions.values())

    def deregister(self, actor_id: str, pid: int, now_ms: int) -> list:
        """The actor stopped on purpose and closed its logs: treat it as dead now, so its
        partitions move at once instead of after ``actor_timeout_ms``. A message from an
        earlier process of that actor id (another pid) changes nothing."""
        info = self.actors.get(actor_id)
        if info is None or not info.alive or info.pid != pid:
            return []
        info.alive = False
        info.last_seen_ms = now_ms
        return self._move_from_dead(info) + self._reelect(only_actor=actor_id)

    def on_report(self, actor_id: str, reported: list, now_ms: int) -> list[tuple[str, int, int, int]]:
        """Log ends from an actor; returns the (topic, partition, start, end) that it owns."""
        info = self.actors.get(actor_id)
        if info is not None:
            info.last_seen_ms = now_ms
        changed = []
        for item in reported:
            if not (isinstance(item, list) and len(item) >= 5):
                continue
            topic, partition, start, end, size = item[:5]
            part = self.partitions.get((topic, partition))
            if part is None or part.owner != actor_id:
                continue  # a report from a previous owner, or of a deleted topic
            part.log_start, part.log_end, part.size_bytes = start, end, size
            if len(item) > 5 and isinstance(item[5], int):  # an older actor reports five fields
                part.bytes_appended = item[5]
            changed.append((topic, partition, start, end))
        return changed

    def tick(self, now_ms: int) -> list:
        effects: list = []
        if self._clock(now_ms):
            effects += self._reelect()  # replicas that never registered since the restart are dead
        for info in self.actors.values():
            if info.alive and now_ms - info.last_seen_ms > self.actor_timeout_ms:
                info.alive = False
                effects += self._move_from_dead(info) + self._reelect(only_actor=info.actor_id)
        if any(not info.alive and now_ms - info.last_seen_ms >= FORGET_DEAD_ACTOR_MS
               for info in self.actors.values()):
            self._forget_dead(now_ms, older_than_ms=FORGET_DEAD_ACTOR_MS)
        return effects + self._deletion_requests(now_ms)

    def _forget_dead(self, now_ms: int, older_than_ms: int) -> None:
        """Drop actors silent for ``older_than_ms`` that own no partition (nothing refers to them)."""
        owners = {info.owner for info in self.partitions.values()}
        owners.update(a for info in self.partitions.values() if info.replicated
                      for rs in (info.replication, info.proposed) if rs is not None for a in rs.replicas)
        owners.update(a for actors in self.deleting.values() for a in actors)
        gone = [a for a, info in self.actors.items()
                if not info.alive and now_ms - info.last_seen_ms >= older_than_ms and a not in owners]
        for actor_id in gone:
            del self.actors[actor_id]

    def assignment_for(self, actor_id: str) -> list[list]:
        """Unreplicated partitions it owns and replicas it holds (effective state only)."""
        return [[t, p, self.topics[t]["config"]] for (t, p), info in sorted(self.partitions.items())
                if (info.owner == actor_id and info.replication is None and info.proposed is None)
                or (info.replication is not None and actor_id in info.replication.replicas)]

    # -- placement --------------------------------------------------------------------------

    def _load(self) -> dict[str, int]:
        load = {a: 0 for a, info in self.actors.items() if info.alive}
        for part in self.partitions.values():
            if part.owner in load and not part.replicated:
                load[part.owner] += 1
        return load

    def _place_unplaced(self) -> list:
        load = self._load()
        touched: set[str] = set()
        for key, part in sorted(self.partitions.items()):
            if part.owner is not None or part.replicated:
                continue
            candidates = [a for a in load if part.storage_id in (None, self.actors[a].storage_id)]
            if not candidates:
                continue
            target = min(candidates, key=lambda a: (load[a], a))
            part.owner = target
            part.storage_id = self.actors[target].storage_id
            load[target] += 1
            touched.add(target)
        return self._assign_effects(touched)

    def _rebalance_storage(self, storage_id: str) -> list:
        load = {a: n for a, n in self._load().items() if self.actors[a].storage_id == storage_id}
        touched: set[str] = set()
        while len(load) > 1:
            most = max(load, key=lambda a: (load[a], a))
            least = min(load, key=lambda a: (load[a], a))
            if load[most] - load[least] <= 1:
                break
            key = max(k for k, part in self.partitions.items() if part.owner == most and not part.replicated)
            self.partitions[key].owner = least
            load[most] -= 1
            load[least] += 1
            touched.update((most, least))
        effects = self._assign_effects(touched)
        return ([PersistTopics()] + effects) if effects else []

    def _move_from_dead(self, dead: ActorInfo) -> list:
        load = {a: n for a, n in self._load().items() if self.actors[a].storage_id == dead.storage_id}
        if not load:
            return []
        touched: set[str] = set()
        for key, part in sorted(self.partitions.items()):
            if part.owner == dead.actor_id and not part.replicated:
                target = min(load, key=lambda a: (load[a], a))
                part.owner = target
                load[target] += 1
                touched.add(target)
        effects = self._assign_effects(touched)
        return ([PersistTopics()] + effects) if effects else []

    def _assign_effects(self, actor_ids: set[str]) -> list:
        return [AssignActor(a) for a in sorted(actor_ids)]

    # -- queries ----------------------------------------------------------------------------

    def endpoint_of(self, topic: str, partition: int) -> str | None:
        part = self.partitions.get((topic, partition))
        if part is None or part.owner is None:
            return None
        actor = self.actors.get(part.owner)
        return actor.endpoint if actor is not None and actor.alive else None

    def metadata(self, names: list[str] | None) -> list[dict]:
        selected = sorted(self.topics) if names is None else names
        out = []
        for name in selected:
            topic = self.require_topic(name)
            parts = []
            for p in range(topic["partitions"]):
                part = self.partitions[(name, p)]
                parts.append({"partition": p, "actor_id": part.owner, "endpoint": self.endpoint_of(name, p),
                              **self._replica_fields(part)})
            out.append({"name": name, "partitions": parts, "config": topic["config"]})
        return out

    def describe(self, name: str) -> list[dict]:
        topic = self.require_topic(name)
        out = []
        for p in range(topic["partitions"]):
            part = self.partitions[(name, p)]
            fields = self._replica_fields(part)
            rs = part.replication
            if rs is None:
                high_watermark = part.log_end
                log_ends = {part.owner: part.log_end} if part.owner is not None else {}
            else:
                high_watermark = part.high_watermark if part.high_watermark is not None else part.log_end
                log_ends = {a: part.replica_log_ends[a] for a in rs.replicas if a in part.replica_log_ends}
            out.append({"partition": p, "log_start": part.log_start, "log_end": part.log_end,
                        "bytes": part.size_bytes, "bytes_appended": part.bytes_appended, "actor_id": part.owner,
                        "endpoint": self.endpoint_of(name, p), "leader": part.owner, **fields,
                        "high_watermark": high_watermark, "replica_log_ends": log_ends,
                        "min_insync": rs.min_insync if rs is not None else 1})
        return out

    def _replica_fields(self, part: PartitionInfo) -> dict:
        """`leader_epoch`, `replicas`, `isr` as clients see them (an unreplicated partition: its owner)."""
        rs = part.replication
        if rs is None:
            owner = [] if part.owner is None or part.replicated else [part.owner]
            return {"leader_epoch": 0, "replicas": owner, "isr": owner}
        return {"leader_epoch": rs.leader_epoch, "replicas": list(rs.replicas), "isr": list(rs.isr)}

    def log_range(self, topic: str, partition: int) -> tuple[int, int]:
        part = self.partitions[(topic, partition)]
        return part.log_start, part.log_end

    def actor_status(self, now_ms: int) -> list[dict]:
        out = []
        for a in sorted(self.actors.values(), key=lambda x: x.actor_id):
            # Alive but unable to open some of its partitions (their clients get
            # UNAVAILABLE) is not healthy: the actor's log says why, and so does this.
            out.append({"kind": "partition-log", "actor_id": a.actor_id, "pid": a.pid, "endpoint": a.endpoint,
                        "storage_id": a.storage_id, "healthy": a.alive and a.not_open_count == 0,
                        "alive": a.alive, "last_seen_ms_ago": now_ms - a.last_seen_ms,
                        "rack": a.rack,
                        "partitions": [[t, p] for (t, p), info in sorted(self.partitions.items())
                                       if info.owner == a.actor_id],
                        "not_open_count": a.not_open_count if a.alive else 0,
                        "not_open": a.not_open if a.alive else []})
        return out
