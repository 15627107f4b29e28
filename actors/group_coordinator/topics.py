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
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zbroker.protocol.errors import ProtocolError, TopicExists, Unavailable, UnknownTopic
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


@dataclasses.dataclass
class PartitionInfo:
    owner: str | None = None
    storage_id: str | None = None
    log_start: int = 0
    log_end: int = 0
    size_bytes: int = 0


# The registry is bounded: registrations beyond MAX_ACTORS are refused, and an
# actor dead for FORGET_DEAD_ACTOR_MS that owns nothing is forgotten. Without
# --curve the internal endpoint trusts any local process, and a stream of
# forged registrations must not grow the coordinator without limit.
MAX_ACTORS = 1024
FORGET_DEAD_ACTOR_MS = 10 * 60 * 1000


class TopicRegistry:
    def __init__(self, *, actor_timeout_ms: int = 5000) -> None:
        self.actor_timeout_ms = actor_timeout_ms
        self.topics: dict[str, dict[str, Any]] = {}  # name -> {"partitions": n, "config": {...}}
        self.partitions: dict[Key, PartitionInfo] = {}
        self.actors: dict[str, ActorInfo] = {}

    # -- persistence ------------------------------------------------------------------------

    def snapshot(self) -> dict:
        return {
            "topics": self.topics,
            "placement": [[t, p, info.owner, info.storage_id] for (t, p), info in sorted(self.partitions.items())],
        }

    def restore(self, snapshot: dict) -> None:
        self.topics = {name: {"partitions": int(t["partitions"]), "config": dict(t.get("config") or {})}
                       for name, t in snapshot.get("topics", {}).items()}
        for name, t in self.topics.items():
            for p in range(t["partitions"]):
                self.partitions[(name, p)] = PartitionInfo()
        for t, p, owner, storage in snapshot.get("placement", []):
            if (t, p) in self.partitions:
                self.partitions[(t, p)].owner = owner
                self.partitions[(t, p)].storage_id = storage

    # -- topics -----------------------------------------------------------------------------

    def create_topic(self, name: str, partitions: int, config: dict | None, now_ms: int) -> list:
        validate_topic_name(name)
        if name in self.topics:
            existing = self.topics[name]["partitions"]
            raise TopicExists(f"topic {name!r} already exists", topic=name, partitions=existing)
        try:
            log_config = LogConfig.from_dict(config)
        except (ValueError, TypeError) as exc:
            where = {"field": f"config.{exc.field}", "got": exc.got} if isinstance(exc, InvalidSetting) else {}
            raise ProtocolError(f"invalid topic config: {exc}", topic=name, **where) from None
        self.topics[name] = {"partitions": partitions, "config": log_config.to_dict()}
        for p in range(partitions):
            self.partitions[(name, p)] = PartitionInfo()
        return [PersistTopics()] + self._place_unplaced()

    def require_topic(self, name: str) -> dict:
        topic = self.topics.get(name)
        if topic is None:
            raise UnknownTopic(f"unknown topic {name!r}; create it first (auto-create is off)", topic=name)
        return topic

    def partition_count(self, name: str) -> int:
        return self.require_topic(name)["partitions"]

    # -- actors -----------------------------------------------------------------------------

    def register(self, actor_id: str, endpoint: str, storage_id: str, pid: int, reported: list,
                 now_ms: int, not_open: list | None = None, not_open_count: int = 0) -> list:
        """A partition actor's (re-)registration, once a second. Returns effects."""
        info = self.actors.get(actor_id)
        if info is None and len(self.actors) >= MAX_ACTORS:
            self._forget_dead(now_ms, older_than_ms=0)
            if len(self.actors) >= MAX_ACTORS:
                raise Unavailable("too many partition actors registered", actor_id=actor_id, limit=MAX_ACTORS)
        is_new = info is None or not info.alive or info.endpoint != endpoint or info.pid != pid
        self.actors[actor_id] = ActorInfo(actor_id, endpoint, storage_id, pid, now_ms, True,
                                          list(not_open or []), not_open_count)
        self.on_report(actor_id, reported, now_ms)
        if not is_new:
            return []
        effects = self._place_unplaced()
        effects += self._rebalance_storage(storage_id)
        return effects

    def deregister(self, actor_id: str, pid: int, now_ms: int) -> list:
        """The actor stopped on purpose and closed its logs: treat it as dead now, so its
        partitions move at once instead of after ``actor_timeout_ms``. A message from an
        earlier process of that actor id (another pid) changes nothing."""
        info = self.actors.get(actor_id)
        if info is None or not info.alive or info.pid != pid:
            return []
        info.alive = False
        info.last_seen_ms = now_ms
        return self._move_from_dead(info)

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
            changed.append((topic, partition, start, end))
        return changed

    def tick(self, now_ms: int) -> list:
        effects: list = []
        for info in self.actors.values():
            if info.alive and now_ms - info.last_seen_ms > self.actor_timeout_ms:
                info.alive = False
                effects += self._move_from_dead(info)
        if any(not info.alive and now_ms - info.last_seen_ms >= FORGET_DEAD_ACTOR_MS
               for info in self.actors.values()):
            self._forget_dead(now_ms, older_than_ms=FORGET_DEAD_ACTOR_MS)
        return effects

    def _forget_dead(self, now_ms: int, older_than_ms: int) -> None:
        """Drop actors silent for ``older_than_ms`` that own no partition (nothing refers to them)."""
        owners = {info.owner for info in self.partitions.values()}
        gone = [a for a, info in self.actors.items()
                if not info.alive and now_ms - info.last_seen_ms >= older_than_ms and a not in owners]
        for actor_id in gone:
            del self.actors[actor_id]

    def assignment_for(self, actor_id: str) -> list[list]:
        return [[t, p, self.topics[t]["config"]] for (t, p), info in sorted(self.partitions.items())
                if info.owner == actor_id]

    # -- placement --------------------------------------------------------------------------

    def _load(self) -> dict[str, int]:
        load = {a: 0 for a, info in self.actors.items() if info.alive}
        for part in self.partitions.values():
            if part.owner in load:
                load[part.owner] += 1
        return load

    def _place_unplaced(self) -> list:
        load = self._load()
        touched: set[str] = set()
        for key, part in sorted(self.partitions.items()):
            if part.owner is not None:
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
            key = max(k for k, part in self.partitions.items() if part.owner == most)
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
            if part.owner == dead.actor_id:
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
                parts.append({"partition": p, "actor_id": part.owner, "endpoint": self.endpoint_of(name, p)})
            out.append({"name": name, "partitions": parts, "config": topic["config"]})
        return out

    def describe(self, name: str) -> list[dict]:
        topic = self.require_topic(name)
        out = []
        for p in range(topic["partitions"]):
            part = self.partitions[(name, p)]
            out.append({"partition": p, "log_start": part.log_start, "log_end": part.log_end,
                        "bytes": part.size_bytes, "actor_id": part.owner,
                        "endpoint": self.endpoint_of(name, p)})
        return out

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
                        "partitions": [[t, p] for (t, p), info in sorted(self.partitions.items())
                                       if info.owner == a.actor_id],
                        "not_open_count": a.not_open_count if a.alive else 0,
                        "not_open": a.not_open if a.alive else []})
        return out
