"""The replica core under random interleavings of appends, follower fetches, crashes (the
unsynced tail, or the whole disk), network partitions and leader changes, with the
invariants checked after every step; and each invariant check shown to catch a bad history."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zbroker.actors.partition_log.replica import FETCH_WAIT_MS, Acknowledge, Replica, ReplicaState
from zbroker.protocol import messages as m
from zbroker.protocol.errors import NotEnoughReplicas, NotLeader, StaleEpoch
from tests.replication.model import (Cluster, InvariantViolated, MemoryLog, check_acknowledged_on_m,
                                     check_agreement, check_epochs_never_go_back, check_isr_floor)

NAMES = Cluster.NAMES
name = st.sampled_from(NAMES)
# Steps that make progress come often, failures less so, so that histories both acknowledge
# records and break things in between (one_of picks its branches with equal chances).
progress = [st.tuples(st.just("produce"), name, st.integers(1, 3)), st.tuples(st.just("round"),),
            st.tuples(st.just("produce"), st.none(), st.integers(1, 3)),  # to the controller's leader
            st.tuples(st.just("sync"), name), st.tuples(st.just("fetch"), name)]
failures = [st.tuples(st.just("tick"), st.integers(0, 12_000)), st.tuples(st.just("crash"), name, st.booleans()),
            st.tuples(st.just("restart"), name), st.tuples(st.just("isolate"), name), st.tuples(st.just("heal"),),
            st.tuples(st.just("detect"),), st.tuples(st.just("elect"),)]
action = st.one_of(*progress, *progress, *progress, *failures)


def run(cluster: Cluster, steps: list) -> None:
    lost_disk: dict[str, bool] = {}
    for step in steps:
        kind = step[0]
        if kind == "produce":
            target = step[1] if step[1] is not None else cluster.leader
            if target is not None:
                cluster.produce(target, step[2])
        elif kind == "sync":
            cluster.sync(step[1])
        elif kind == "fetch":
            cluster.fetch(step[1])
        elif kind == "round":
            # What a healthy moment does: every replica syncs, every follower fetches twice.
            for node_name in NAMES:
                cluster.sync(node_name)
            for node_name in NAMES * 2:
                cluster.fetch(node_name)
        elif kind == "tick":
            cluster.tick(step[1])
        elif kind == "crash":
            if cluster.nodes[step[1]].core is not None:
                cluster.crash(step[1], lose_disk=step[2])
                lost_disk[step[1]] = step[2]
        elif kind == "restart":
            cluster.restart(step[1], lost_disk=lost_disk.pop(step[1], False))
        elif kind == "isolate":
            cluster.isolated.add(step[1])
        elif kind == "heal":
            cluster.isolated.clear()
            cluster.publish()
        elif kind == "detect":
            cluster.detect_failures()
        elif kind == "elect":
            cluster.elect(exclude={cluster.leader} if cluster.leader else set())
        cluster.check()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(min_insync=st.integers(1, 3), steps=st.lists(action, min_size=30, max_size=80))
def test_random_histories_keep_every_invariant(min_insync, steps):
    run(Cluster(min_insync), steps)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.one_of(
    st.tuples(st.just("produce"), st.just("a"), st.integers(1, 3)),
    st.tuples(st.just("sync"), st.just("a")),
    st.tuples(st.just("fetch"), st.sampled_from(("b", "c"))),
    st.tuples(st.just("tick"), st.integers(0, 3000))), max_size=60))
def test_a_healthy_cluster_acknowledges_what_it_replicated(steps):
    """No failures: produce, sync and fetches alone acknowledge, and only what is on two replicas."""
    cluster = Cluster(2)
    # A fetch carries at most two of the model's batches: enough rounds to carry every one.
    run(cluster, steps + [("sync", "a")] + [("fetch", "b"), ("fetch", "c")] * (len(steps) + 2))
    produced = cluster.next_batch
    if produced and len(cluster.nodes["a"].core.isr) >= 2:
        # Every batch is acknowledged, or was failed when the ISR fell below min_insync.
        assert set(cluster.acknowledged) | cluster.refused == set(range(produced))
        assert not set(cluster.acknowledged) & cluster.refused


# -- scripted paths ------------------------------------------------------------------------

def settle(cluster, *followers):
    for _ in range(3):
        cluster.sync("a")
        for f in followers:
            cluster.fetch(f)


def test_acks_wait_for_the_isr_and_nothing_is_appended_below_min_insync():
    cluster = Cluster(2, replica_lag_ms=1000)
    cluster.produce("a", 2)
    cluster.sync("a")
    assert cluster.acknowledged == {}  # on one replica only
    settle(cluster, "b", "c")
    assert cluster.acknowledged == {0: (0, 2)}
    # b and c stop fetching: after their last fetch's wait at the log end and the lag, c
    # leaves the ISR, b stays in it to keep it at min_insync (the ISR floor: an election must
    # find the acknowledged batch on an ISR member), and produce is refused.
    cluster.tick(FETCH_WAIT_MS + 1000 + 1)
    leader = cluster.nodes["a"].core
    assert leader.isr == ("a", "b") == cluster.isr
    assert isinstance(leader.check_produce(), NotEnoughReplicas) and leader.keeping_up == 1
    end = cluster.nodes["a"].log.log_end
    cluster.produce("a", 1)
    assert cluster.nodes["a"].log.log_end == end
    # b catches up and rejoins; produce goes on.
    cluster.fetch("b")
    assert set(cluster.isr) == {"a", "b"} and leader.check_produce() is None


def test_a_follower_truncates_a_divergent_tail_by_epoch_not_by_high_watermark():
    cluster = Cluster(2)
    settle(cluster, "b", "c")
    cluster.produce("a", 1)
    settle(cluster, "b", "c")   # batch 0 acknowledged everywhere
    cluster.produce("a", 2)     # batch 1, unreplicated
    cluster.sync("a")
    cluster.isolated.add("a")
    cluster.detect_failures()   # b leads epoch 1
    assert cluster.leader == "b" and cluster.epoch == 1
    cluster.produce("b", 3)
    cluster.fetch("c")
    cluster.sync("b")
    cluster.fetch("c")
    assert 2 in cluster.acknowledged
    zombie = cluster.nodes["a"].core
    assert zombie.is_leader and zombie.held_count() == 1  # it still believes, but acknowledges nothing
    cluster.isolated.clear()
    cluster.publish()
    assert cluster.nodes["a"].log.batches[1][2] == 1
    cluster.fetch("a")          # diverging: cut back to where epoch 0 ends on b
    assert cluster.nodes["a"].log.log_end == 1
    cluster.fetch("a")
    assert [b[2] for b in cluster.nodes["a"].log.batches] == [0, 2]
    cluster.check()


def test_a_deposed_leader_fails_its_held_produces_with_not_leader():
    cluster = Cluster(2)
    settle(cluster, "b", "c")
    cluster.produce("a", 1)
    old = cluster.nodes["a"].core
    refused = old.depose(1)
    assert [type(r.error) for r in refused] == [NotLeader] and old.held_count() == 0
    assert isinstance(old.check_produce(), NotLeader)
    assert old.on_local_end(10, 0) == [] and old.hold("x", 0, 0) == []


def test_epochs_are_fenced_both_ways():
    cluster = Cluster(2)
    settle(cluster, "b", "c")
    leader = cluster.nodes["a"].core
    stale = m.ReplicaFetch("t", 0, "b", 0, 0, -1)
    cluster.elect(exclude={"a"})
    with pytest.raises(StaleEpoch):
        cluster.nodes["b"].core.on_replica_fetch(stale, 0)
    with pytest.raises(StaleEpoch):
        cluster.nodes["b"].core.assign(ReplicaState(0, "a", "a", NAMES, NAMES, 2, {}), 0)
    # The old leader, cut off before it heard of epoch 1, is deposed by a fetch of epoch 1.
    old = Replica("t", 0, "z", MemoryLog(), ReplicaState(0, "z", "z", ("z", "b"), ("z", "b"), 2, {}), 0)
    with pytest.raises(NotLeader):
        old.on_replica_fetch(m.ReplicaFetch("t", 0, "b", 1, 0, -1), 0)
    assert old.deposed and not old.is_leader
    del leader


def test_a_restarted_leader_refuses_its_old_epoch_until_elected_again():
    log = MemoryLog()
    state = ReplicaState(3, "a", "a", NAMES, NAMES, 2, {})
    first = Replica("t", 0, "a", log, state, 0)
    assert first.is_leader
    again = Replica("t", 0, "a", log, state, 0)
    assert not again.is_leader and isinstance(again.check_produce(), NotLeader)
    again.assign(ReplicaState(4, "a", "a", NAMES, NAMES, 2, {}), 0)
    assert again.is_leader


def test_a_new_leader_reads_from_the_high_watermark_its_predecessor_published():
    """A follower's HW trails the leader's (it learns it with its next answer): elected, it
    starts from the last HW the controller heard published, capped at its own log end."""
    cluster = Cluster(2)
    settle(cluster, "b", "c")
    cluster.produce("a", 2)
    cluster.sync("a")
    for follower in ("b", "c", "b", "c"):   # each gets the batch, then reports it
        cluster.fetch(follower)              # c's report moves the HW: b has not heard of it
    assert 0 in cluster.acknowledged and cluster.published_hw == 2
    assert cluster.nodes["b"].core.high_watermark == 0
    cluster.elect(exclude={"a"})
    new = cluster.nodes["b"].core
    assert new.is_leader and not new.hw_established and new.high_watermark == 2
    cluster.check()
    # Capped at its own log end: a HW published above what it holds is not taken past it.
    lone = Replica("t", 0, "z", MemoryLog(), ReplicaState(5, "z", "z", ("z",), ("z",), 1, {}, 7), 0)
    assert lone.high_watermark == 0


def test_the_producer_window_travels_with_the_batches():
    """Followers store the leader's batches byte for byte, so a new leader's dedupe state is the
    old one's (tests/log/test_replication.py checks the real log; here the model's fetch path
    is shown to hand over exactly the stored batches)."""
    cluster = Cluster(2)
    for count in (1, 2, 3):
        cluster.produce("a", count)
    settle(cluster, "b", "c")
    assert cluster.nodes["b"].log.batches == cluster.nodes["a"].log.batches == cluster.nodes["c"].log.batches


# -- each invariant check catches a crafted bad history ---------------------------------------

def test_the_acknowledgement_check_catches_a_batch_on_too_few_replicas():
    check_acknowledged_on_m(2, 2, "ok")
    with pytest.raises(InvariantViolated):
        check_acknowledged_on_m(1, 2, "batch 7")


def test_the_agreement_check_catches_two_replicas_that_differ_below_their_high_watermarks():
    a, b = MemoryLog(), MemoryLog()
    a.append(2, batch_id=1)
    b.append(2, batch_id=1)
    a.append(1, batch_id=2)
    b.append(1, batch_id=3)
    check_agreement({"a": (a, 3), "b": (b, 2)})   # they differ at offset 2 only, not below 2
    with pytest.raises(InvariantViolated):
        check_agreement({"a": (a, 3), "b": (b, 3)})


def test_the_epoch_check_catches_an_epoch_going_back():
    seen = {}
    check_epochs_never_go_back(seen, "a", 1)
    check_epochs_never_go_back(seen, "a", 1)
    with pytest.raises(InvariantViolated):
        check_epochs_never_go_back(seen, "a", 0)


def test_the_isr_floor_check_catches_a_shrink_below_min_insync():
    check_isr_floor(("a", "b", "c"), ("a", "b"), 2)
    check_isr_floor(("a",), ("a",), 2)  # already below (the controller removed a dead member)
    with pytest.raises(InvariantViolated):
        check_isr_floor(("a", "b", "c"), ("a",), 2)


class _ShrinksToWhoKeepsUp(Replica):
    """A broken leader (zbroker before the ISR floor): every laggard is proposed out."""

    def _shrunk_isr(self):
        return tuple(r for r in self.state.isr if r not in self._lagging)


class _AcksAtItsOwnEnd(Replica):
    """A broken leader: its high watermark ignores the followers."""

    def _advance(self, effects):
        if self.is_leader:
            while self._held and self._held[0][0] <= self._local_end:
                effects.append(Acknowledge(self._held.pop(0)[2]))
        return effects


class _TakesThePublishedHwUncapped(Replica):
    """A broken new leader: it takes the published HW past its own log end."""

    def _start(self, now_ms):
        super()._start(now_ms)
        if self.state.leader == self.actor_id and self.state.high_watermark is not None:
            self.high_watermark = max(self.high_watermark, self.state.high_watermark)


class _TruncatesByHighWatermark(Replica):
    """A broken follower: it never cuts the tail the leader says diverges."""

    def _truncate(self, reply):
        pass


def test_the_model_catches_a_leader_that_acknowledges_before_replicating():
    cluster = Cluster(2, replica_class=_AcksAtItsOwnEnd)
    cluster.produce("a", 1)
    with pytest.raises(InvariantViolated, match="durable copies"):
        cluster.sync("a")


def test_the_model_catches_a_leader_that_shrinks_the_isr_below_min_insync():
    cluster = Cluster(2, replica_lag_ms=1000, replica_class=_ShrinksToWhoKeepsUp)
    settle(cluster, "b", "c")
    with pytest.raises(InvariantViolated, match="below min_insync"):
        cluster.tick(FETCH_WAIT_MS + 1000 + 1)


def test_the_model_catches_a_follower_that_keeps_a_divergent_tail():
    cluster = Cluster(2, replica_class=_TruncatesByHighWatermark)
    with pytest.raises(InvariantViolated, match="disagree"):
        run(cluster, [("fetch", "b"), ("fetch", "c"), ("produce", "a", 1), ("sync", "a"), ("isolate", "a"),
                      ("detect",), ("produce", "b", 1), ("sync", "b"), ("fetch", "c"), ("fetch", "c"),
                      ("sync", "b"), ("fetch", "c"), ("heal",), ("fetch", "a"), ("fetch", "a"), ("fetch", "a"),
                      ("sync", "b"), ("fetch", "a"), ("fetch", "c")])


def test_the_model_catches_a_new_leader_that_takes_a_high_watermark_past_its_log():
    cluster = Cluster(1, replica_class=_TakesThePublishedHwUncapped)
    cluster.isr = ("a", "b")
    cluster.publish()
    settle(cluster, "b")
    cluster.produce("a", 2)
    cluster.sync("a")
    cluster.fetch("b")
    cluster.fetch("b")   # b holds batch 0 and acknowledged; the HW is published
    cluster.produce("a", 1)
    cluster.sync("a")    # ISR {a} after b leaves below: batch 1 on a alone
    cluster.isr = ("a",)
    cluster.publish()
    cluster.sync("a")
    assert cluster.published_hw == 3
    cluster.crash("a", lose_disk=True)
    cluster.isr = ("b",)   # an unclean-like move the model's controller allows here
    with pytest.raises(InvariantViolated, match="missing below b's high watermark"):
        cluster.elect()
        cluster.check()
