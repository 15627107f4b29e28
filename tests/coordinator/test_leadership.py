"""The coordinator election core (actors/group_coordinator/leadership.py) against a model cluster.

The model: one database with the lease row and a fenced store (the SQL of
storage/offsets/postgres.py in Python, judged by the database clock `t`), and
nodes whose monotonic clocks have their own offset and a rate within the
safety margin. Hypothesis interleaves ticks, database executions of lease
requests, delivery and loss of answers, writes, SIGSTOP-like pauses (the
node's clock runs on while it does nothing), kills and restarts. Three
checkers read the recorded history; each is shown catching a crafted bad one.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from zbroker.actors.group_coordinator.leadership import (
    BecomeLeader, LeaderKnown, Leadership, LeadershipConfig, RenewLease, StepDown,
)
from zbroker.protocol.errors import ZBrokerError
from zbroker.storage.offsets.metadata import LeaseState

CONFIG = LeadershipConfig(lease_ms=5000, renew_interval_ms=1000, safety_margin_ms=500, request_timeout_ms=2000)


# -- checkers over a recorded history ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Acting:
    """At database time t, `node` believed it leads at `epoch`; the lease row then said the rest."""
    t: float
    node: str
    epoch: int
    db_holder: str | None
    db_epoch: int
    db_expires: float


def single_leader_violations(samples: list[Acting]) -> list[str]:
    """At most one node acts at any database time, and the one that does holds the lease then."""
    out = []
    by_time: dict[float, set[str]] = {}
    for s in samples:
        by_time.setdefault(s.t, set()).add(s.node)
        if not (s.db_holder == s.node and s.db_epoch == s.epoch and s.t < s.db_expires):
            out.append(f"t={s.t}: {s.node} acts at epoch {s.epoch} but the lease row says "
                       f"{s.db_holder} at {s.db_epoch} until {s.db_expires}")
    out += [f"t={t}: {sorted(nodes)} act at once" for t, nodes in by_time.items() if len(nodes) > 1]
    return out


def stale_write_violations(events: list[tuple]) -> list[str]:
    """No write accepted with an epoch older than the newest one taken by then.

    events, in database-time order: ("take", t, epoch) and ("accepted", t, epoch, node).
    """
    out, current = [], 0
    for ev in events:
        if ev[0] == "take":
            current = max(current, ev[2])
        elif ev[0] == "accepted" and ev[2] < current:
            out.append(f"t={ev[1]}: a write of epoch {ev[2]} by {ev[3]} accepted after epoch {current} was taken")
    return out


def epoch_regressions(sequences: dict[str, list[int]]) -> list[str]:
    """No sequence (the database's takes, each node's terms and highest epoch seen) goes back.

    A node may lead twice at one epoch: it stood down when its local deadline came,
    then renewed a lease nobody else had taken. Only the database's takes must strictly
    grow, so that no epoch is ever granted twice (keys ending in "!").
    """
    return [f"{name}: {seq}" for name, seq in sequences.items()
            if any(b < a or (b == a and name.endswith("!")) for a, b in zip(seq, seq[1:]))]


def test_the_single_leader_check_catches_two_leaders_and_a_leader_without_the_lease():
    fine = [Acting(5, "a", 1, "a", 1, 10), Acting(6, "b", 2, "b", 2, 11)]
    assert single_leader_violations(fine) == []
    two = [Acting(5, "a", 1, "a", 1, 10), Acting(5, "b", 2, "b", 2, 11)]
    assert single_leader_violations(two) == ["t=5: ['a', 'b'] act at once"]
    expired = [Acting(10, "a", 1, "a", 1, 10)]
    assert len(single_leader_violations(expired)) == 1
    deposed = [Acting(7, "a", 1, "b", 2, 12)]
    assert len(single_leader_violations(deposed)) == 1


def test_the_stale_write_check_catches_an_old_epoch_accepted_after_a_takeover():
    assert stale_write_violations([("take", 0, 1), ("accepted", 1, 1, "a"), ("take", 6, 2),
                                   ("accepted", 7, 2, "b")]) == []
    bad = [("take", 0, 1), ("take", 6, 2), ("accepted", 7, 1, "a")]
    assert stale_write_violations(bad) == ["t=7: a write of epoch 1 by a accepted after epoch 2 was taken"]


def test_the_epoch_check_catches_an_epoch_that_goes_back_or_repeats():
    assert epoch_regressions({"db!": [1, 2, 5], "a": [1, 5, 5]}) == []
    assert epoch_regressions({"db!": [1, 3, 2]}) == ["db!: [1, 3, 2]"]
    assert epoch_regressions({"db!": [1, 2, 2]}) == ["db!: [1, 2, 2]"]  # one epoch granted twice
    assert epoch_regressions({"a#0 terms": [2, 1]}) == ["a#0 terms: [2, 1]"]


# -- the model cluster --------------------------------------------------------------------------

@dataclasses.dataclass
class Node:
    name: str
    offset: float
    rate: float
    core: Leadership
    incarnation: int = 0
    alive: bool = True
    paused_until: float = -1.0
    terms: list[int] = dataclasses.field(default_factory=list)
    seen: list[int] = dataclasses.field(default_factory=list)

    def local(self, t: float) -> float:
        return self.offset + self.rate * t


class Cluster:
    def __init__(self, rates: list[float], offsets: list[float], core=Leadership, fenced: bool = True) -> None:
        self.t = 0.0
        self.core = core
        self.fenced = fenced
        self.nodes = [Node(f"n{i}", off, rate, core(f"n{i}", f"tcp://n{i}:1", CONFIG))
                      for i, (rate, off) in enumerate(zip(rates, offsets))]
        self.lease: dict | None = None  # holder, endpoint, epoch, expires (database time)
        self.requests: list[tuple] = []  # (node index, incarnation, RenewLease) sent, not yet run
        self.answers: list[tuple] = []  # (node index, incarnation, request id, LeaseState)
        self.writes: list[tuple] = []  # (node name, epoch) on their way to the store
        self.events: list[tuple] = []  # ("take", t, epoch) / ("accepted", t, epoch, node)
        self.acting: list[Acting] = []

    # the database: storage/offsets/postgres.py's _LEASE and _FENCED_UPSERT, in Python
    def db_lease(self, req: RenewLease) -> LeaseState:
        now, lease = self.t, self.lease
        if lease is None or lease["expires"] <= now:
            epoch = 1 if lease is None else lease["epoch"] + 1
            self.lease = {"holder": req.node_id, "endpoint": req.endpoint, "epoch": epoch,
                          "expires": now + req.lease_ms}
            self.events.append(("take", now, epoch))
        elif lease["holder"] == req.node_id:
            lease["expires"] = now + req.lease_ms
        else:
            return LeaseState(lease["holder"], lease["endpoint"], lease["epoch"], False,
                              max(0, math.ceil(lease["expires"] - now)))
        lease = self.lease
        return LeaseState(lease["holder"], lease["endpoint"], lease["epoch"], True,
                          max(0, math.ceil(lease["expires"] - now)))

    def db_write(self, node: str, epoch: int) -> None:
        if not self.fenced or (self.lease is not None and self.lease["epoch"] == epoch):
            self.events.append(("accepted", self.t, epoch, node))

    # the nodes
    def runnable(self, i: int) -> Node | None:
        node = self.nodes[i % len(self.nodes)]
        return node if node.alive and self.t >= node.paused_until else None

    def apply(self, i: int, effects: list) -> None:
        node = self.nodes[i]
        for e in effects:
            if isinstance(e, RenewLease):
                self.requests.append((i, node.incarnation, e))
            elif isinstance(e, BecomeLeader):
                node.terms.append(e.epoch)
            elif isinstance(e, (StepDown, LeaderKnown)):
                pass
        node.seen.append(node.core.highest_epoch_seen)

    def step(self, op: tuple) -> None:
        kind = op[0]
        if kind == "advance":
            self.t += op[1]
        elif kind == "tick":
            node = self.runnable(op[1])
            if node:
                self.apply(self.nodes.index(node), node.core.on_tick(node.local(self.t)))
        elif kind == "renew":  # a tick whose ask the database runs and answers at once
            before = len(self.requests)
            self.step(("tick", op[1]))
            if len(self.requests) > before:
                self.step(("exec", len(self.requests) - 1))
                self.step(("deliver", len(self.answers) - 1))
        elif kind == "exec" and self.requests:
            i, inc, req = self.requests.pop(op[1] % len(self.requests))
            self.answers.append((i, inc, req.request_id, self.db_lease(req)))
        elif kind == "deliver" and self.answers:
            k = op[1] % len(self.answers)
            i, inc, rid, lease = self.answers[k]
            node = self.nodes[i]
            if not node.alive or node.incarnation != inc:
                self.answers.pop(k)  # for a process that is gone
            elif self.t >= node.paused_until:
                self.answers.pop(k)
                self.apply(i, node.core.on_lease_answer(rid, lease, node.local(self.t)))
        elif kind == "lose":
            queue = self.requests if op[1] % 2 else self.answers
            if queue:
                queue.pop(op[1] % len(queue))
        elif kind == "fail":
            node = self.runnable(op[1])
            if node and node.core._inflight is not None:
                i = self.nodes.index(node)
                self.apply(i, node.core.on_lease_failed(node.core._inflight[0], node.local(self.t)))
        elif kind == "pause":
            node = self.runnable(op[1])
            if node:
                node.paused_until = self.t + op[2]
        elif kind == "kill":
            self.nodes[op[1] % len(self.nodes)].alive = False
        elif kind == "restart":
            node = self.nodes[op[1] % len(self.nodes)]
            if not node.alive:
                node.alive, node.incarnation = True, node.incarnation + 1
                node.core = self.core(node.name, f"tcp://{node.name}:1", CONFIG)
                node.terms, node.seen = [], []
        elif kind == "write":
            node = self.runnable(op[1])
            if node and node.core.acting(node.local(self.t)):
                self.writes.append((node.name, node.core.epoch))
        elif kind == "store" and self.writes:
            self.db_write(*self.writes.pop(op[1] % len(self.writes)))
        self.sample()

    def sample(self) -> None:
        lease = self.lease or {"holder": None, "epoch": 0, "expires": -math.inf}
        for node in self.nodes:
            # A paused node acts on nothing, but its belief is counted all the same: it must
            # already be false by the time the node could run again.
            if node.alive and node.core.acting(node.local(self.t)):
                self.acting.append(Acting(self.t, node.name, node.core.epoch, lease["holder"], lease["epoch"],
                                          lease["expires"]))

    def violations(self) -> list[str]:
        sequences = {"db takes!": [e[2] for e in self.events if e[0] == "take"]}
        for node in self.nodes:
            sequences[f"{node.name}#{node.incarnation} terms"] = node.terms
            sequences[f"{node.name}#{node.incarnation} seen"] = node.seen
        return (single_leader_violations(self.acting) + stale_write_violations(self.events)
                + epoch_regressions(sequences))


NODE = st.integers(0, 2)
# The steps of a renewal (time passing, a tick, the database running it, the answer coming
# back) are listed twice, so that leaders are elected and renew often between the faults.
_ROUND = [
    st.tuples(st.just("advance"), st.integers(0, 1200)),
    st.tuples(st.just("renew"), NODE),
    st.tuples(st.just("tick"), NODE),
    st.tuples(st.just("exec"), st.integers(0, 5)),
    st.tuples(st.just("deliver"), st.integers(0, 5)),
]
OPS = st.one_of(
    *_ROUND, *_ROUND,
    st.tuples(st.just("advance"), st.integers(0, 8000)),
    st.tuples(st.just("lose"), st.integers(0, 5)),
    st.tuples(st.just("fail"), NODE),
    st.tuples(st.just("pause"), NODE, st.integers(0, 12_000)),
    st.tuples(st.just("kill"), NODE),
    st.tuples(st.just("restart"), NODE),
    st.tuples(st.just("write"), NODE),
    st.tuples(st.just("store"), st.integers(0, 5)),
)
# The margin (500 of 5000 ms) covers a local clock up to 10 % slower than the database's.
RATES = st.lists(st.floats(0.92, 1.08), min_size=3, max_size=3)
OFFSETS = st.lists(st.floats(-1e6, 1e6), min_size=3, max_size=3)


# `make test` runs 200; `make test-fast` fewer (ZBROKER_MODEL_EXAMPLES, as test_model.py does).
@settings(max_examples=int(os.environ.get("ZBROKER_MODEL_EXAMPLES", "200")), deadline=None)
@given(RATES, OFFSETS, st.lists(OPS, min_size=40, max_size=250))
def test_random_interleavings_keep_one_leader_no_stale_write_and_forward_epochs(rates, offsets, ops):
    cluster = Cluster(rates, offsets)
    for op in ops:
        cluster.step(op)
    assert cluster.violations() == []
    event(f"takeovers: {min(sum(1 for e in cluster.events if e[0] == 'take'), 3)}")


def test_a_leader_that_can_renew_keeps_leading_and_a_standby_takes_over_after_a_pause():
    cluster = Cluster([1.0, 1.0], [0.0, 100_000.0])
    a, b = cluster.nodes
    for op in [("tick", 0), ("exec", 0), ("deliver", 0)]:
        cluster.step(op)
    assert a.core.acting(a.local(cluster.t)) and a.terms == [1]
    for _ in range(20):  # renews every second, the database answers at once
        for op in [("advance", 1000), ("tick", 0), ("exec", 0), ("deliver", 0), ("tick", 1), ("exec", 0),
                   ("deliver", 0), ("write", 0), ("store", 0)]:
            cluster.step(op)
        assert a.core.acting(a.local(cluster.t)) and not b.core.acting(b.local(cluster.t))
    cluster.step(("pause", 0, 20_000))  # SIGSTOP
    for _ in range(7):
        for op in [("advance", 1000), ("tick", 1), ("exec", 0), ("deliver", 0)]:
            cluster.step(op)
    assert b.core.acting(b.local(cluster.t)) and b.terms == [2]
    assert cluster.lease["holder"] == "n1"
    cluster.step(("advance", 20_000))  # SIGCONT: a's belief is already over
    assert not a.core.acting(a.local(cluster.t))
    cluster.step(("write", 0))
    assert cluster.writes == []
    assert cluster.violations() == []


def test_a_deposed_leaders_write_in_flight_is_refused_by_the_fenced_store():
    cluster = Cluster([1.0, 1.0], [0.0, 0.0])
    for op in [("tick", 0), ("exec", 0), ("deliver", 0), ("write", 0),  # a leads; its write is slow
               ("advance", 6000), ("tick", 1), ("exec", 0), ("deliver", 0),  # b takes over at epoch 2
               ("store", 0)]:
        cluster.step(op)
    assert [e for e in cluster.events if e[0] == "accepted"] == []
    unfenced = Cluster([1.0, 1.0], [0.0, 0.0], fenced=False)  # the same history on a store without the fence
    for op in [("tick", 0), ("exec", 0), ("deliver", 0), ("write", 0), ("advance", 6000), ("tick", 1),
               ("exec", 0), ("deliver", 0), ("store", 0)]:
        unfenced.step(op)
    assert unfenced.violations() == ["t=6000.0: a write of epoch 1 by n0 accepted after epoch 2 was taken"]


class CountsFromArrival(Leadership):
    """A broken core: its deadline runs from when the answer ARRIVED, not from when it was asked."""

    def on_lease_answer(self, request_id, lease, now_ms):
        if self._inflight is not None and self._inflight[0] == request_id:
            self._inflight = (request_id, now_ms)
        return super().on_lease_answer(request_id, lease, now_ms)


def test_a_core_counting_from_the_answers_arrival_is_caught_acting_beside_its_successor():
    history = [("tick", 0), ("exec", 0), ("advance", 4000), ("deliver", 0),  # a slow answer: 4 s
               ("advance", 1001), ("tick", 1), ("exec", 0), ("deliver", 0)]  # b takes the expired lease
    broken = Cluster([1.0, 1.0], [0.0, 0.0], core=CountsFromArrival)
    for op in history:
        broken.step(op)
    assert any("act at once" in v for v in broken.violations())
    right = Cluster([1.0, 1.0], [0.0, 0.0])
    for op in history:
        right.step(op)
    assert right.violations() == []
    assert right.nodes[0].terms == [1] and right.nodes[1].terms == [2]


def test_an_answer_that_comes_after_its_lease_could_have_ended_is_not_acted_upon():
    core = Leadership("a", "tcp://a:1", CONFIG)
    (ask,) = core.on_tick(0)
    effects = core.on_lease_answer(ask.request_id, LeaseState("a", "tcp://a:1", 1, True, 5000), now_ms=4600)
    assert effects == [LeaderKnown("a", "tcp://a:1", 1)] and not core.acting(4600)


def test_a_store_that_went_back_in_time_is_not_followed_to_an_older_epoch():
    core = Leadership("a", "tcp://a:1", CONFIG)
    (ask,) = core.on_tick(0)
    assert BecomeLeader(7) in core.on_lease_answer(ask.request_id, LeaseState("a", "e", 7, True, 5000), 1)
    core.on_tick(1000)
    (ask,) = [e for e in core.on_tick(2100) if isinstance(e, RenewLease)] or [None]
    assert ask is None  # one ask in flight at a time
    (ask,) = [e for e in core.on_tick(3100) if isinstance(e, RenewLease)]  # the first timed out
    effects = core.on_lease_answer(ask.request_id, LeaseState("a", "e", 3, True, 5000), 3200)
    assert [type(e) for e in effects] == [StepDown] and core.highest_epoch_seen == 7
    assert not core.acting(3200)
    assert [e for e in core.on_tick(4200) if isinstance(e, RenewLease)] == []  # lets that lease run out


def test_settings_that_leave_no_time_to_renew_are_refused():
    with pytest.raises(ZBrokerError):
        LeadershipConfig(lease_ms=1000, renew_interval_ms=1000, safety_margin_ms=100)


def test_next_deadline_names_the_next_ask_the_timeout_and_the_step_down():
    core = Leadership("a", "tcp://a:1", CONFIG)
    assert core.next_deadline() == -math.inf  # ask at once
    (ask,) = core.on_tick(100)
    assert core.next_deadline() == 100 + CONFIG.request_timeout_ms
    core.on_lease_answer(ask.request_id, LeaseState("a", "e", 1, True, 5000), 150)
    assert core.next_deadline() == 100 + CONFIG.renew_interval_ms
    assert core.deadline_ms == 100 + 5000 - 500
    assert [type(e) for e in core.on_tick(4600)] == [StepDown, RenewLease]  # nothing renewed it
