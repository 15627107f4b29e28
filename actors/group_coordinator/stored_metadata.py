"""What the offset store holds of the topic registry, and the writes that keep it so. Pure.

Theory of operation
-------------------
Topic metadata lives in the store (issues 25, 26), so that a coordinator on
another node can take over; the coordinator reaches it only through its
commit writer (``load_metadata``/``write_metadata``). `StoredMetadata` keeps
the coordinator's copy of what the store holds (``topics``, ``partitions``,
as last loaded or confirmed) and the queue of writes to it.

Two kinds of write go through that queue, one at a time and in order:

* a *decision* (a `topics.WriteMetadata` effect: a replicated topic's
  placement, a leader or ISR change), whose rows already carry the leader
  epoch they expect to find;
* a *sync*: whatever else the registry changed (unreplicated topics, their
  placement, config and partition count), computed when its turn comes as the
  difference between the registry and ``topics``/``partitions``.

One at a time, because two change sets for one partition in flight at once
could land in either order, and an ISR change keeps the leader epoch, so its
condition alone would not catch the reordering. An unreplicated partition is
stored as a replica set of one (its owner, leader epoch 0); the storage it
lives on is relearnt from its owner's registration.

Every item carries callbacks held until it is durable (replies, assigns):
durable before effective. A write whose outcome is unknown (the writer
failed, or did not answer) is sent again; if that retry is refused, the
shell reloads the store and `already_applied` tells whether the first
attempt landed after all.

`snapshot_from_store` turns loaded metadata into the form
`TopicRegistry.restore` reads, the same form topics.msgpack held, so a
deployment with that file migrates once (`migration_changes`).
"""

from __future__ import annotations

import collections
import dataclasses
import random
from typing import Any, Callable

from zbroker.storage.offsets.metadata import (Metadata, MetadataChanges, PartitionState, PartitionUpdate,
                                              TopicMeta)

Key = tuple[str, int]


@dataclasses.dataclass
class Pending:
    """One queued write: a decision (`decision` is its WriteMetadata effect) or a sync (None)."""
    decision: Any = None
    held: list[Callable[[bool], None]] = dataclasses.field(default_factory=list)
    changes: MetadataChanges | None = None  # set once sent
    attempts: int = 0


def metadata_from_wire(topics: list, partitions: list, group_configs: list = ()) -> Metadata:
    """A ``load_metadata`` reply's lists; ProtocolError for anything malformed."""
    loaded = [TopicMeta.from_wire(t, "load_metadata") for t in topics]
    states = [PartitionState.from_wire(p, "load_metadata") for p in partitions]
    configs = {g[0]: g[1] for g in group_configs
               if isinstance(g, list) and len(g) == 2 and isinstance(g[0], str) and isinstance(g[1], dict)}
    return Metadata({t.name: t for t in loaded}, {ps.key: ps for ps in states}, configs)


def snapshot_from_store(meta: Metadata) -> dict:
    """The `TopicRegistry.restore` form of what the store holds."""
    topics: dict[str, dict] = {}
    for t in meta.topics.values():
        entry: dict[str, Any] = {"partitions": t.partitions, "config": dict(t.config)}
        if t.replication_factor > 1:
            entry.update(replication_factor=t.replication_factor, min_insync=t.min_insync,
                         incarnation=t.incarnation)
        topics[t.name] = entry
    placement, replicated = [], []
    for (topic, partition), ps in sorted(meta.partitions.items()):
        if topic not in meta.topics:
            continue
        if meta.topics[topic].replication_factor > 1:
            replicated.append([topic, partition, list(ps.replicas), ps.leader, ps.leader_epoch, list(ps.isr)])
        else:
            placement.append([topic, partition, ps.leader, None])
    return {"topics": topics, "placement": placement, "replicated": replicated}


class StoredMetadata:
    def __init__(self, rng: random.Random | None = None) -> None:
        self.topics: dict[str, TopicMeta] = {}
        self.partitions: dict[Key, PartitionState] = {}
        self.group_configs: dict[str, dict] = {}
        self.loaded = False
        self.queue: collections.deque[Pending] = collections.deque()
        self.in_flight: Pending | None = None
        self._rng = rng or random.Random()

    # -- what the store holds ----------------------------------------------------------------

    def on_loaded(self, meta: Metadata) -> None:
        self.topics = dict(meta.topics)
        self.partitions = dict(meta.partitions)
        self.group_configs = dict(meta.group_configs)
        self.loaded = True

    def _record(self, changes: MetadataChanges) -> None:
        for name, _incarnation in changes.delete_topics:
            self.topics.pop(name, None)
            for key in [k for k in self.partitions if k[0] == name]:
                del self.partitions[key]
        for t in (*changes.create_topics, *changes.update_topics):
            self.topics[t.name] = t
        for u in changes.partitions:
            self.partitions[u.state.key] = u.state
        for group, config in changes.group_configs:
            if config is None:
                self.group_configs.pop(group, None)
            else:
                self.group_configs[group] = config

    def already_applied(self, changes: MetadataChanges, meta: Metadata) -> bool:
        """Does `meta` (reloaded) hold everything `changes` wrote?"""
        return (all(meta.topics.get(t.name) == t for t in (*changes.create_topics, *changes.update_topics))
                and all(name not in meta.topics for name, _i in changes.delete_topics)
                and all(meta.partitions.get(u.state.key) == u.state for u in changes.partitions)
                and all(meta.group_configs.get(g) == c for g, c in changes.group_configs))

    # -- the queue -----------------------------------------------------------------------------

    def decide(self, effect: Any) -> Pending:
        item = Pending(decision=effect)
        self.queue.append(item)
        return item

    def write(self, changes: MetadataChanges) -> Pending:
        """A change set of the caller's own (group configs, a migration), in its turn."""
        item = Pending(changes=changes)
        self.queue.append(item)
        return item

    def sync(self) -> Pending:
        """A sync after everything queued; one already waiting at the end of the queue serves."""
        if self.queue and self.queue[-1].decision is None and self.queue[-1].changes is None:
            return self.queue[-1]
        item = Pending()
        self.queue.append(item)
        return item

    def when_durable(self, callback: Callable[[bool], None]) -> None:
        """`callback(True)` once everything queued so far is durable (False: refused); at once if nothing is."""
        last = self.queue[-1] if self.queue else self.in_flight
        if last is None:
            callback(True)
        else:
            last.held.append(callback)

    def next_to_send(self, registry: Any) -> Pending | None:
        """The head of the queue with its change set built, if nothing is in flight; empty syncs
        are finished on the way (their callbacks run)."""
        while self.in_flight is None and self.queue:
            item = self.queue.popleft()
            if item.changes is None:
                item.changes = (self._decision_changes(item.decision) if item.decision is not None
                                else self.diff(registry))
            if item.changes.empty:
                self._finish(item, True)
                continue
            item.attempts += 1
            self.in_flight = item
            return item
        return None

    def resend(self) -> Pending | None:
        """The write in flight failed without an answer: it goes again, same change set."""
        item, self.in_flight = self.in_flight, None
        if item is not None:
            self.queue.appendleft(item)
        return item

    def on_written(self, applied: bool) -> Pending | None:
        """The store's answer to the write in flight; returns it, its callbacks run."""
        item, self.in_flight = self.in_flight, None
        if item is None:
            return None
        if applied:
            assert item.changes is not None
            self._record(item.changes)
        self._finish(item, applied)
        return item

    def abandon(self) -> list[Pending]:
        """This term is over: nothing queued is written; callbacks are dropped with it."""
        items = ([self.in_flight] if self.in_flight is not None else []) + list(self.queue)
        self.in_flight, self.queue = None, collections.deque()
        return items

    def _finish(self, item: Pending, applied: bool) -> None:
        for callback in item.held:
            callback(applied)

    # -- building change sets ----------------------------------------------------------------

    @staticmethod
    def _decision_changes(effect: Any) -> MetadataChanges:
        return MetadataChanges(create_topics=tuple(TopicMeta.from_wire(t) for t in effect.create_topics),
                               partitions=tuple(PartitionUpdate.from_wire(r) for r in effect.partitions))

    def diff(self, registry: Any) -> MetadataChanges:
        """What the registry holds beyond decisions and the store does not: unreplicated topics
        and their placement, every topic's partition count and config, and deleted topics."""
        create, update = [], []
        for name, t in sorted(registry.topics.items()):
            stored = self.topics.get(name)
            replicated = "min_insync" in t
            if stored is None:
                if not replicated:  # a replicated topic is created by its decision
                    create.append(TopicMeta(name, t["partitions"], dict(t["config"]), 1, 1,
                                            self._rng.getrandbits(63)))
                continue
            want = TopicMeta(name, t["partitions"], dict(t["config"]), t.get("replication_factor", 1),
                             t.get("min_insync", 1), stored.incarnation)
            if want != stored:
                update.append(want)
        known = set(self.topics) | {t.name for t in create}
        updates = []
        for (topic, partition), part in sorted(registry.partitions.items()):
            if part.replicated or part.owner is None or topic not in known:
                continue
            want = PartitionState(topic, partition, (part.owner,), part.owner, 0, (part.owner,))
            stored = self.partitions.get((topic, partition))
            if stored != want:
                updates.append(PartitionUpdate(want, None if stored is None else stored.leader_epoch))
        # A topic the registry no longer has was deleted (delete_topic): its rows go too, or a
        # restarted or new leader would load it back.
        deleted = tuple((name, t.incarnation) for name, t in sorted(self.topics.items()) if name not in registry.topics)
        return MetadataChanges(create_topics=tuple(create), update_topics=tuple(update), partitions=tuple(updates),
                               delete_topics=deleted)

    def migration_changes(self, snapshot: dict) -> MetadataChanges:
        """Everything a topics.msgpack snapshot holds, as one change set for an empty store."""
        create, updates = [], []
        for name, t in sorted(snapshot.get("topics", {}).items()):
            rf = int(t.get("replication_factor", 1))
            create.append(TopicMeta(name, int(t["partitions"]), dict(t.get("config") or {}), rf,
                                    int(t.get("min_insync", 1)) if rf > 1 else 1,
                                    int(t.get("incarnation") or self._rng.getrandbits(63))))
        names = {t.name for t in create}
        for topic, partition, owner, _storage in snapshot.get("placement", []):
            if topic in names and owner is not None:
                updates.append(PartitionUpdate(PartitionState(topic, partition, (owner,), owner, 0, (owner,)), None))
        for topic, partition, replicas, leader, leader_epoch, isr in snapshot.get("replicated", []):
            if topic in names:
                updates.append(PartitionUpdate(PartitionState(topic, partition, tuple(replicas), leader,
                                                              int(leader_epoch), tuple(isr)), None))
        return MetadataChanges(create_topics=tuple(create), partitions=tuple(updates))
