"""Replica placement and leader election for replicated partitions (R > 1): pure rules.

Theory of operation
-------------------
The coordinator is the controller of every replicated partition. This module
holds the rules it decides by; `TopicRegistry` (topics.py) holds the state,
calls these functions, and makes each decision durable before it takes effect.

* **Placement.** The R replicas of a partition go to R live partition actors
  with R distinct storage ids (two replicas in one data directory would be one
  copy). Among those, each next replica prefers an actor on a rack, then on a
  host, that the partition does not use yet, then the least loaded actor. The
  first replica (the preferred leader) goes to the actor leading the fewest
  partitions, so leadership spreads. Fewer distinct storages than R is refused
  with NOT_ENOUGH_REPLICAS, ``data.qualifying`` = how many actors could take a
  replica.
* **Election.** Only an ISR member may lead: the first live member of the ISR
  in replica order (so the preferred leader wins back leadership when it is in
  sync). A dead leader leaves the ISR at its replacement's election, unless it
  is the last member: the ISR is never empty, so that it always names who holds
  every acknowledged record. A partition whose whole ISR is dead has no leader
  and stays unavailable until an ISR member returns, unless unclean election is
  on: then the first live replica leads with an ISR of itself, and whatever only
  the dead ISR held (acknowledged records included) is lost.
* **Epochs.** Every change of leader (to another actor or to none) bumps the
  leader epoch by one; nothing else does. Replicas refuse an older epoch, which
  is what fences a deposed leader.
* **A restarted actor** (a new process, or back from the dead) may have lost
  the unsynced tail of its logs (``--fsync interval``): it leaves every ISR it
  was in (unless it is the last member), and a partition it led gets a new
  leader, or itself again at a new epoch if it is the only ISR member, so that
  no offset is ever written twice under one epoch. If other ISR members exist
  but none lives, the partition has no leader until one returns: they hold
  what the restarted one may have lost with its disk or its unsynced tail. It rejoins the ISR when its
  leader sees it caught up. A coordinator knows a restart by a pid it saw before;
  after it took over (or restarted) it has seen none, so an actor it meets for the
  first time that reports no replica state while it holds replicas counts as new
  (one that ran through the takeover reports every replica it holds).
* **ISR changes** come only from the current leader (`alter_isr`) at the
  current epoch; the leader may not drop itself, and the ISR stays a subset of
  the replicas, kept in replica order. A leader never proposes fewer than
  min_insync members (replica.py, "ISR floor"), so that the ISR always names
  M holders of everything below the HW; only a dead or restarted member's
  removal here takes it lower.
* **Reassignment** is online: the replica set first grows to target + old, the
  new replicas catch up and the leader adds them to the ISR; once every target
  replica is in the ISR the set shrinks to the target (a new leader from the
  target's ISR members if the old one leaves).
"""

from __future__ import annotations

import dataclasses
from urllib.parse import urlsplit

from zbroker.protocol.errors import NotEnoughReplicas, ProtocolError, StaleEpoch


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaSet:
    """One replicated partition's controller state (what the store records)."""
    replicas: tuple[str, ...]  # ordered; the first is the preferred leader
    leader: str | None
    leader_epoch: int
    isr: tuple[str, ...]
    min_insync: int
    # An online reassignment in progress: the replica set to end with. Not stored: a
    # coordinator restarted mid-move keeps the grown set until the move is asked again.
    target: tuple[str, ...] | None = None

    def to_wire(self, topic: str, partition: int) -> list:
        """[topic, partition, replicas, leader, leader_epoch, isr] (storage.offsets.metadata.PartitionState)."""
        return [topic, partition, list(self.replicas), self.leader, self.leader_epoch, list(self.isr)]

    @property
    def below_min_insync(self) -> bool:
        return self.leader is None or len(self.isr) < self.min_insync

    @property
    def under_replicated(self) -> bool:
        return len(self.isr) < len(self.replicas)


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    """A live partition actor as placement sees it."""
    actor_id: str
    storage_id: str
    host: str
    rack: str | None
    replicas: int = 0  # replicas it holds now
    leaders: int = 0  # of which it leads


def host_of(endpoint: str) -> str:
    """The host part of an actor's (advertised) endpoint: replicas on one host share its fate."""
    try:
        return urlsplit(endpoint).hostname or endpoint
    except ValueError:
        return endpoint


def qualifying(candidates: list[Candidate]) -> int:
    """How many replicas of one partition these actors can hold: one per distinct storage."""
    return len({c.storage_id for c in candidates})


def place(candidates: list[Candidate], replication_factor: int) -> list[str]:
    """R actor ids for a new partition, the preferred leader first. Raises NotEnoughReplicas."""
    if qualifying(candidates) < replication_factor:
        raise NotEnoughReplicas(
            f"replication factor {replication_factor} needs as many partition actors on distinct data "
            f"directories; {qualifying(candidates)} qualify", replication_factor=replication_factor,
            qualifying=qualifying(candidates))
    chosen: list[Candidate] = []
    pool = sorted(candidates, key=lambda c: c.actor_id)
    first = min(pool, key=lambda c: (c.leaders, c.replicas, c.actor_id))
    chosen.append(first)
    while len(chosen) < replication_factor:
        storages = {c.storage_id for c in chosen}
        hosts = {c.host for c in chosen}
        racks = {c.rack for c in chosen}
        nxt = min((c for c in pool if c.storage_id not in storages),
                  key=lambda c: (c.rack in racks, c.host in hosts, c.replicas, c.actor_id))
        chosen.append(nxt)
    return [c.actor_id for c in chosen]


def elect(rs: ReplicaSet, live: set[str], *, unclean: bool = False) -> ReplicaSet:
    """The partition's state once its leader is re-decided against `live` actors.

    Unchanged when the leader is live; a leadership change (or loss) bumps the epoch.
    """
    if rs.leader is not None and rs.leader in live:
        return rs
    leader = next((r for r in rs.replicas if r in rs.isr and r in live), None)
    isr = rs.isr
    if leader is not None:
        if rs.leader is not None and rs.leader in isr and len(isr) > 1:
            isr = tuple(r for r in isr if r != rs.leader)
    elif unclean:
        leader = next((r for r in rs.replicas if r in live), None)
        if leader is not None:
            isr = (leader,)
    if leader == rs.leader:
        return rs
    return dataclasses.replace(rs, leader=leader, leader_epoch=rs.leader_epoch + 1, isr=isr)


def restarted(rs: ReplicaSet, actor: str, live: set[str]) -> ReplicaSet:
    """The partition's state once `actor` came back as a new process (see the module doc)."""
    if actor not in rs.replicas:
        return rs
    if rs.leader == actor:
        new = elect(rs, live - {actor})
        if new.leader is None:
            others = tuple(r for r in rs.isr if r != actor)
            if others:  # they hold what it may have lost with its disk: none leads until one is back
                return dataclasses.replace(new, isr=others)
            return dataclasses.replace(new, leader=actor, isr=rs.isr)  # the only copy: it leads again
        return new
    if actor in rs.isr and len(rs.isr) > 1:
        return dataclasses.replace(rs, isr=tuple(r for r in rs.isr if r != actor))
    return rs


def alter_isr(rs: ReplicaSet, sender: str, leader_epoch: int, isr: list[str], *, topic: str,
              partition: int) -> ReplicaSet:
    """The leader's proposed ISR, validated. Raises StaleEpoch or ProtocolError."""
    if leader_epoch != rs.leader_epoch or sender != rs.leader:
        raise StaleEpoch(f"alter_isr for {topic}/{partition} at leader epoch {leader_epoch} from {sender!r}; "
                         f"the current epoch is {rs.leader_epoch}, led by {rs.leader!r}",
                         topic=topic, partition=partition, epoch=rs.leader_epoch, got=leader_epoch)
    wanted = set(isr)
    if not wanted <= set(rs.replicas) or rs.leader not in wanted or len(wanted) != len(isr):
        raise ProtocolError("alter_isr: the ISR must be distinct replicas of the partition and include its "
                            "leader", op="alter_isr", topic=topic, partition=partition, got=list(isr),
                            replicas=list(rs.replicas))
    new = tuple(r for r in rs.replicas if r in wanted)
    return rs if new == rs.isr else dataclasses.replace(rs, isr=new)


def start_reassign(rs: ReplicaSet, target: list[str]) -> ReplicaSet:
    """Grow the replica set to target + the replicas leaving (the leader keeps leading)."""
    grown = tuple(target) + tuple(r for r in rs.replicas if r not in target)
    return dataclasses.replace(rs, replicas=grown, target=tuple(target))


def finish_reassign(rs: ReplicaSet, live: set[str]) -> ReplicaSet:
    """Shrink to the target once all of it is in the ISR; unchanged before that."""
    if rs.target is None or not set(rs.target) <= set(rs.isr):
        return rs
    isr = tuple(r for r in rs.target if r in rs.isr)
    shrunk = dataclasses.replace(rs, replicas=rs.target, isr=isr, target=None)
    if rs.leader in rs.target:
        return shrunk
    leader = next((r for r in isr if r in live), None)
    if leader is None:
        return rs  # no live target replica to hand leadership to: wait
    return dataclasses.replace(shrunk, leader=leader, leader_epoch=rs.leader_epoch + 1)
