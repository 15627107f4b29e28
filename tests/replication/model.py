"""A cluster of replica cores on in-memory logs, driven by a tiny test-only controller,
and the invariant checks the Hypothesis tests apply to it.

The memory log keeps batches as (base_offset, record_count, batch_id) and a
durable prefix: a crash keeps only what was synced (or nothing, with the disk).
Every replica syncs what it appended before its next fetch (``--fsync
always``); a leader syncs in a separate step, and reports its synced end to
its core (`on_local_end`), as the shell does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from zbroker.actors.partition_log.replica import Acknowledge, ProposeIsr, Refuse, Replica, ReplicaState
from zbroker.protocol import messages as m
from zbroker.protocol.errors import StaleEpoch, ZBrokerError
from zbroker.storage.log.epochs import LeaderEpochCache


class MemoryEpochs(LeaderEpochCache):
    """The real cache, minus the file: the model keeps it "durable" by never losing it."""

    def _write(self) -> None:
        pass


class MemoryLog:
    def __init__(self) -> None:
        self.batches: list[tuple[int, int, int]] = []
        self.start = 0
        self.durable = 0  # batches synced
        self.epochs = MemoryEpochs(Path("/nonexistent"))

    @property
    def log_start(self) -> int:
        return self.start

    @property
    def log_end(self) -> int:
        return self.batches[-1][0] + self.batches[-1][1] if self.batches else self.start

    @property
    def durable_end(self) -> int:
        return self.batches[self.durable - 1][0] + self.batches[self.durable - 1][1] if self.durable else self.start

    def append(self, count: int, batch_id: int) -> tuple[int, int]:
        base = self.log_end
        self.batches.append((base, count, batch_id))
        return base, base + count

    def read(self, offset: int, max_bytes: int) -> tuple:
        i = next(i for i, (base, count, _) in enumerate(self.batches) if base <= offset < base + count)
        return tuple(self.batches[i:i + 2])

    def append_stored(self, data: tuple) -> int:
        for base, count, batch_id in data:
            assert base == self.log_end, "a replicated batch must continue the log"
            self.batches.append((base, count, batch_id))
        return self.log_end

    truncations = 0  # across every log: how often the tests made a follower cut a tail

    def truncate_to(self, offset: int) -> int:
        if offset < self.log_end:
            MemoryLog.truncations += 1
        self.batches = [b for b in self.batches if b[0] + b[1] <= offset]
        self.durable = min(self.durable, len(self.batches))
        self.epochs.truncate_from_end(self.log_end)
        return self.log_end

    def reset_to(self, offset: int) -> None:
        self.batches, self.start, self.durable = [], offset, 0
        self.epochs.clear()

    def sync(self) -> None:
        self.durable = len(self.batches)

    def lose_unsynced_tail(self) -> None:
        del self.batches[self.durable:]
        self.epochs.trimmed_to(self.log_end)

    def holds(self, base: int, batch_id: int, *, durable_only: bool = False) -> bool:
        batches = self.batches[:self.durable] if durable_only else self.batches
        return any(b[0] == base and b[2] == batch_id for b in batches)

    def offsets(self, below: int) -> dict[int, int]:
        """offset -> batch id, for offsets below `below`."""
        return {o: batch_id for base, count, batch_id in self.batches for o in range(base, base + count) if o < below}


class InvariantViolated(AssertionError):
    pass


# -- the invariants, as functions of plain data (so that crafted bad histories can feed them) --

def check_acknowledged_on_m(copies: int, min_insync: int, batch: object) -> None:
    """At the moment a batch is acknowledged, at least min_insync replicas hold it durably (or
    held it until their disk was lost, after they had reported it: `Cluster.lost_copies`)."""
    if copies < min_insync:
        raise InvariantViolated(f"batch {batch} acknowledged with {copies} durable copies < min_insync {min_insync}")


def check_agreement(replicas: dict[str, tuple[MemoryLog, int]]) -> None:
    """The logs of any two replicas agree on every offset below the smaller high watermark."""
    names = sorted(replicas)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            (log_a, hw_a), (log_b, hw_b) = replicas[a], replicas[b]
            below = min(hw_a, hw_b)
            if log_a.offsets(below) != log_b.offsets(below):
                raise InvariantViolated(f"replicas {a} and {b} disagree below offset {below}")


def check_isr_floor(isr: tuple, proposed: tuple, min_insync: int) -> None:
    """A leader never proposes an ISR below min_insync (unless it already was): the ISR is
    what an election picks from, and must name min_insync holders of everything below the HW."""
    if len(proposed) < min(min_insync, len(isr)):
        raise InvariantViolated(f"ISR {isr} shrunk to {proposed}, below min_insync {min_insync}")


def check_epochs_never_go_back(seen: dict[str, int], name: str, epoch: int) -> None:
    if epoch < seen.get(name, -1):
        raise InvariantViolated(f"{name}'s leader epoch went back from {seen[name]} to {epoch}")
    seen[name] = epoch


# -- the cluster ---------------------------------------------------------------------------

@dataclasses.dataclass
class Node:
    name: str
    log: MemoryLog
    core: Replica | None = None  # None while the process is down


class Cluster:
    NAMES = ("a", "b", "c")

    def __init__(self, min_insync: int, replica_lag_ms: int = 10_000, replica_class: type = Replica) -> None:
        self.now = 0
        self.min_insync = min_insync
        self.lag = replica_lag_ms
        self.replica_class = replica_class
        self.nodes = {name: Node(name, MemoryLog()) for name in self.NAMES}
        self.isolated: set[str] = set()
        # The controller's durable record.
        self.epoch = 0
        self.leader: str | None = "a"
        self.isr: tuple[str, ...] = self.NAMES
        self.next_batch = 0
        self.acknowledged: dict[int, tuple[int, int]] = {}  # batch id -> (base, end)
        self.refused: set[int] = set()  # batch ids whose produce failed after the append
        self.epochs_seen: dict[str, int] = {}
        self.controller_epochs: list[int] = [0]
        # The last HW the current leader published, as the controller hears it (the
        # coordinator's log_end of the partition): sent with every assignment.
        self.published_hw: int | None = None
        # Per node, the batches (base, id) it held durably when its disk was lost: a follower
        # that reported a batch and lost its disk after counted as a copy when it reported it,
        # and the leader cannot know of the loss before it acknowledges (Kafka neither).
        self.lost_copies: dict[str, set[tuple[int, int]]] = {name: set() for name in self.NAMES}
        for name in self.NAMES:
            self.start(name)

    # -- controller ----------------------------------------------------------------------------

    def state(self) -> ReplicaState:
        return ReplicaState(self.epoch, self.leader, self.leader, self.NAMES, self.isr, self.min_insync,
                            {n: n for n in self.NAMES}, self.published_hw)

    def hear_hw(self) -> None:
        """The leader's report: its HW once it has computed one in the controller's epoch."""
        core = self.nodes[self.leader].core if self.leader is not None else None
        if (core is not None and self.leader not in self.isolated and core.is_leader and core.hw_established
                and core.leader_epoch == self.epoch):
            self.published_hw = max(self.published_hw or 0, core.high_watermark)

    def reachable(self, name: str) -> bool:
        return self.nodes[name].core is not None and name not in self.isolated

    def publish(self) -> None:
        """Send the recorded state to every replica it can reach."""
        for name in self.NAMES:
            if self.reachable(name):
                try:
                    self.apply(name, self.nodes[name].core.assign(self.state(), self.now))
                except StaleEpoch:
                    pass

    def elect(self, *, exclude: set[str] = frozenset()) -> bool:
        """Clean election: a reachable ISR member leads at a new epoch."""
        candidates = [n for n in self.isr if self.reachable(n) and n not in exclude]
        if not candidates:
            return False
        self.epoch += 1
        self.controller_epochs.append(self.epoch)
        self.leader = candidates[0]
        self.publish()
        return True

    def detect_failures(self) -> None:
        """Session expiry: unreachable replicas leave the ISR; an unreachable leader is replaced."""
        gone = {n for n in self.NAMES if not self.reachable(n)}
        if self.leader in gone:
            if not self.elect(exclude=gone):
                return  # the whole ISR is gone: unavailable, and says so
        kept = tuple(n for n in self.isr if n not in gone)
        if kept and kept != self.isr:
            self.isr = kept
            self.publish()

    def alter_isr(self, request: m.AlterIsr) -> m.AlterIsrReply:
        if request.leader_epoch != self.epoch:
            raise StaleEpoch("not the current leader epoch", epoch=self.epoch, got=request.leader_epoch)
        check_isr_floor(self.isr, tuple(request.isr), self.min_insync)
        self.isr = tuple(request.isr)
        return m.AlterIsrReply(request.topic, request.partition, self.epoch, list(self.isr))

    # -- effects ---------------------------------------------------------------------------------

    def apply(self, name: str, effects: list) -> None:
        self.hear_hw()
        for effect in effects:
            if isinstance(effect, Acknowledge):
                batch_id, base, end = effect.token
                copies = sum(node.log.holds(base, batch_id, durable_only=True)
                             or (base, batch_id) in self.lost_copies[node.name] for node in self.nodes.values())
                check_acknowledged_on_m(copies, self.min_insync, effect.token)
                self.acknowledged[batch_id] = (base, end)
            elif isinstance(effect, ProposeIsr):
                core = self.nodes[name].core
                if name in self.isolated:
                    continue  # lost; the leader proposes again later
                try:
                    reply = self.alter_isr(effect.request)
                except StaleEpoch as exc:
                    self.apply(name, core.on_isr_refused(exc, self.now))
                else:
                    self.apply(name, core.on_isr_recorded(reply, self.now))
            else:
                assert isinstance(effect, Refuse)
                self.refused.add(effect.token[0])

    # -- replica actions -------------------------------------------------------------------------

    def start(self, name: str) -> None:
        node = self.nodes[name]
        node.core = self.replica_class("t", 0, name, node.log, self.state(), self.now, replica_lag_ms=self.lag)

    def produce(self, name: str, count: int) -> None:
        core = self.nodes[name].core
        if core is None or core.check_produce() is not None:
            return
        batch_id = self.next_batch
        self.next_batch += 1
        base, end = self.nodes[name].log.append(count, batch_id)
        self.apply(name, core.hold((batch_id, base, end), end, self.now))

    def sync(self, name: str) -> None:
        node = self.nodes[name]
        if node.core is None:
            return
        node.log.sync()
        self.apply(name, node.core.on_local_end(node.log.durable_end, self.now))

    def fetch(self, name: str) -> None:
        node = self.nodes[name]
        if node.core is None:
            return
        request = node.core.next_fetch(self.now)
        if request is None:
            return
        leader_name, msg = request
        leader = self.nodes[leader_name]
        if leader.core is None or name in self.isolated or leader_name in self.isolated:
            node.core.on_fetch_failed(None, self.now)
            return
        try:
            reply, data, effects = leader.core.on_replica_fetch(msg, self.now)
        except ZBrokerError as exc:
            self.apply(leader_name, getattr(exc, "effects", []))
            node.core.on_fetch_failed(exc, self.now)
            return
        self.apply(leader_name, effects)
        node.core.on_fetch_reply(reply, data, self.now)
        node.log.sync()  # --fsync always: synced before the next fetch reports it

    def tick(self, ms: int) -> None:
        self.now += ms
        for name, node in self.nodes.items():
            if node.core is not None:
                self.apply(name, node.core.tick(self.now))

    def crash(self, name: str, *, lose_disk: bool) -> None:
        node = self.nodes[name]
        node.core = None
        if lose_disk:
            self.lost_copies[name] |= {(base, batch_id) for base, _count, batch_id in node.log.batches[:node.log.durable]}
            node.log = MemoryLog()
        else:
            node.log.lose_unsynced_tail()

    def restart(self, name: str, *, lost_disk: bool) -> None:
        node = self.nodes[name]
        if node.core is not None:
            return
        if lost_disk and name in self.isr:
            # It registers with an empty storage: the controller no longer counts it in sync,
            # and never elects it while it is empty. A whole ISR gone leaves the partition
            # without a leader (unclean election is off).
            self.isr = tuple(n for n in self.isr if n != name)
            if self.leader == name:
                self.leader = None
                self.epoch += 1
                self.controller_epochs.append(self.epoch)
            if not self.isr:
                self.leader = None
        self.start(name)
        if self.leader == name or (self.leader is None and self.isr):
            # A restarted leader is elected again at a new epoch (the core refuses the old one).
            self.elect()
        self.publish()

    # -- invariants ------------------------------------------------------------------------------

    def check(self) -> None:
        live = {n: (node.log, node.core.high_watermark) for n, node in self.nodes.items() if node.core is not None}
        check_agreement(live)
        for n, node in self.nodes.items():
            if node.core is not None:
                check_epochs_never_go_back(self.epochs_seen, n, node.core.leader_epoch)
        for a, b in zip(self.controller_epochs, self.controller_epochs[1:]):
            if b < a:
                raise InvariantViolated("the controller's leader epoch went back")
        # An acknowledged batch below a replica's high watermark is in that replica's log.
        for batch_id, (base, end) in self.acknowledged.items():
            for n, node in self.nodes.items():
                if node.core is not None and node.core.high_watermark >= end and not node.log.holds(base, batch_id):
                    raise InvariantViolated(f"acknowledged batch {batch_id} missing below {n}'s high watermark")
