"""The controller of replicated partitions: placement, election, ISR changes, reassignment,
and durable-before-effective, as pure decisions on `TopicRegistry` (time passed in)."""

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from zbroker.actors.group_coordinator import controller as ctl
from zbroker.actors.group_coordinator.effects import Reply
from zbroker.actors.group_coordinator.topics import (AssignActor, PersistTopics, ReloadMetadata, TopicRegistry,
                                                     WriteMetadata)
from zbroker.protocol.errors import NotEnoughReplicas, ProtocolError, StaleEpoch, Unavailable

TIMEOUT = 5000


def registry(actors, *, unclean=False, racks=None):
    """`actors`: {actor_id: host}; each on its own storage."""
    reg = TopicRegistry(actor_timeout_ms=TIMEOUT, unclean_leader_election=unclean)
    for i, (a, host) in enumerate(actors.items()):
        reg.register(a, f"tcp://{host}:{7000 + i}", f"{host}:/data/{a}", 100 + i, [], 0,
                     rack=(racks or {}).get(a))
    return reg


def confirm(reg, effects, now=0):
    """Play the shell: confirm every metadata write, return what it released (and the rest)."""
    out = []
    for e in effects:
        if isinstance(e, WriteMetadata):
            out += confirm(reg, reg.on_metadata_written(e.write_id, True, now), now)
        else:
            out.append(e)
    return out


def state(reg, topic="t", p=0):
    return reg.partitions[(topic, p)].replication


def test_create_places_r_replicas_on_distinct_hosts_and_waits_for_the_write():
    reg = registry({"a": "10.0.0.1", "b": "10.0.0.1", "c": "10.0.0.2", "d": "10.0.0.3"})
    effects = reg.create_topic("t", 1, None, 0, replication_factor=3, token="tok")
    # Nothing goes out before the decision is durable: one write, no assign, no reply.
    assert [type(e) for e in effects] == [WriteMetadata]
    write = effects[0]
    assert write.create_topics[0][3:5] == [3, 2]  # replication_factor, min_insync default min(2, R)
    topic, p, replicas, leader, epoch, isr, expected = write.partitions[0]
    assert expected is None and epoch == 0 and leader == replicas[0] and isr == replicas
    assert len({reg.actors[a].endpoint.split(":")[1] for a in replicas}) == 3  # three hosts of three
    assert state(reg) is None and reg.metadata(["t"])[0]["partitions"][0]["endpoint"] is None
    assert reg.assignment_for(replicas[0]) == []
    released = reg.on_metadata_written(write.write_id, True, 1)
    assert {e.actor_id for e in released if isinstance(e, AssignActor)} == set(replicas)
    assert any(isinstance(e, Reply) and e.token == "tok" for e in released)
    meta = reg.metadata(["t"])[0]["partitions"][0]
    assert meta["actor_id"] == leader and meta["replicas"] == replicas and meta["isr"] == replicas
    assert meta["leader_epoch"] == 0 and meta["endpoint"] == reg.actors[leader].endpoint
    assert reg.replicas_for(replicas[1])[0][2]["leader"] == leader


def test_racks_are_spread_before_hosts():
    reg = registry({"a": "h1", "b": "h2", "c": "h3"}, racks={"a": "r1", "b": "r1", "c": "r2"})
    [write] = reg.create_topic("t", 1, None, 0, replication_factor=2)
    replicas = write.partitions[0][2]
    assert {reg.actors[a].rack for a in replicas} == {"r1", "r2"}


def test_two_replicas_never_share_a_storage_even_on_one_host():
    reg = TopicRegistry()
    reg.register("a", "tcp://h:1", "h:/d1", 1, [], 0)
    reg.register("a2", "tcp://h:2", "h:/d1", 2, [], 0)  # same data directory as a
    reg.register("b", "tcp://h:3", "h:/d2", 3, [], 0)
    with pytest.raises(NotEnoughReplicas) as info:
        reg.create_topic("t", 1, None, 0, replication_factor=3)
    assert info.value.data["qualifying"] == 2
    assert "t" not in reg.topics
    [write] = reg.create_topic("t", 4, None, 0, replication_factor=2)
    for row in write.partitions:
        assert len({reg.actors[a].storage_id for a in row[2]}) == 2


def test_leaders_spread_over_actors():
    reg = registry({"a": "h1", "b": "h2", "c": "h3"})
    [write] = reg.create_topic("t", 6, None, 0, replication_factor=3)
    leaders = [row[3] for row in write.partitions]
    assert sorted(leaders) == ["a", "a", "b", "b", "c", "c"]


def test_bad_replication_settings_are_refused():
    reg = registry({"a": "h1", "b": "h2"})
    with pytest.raises(ProtocolError):
        reg.create_topic("t", 1, None, 0, replication_factor=2, min_insync=3)
    with pytest.raises(ProtocolError):
        reg.create_topic("t", 1, None, 0, replication_factor=0)


def test_unreplicated_topics_keep_todays_path():
    reg = registry({"a": "h1", "b": "h2"})
    effects = reg.create_topic("t", 2, None, 0)
    assert PersistTopics() in effects and not any(isinstance(e, WriteMetadata) for e in effects)
    meta = reg.metadata(["t"])[0]["partitions"]
    assert [p["replicas"] == [p["actor_id"]] and p["leader_epoch"] == 0 for p in meta] == [True, True]


def created(actors=("a", "b", "c"), r=3, **kw):
    reg = registry({a: f"h{i}" for i, a in enumerate(actors)}, **kw)
    confirm(reg, reg.create_topic("t", 1, None, 0, replication_factor=r))
    return reg


def test_a_dead_leader_is_replaced_from_the_isr_with_a_new_epoch():
    reg = created()
    assert state(reg).leader == "a"
    for a in ("b", "c"):
        reg.register(a, reg.actors[a].endpoint, reg.actors[a].storage_id, reg.actors[a].pid, [], TIMEOUT)
    effects = reg.tick(TIMEOUT + 1)  # a silent past the timeout
    writes = [e for e in effects if isinstance(e, WriteMetadata)]
    assert len(writes) == 1 and not any(isinstance(e, AssignActor) for e in effects)
    assert writes[0].partitions[0][3:] == ["b", 1, ["b", "c"], 0]  # leader, epoch, isr, expected epoch
    assert state(reg).leader == "a"  # not effective yet
    released = reg.on_metadata_written(writes[0].write_id, True, TIMEOUT + 1)
    assert {e.actor_id for e in released} == {"a", "b", "c"}
    assert (state(reg).leader, state(reg).leader_epoch, state(reg).isr) == ("b", 1, ("b", "c"))


def test_a_follower_outside_the_isr_never_becomes_leader_and_the_partition_says_offline():
    reg = created()
    confirm(reg, reg.alter_isr("a", "t", 0, 0, ["a"], "tok"))
    assert state(reg).isr == ("a",)
    confirm(reg, reg.deregister("a", reg.actors["a"].pid, 10))
    rs = state(reg)
    assert rs.leader is None and rs.leader_epoch == 1 and rs.isr == ("a",)
    part = reg.metadata(["t"])[0]["partitions"][0]
    assert part["endpoint"] is None and part["actor_id"] is None
    [row] = reg.replication_status()
    assert row["offline"] and row["below_min_insync"]
    # The last ISR member returns: it leads again, at a new epoch.
    confirm(reg, reg.register("a", "tcp://h0:9", "h0:/data/a", 555, [], 20))
    assert (state(reg).leader, state(reg).leader_epoch) == ("a", 2)


def test_unclean_election_takes_a_live_replica_and_says_so():
    reg = created(unclean=True)
    confirm(reg, reg.alter_isr("a", "t", 0, 0, ["a"], "tok"))
    effects = confirm(reg, reg.deregister("a", reg.actors["a"].pid, 10))
    rs = state(reg)
    assert rs.leader == "b" and rs.isr == ("b",) and rs.leader_epoch == 1
    assert any(getattr(e, "event", "") == "controller.unclean_election" for e in effects)


def test_alter_isr_only_from_the_leader_at_its_epoch():
    reg = created()
    with pytest.raises(StaleEpoch) as info:
        reg.alter_isr("a", "t", 0, 7, ["a"], "tok")
    assert info.value.data["epoch"] == 0 and info.value.data["got"] == 7
    with pytest.raises(StaleEpoch):
        reg.alter_isr("b", "t", 0, 0, ["b"], "tok")
    with pytest.raises(ProtocolError):
        reg.alter_isr("a", "t", 0, 0, ["b", "c"], "tok")  # the leader may not drop itself
    with pytest.raises(ProtocolError):
        reg.alter_isr("a", "t", 0, 0, ["a", "zz"], "tok")
    effects = reg.alter_isr("a", "t", 0, 0, ["c", "a"], "tok")
    assert isinstance(effects[-1], WriteMetadata) and not any(isinstance(e, Reply) for e in effects)
    released = reg.on_metadata_written(effects[-1].write_id, True, 1)
    [reply] = [e for e in released if isinstance(e, Reply)]
    assert reply.msg.isr == ["a", "c"] and reply.msg.leader_epoch == 0  # kept in replica order
    assert reg.alter_isr("a", "t", 0, 0, ["a", "c"], "t2") == [Reply("t2", reply.msg.__class__(
        topic="t", partition=0, leader_epoch=0, isr=["a", "c"]))]  # no change: no write


def test_a_refused_write_takes_no_effect():
    reg = created()
    effects = reg.alter_isr("a", "t", 0, 0, ["a"], "tok")
    write = effects[-1]
    released = reg.on_metadata_written(write.write_id, False, 1)
    assert ReloadMetadata() in released and not any(isinstance(e, Reply) for e in released)
    assert state(reg).isr == ("a", "b", "c") and reg.partitions[("t", 0)].proposed is None


def test_decisions_chain_their_expected_epochs_while_writes_are_in_flight():
    reg = created(actors=("a", "b", "c", "d"))
    first = [e for e in reg.deregister("a", reg.actors["a"].pid, 5) if isinstance(e, WriteMetadata)][0]
    second = [e for e in reg.deregister("b", reg.actors["b"].pid, 6) if isinstance(e, WriteMetadata)][0]
    assert first.partitions[0][4] == 1 and first.partitions[0][6] == 0 and second.partitions[0][6] == 1 and second.partitions[0][4] == 2
    reg.on_metadata_written(first.write_id, True, 7)
    reg.on_metadata_written(second.write_id, True, 7)
    assert state(reg).leader == "c" and state(reg).leader_epoch == 2


def test_reassign_grows_waits_for_the_isr_then_shrinks():
    reg = created(actors=("a", "b", "c", "d", "e"))
    assert state(reg).replicas == ("a", "b", "c")
    released = confirm(reg, reg.reassign("t", 0, ["d", "e", "a"], "tok"))
    rs = state(reg)
    assert rs.replicas == ("d", "e", "a", "b", "c") and rs.target == ("d", "e", "a") and rs.leader == "a"
    assert {e.actor_id for e in released if isinstance(e, AssignActor)} == {"a", "b", "c", "d", "e"}
    [reply] = [e for e in released if isinstance(e, Reply)]
    assert not reply.msg.done
    # d catches up: still waiting for e.
    confirm(reg, reg.alter_isr("a", "t", 0, 0, ["a", "b", "c", "d"], "t1"))
    assert state(reg).target is not None
    released = confirm(reg, reg.alter_isr("a", "t", 0, 0, ["a", "b", "c", "d", "e"], "t2"))
    rs = state(reg)
    assert rs.replicas == ("d", "e", "a") and rs.isr == ("d", "e", "a") and rs.target is None
    assert rs.leader == "a" and rs.leader_epoch == 0
    assert {e.actor_id for e in released if isinstance(e, AssignActor)} >= {"b", "c"}
    assert reg.assignment_for("b") == []


def test_reassign_away_from_the_leader_hands_leadership_to_the_target():
    reg = created(actors=("a", "b", "c", "d"))
    confirm(reg, reg.reassign("t", 0, ["b", "c", "d"], "tok"))
    confirm(reg, reg.alter_isr("a", "t", 0, 0, ["a", "b", "c", "d"], "t1"))
    rs = state(reg)
    assert rs.replicas == ("b", "c", "d") and rs.leader == "b" and rs.leader_epoch == 1


def test_reassign_refuses_what_cannot_hold_replicas():
    reg = created(actors=("a", "b", "c"))
    for bad in (["a", "a"], ["a", "nobody"], []):
        with pytest.raises(ProtocolError):
            reg.reassign("t", 0, bad, "tok")
    with pytest.raises(NotEnoughReplicas):
        reg.reassign("t", 0, ["a"], "tok")  # fewer than min_insync 2


def test_replica_states_feed_describe():
    reg = created()
    reg.on_replica_states("a", [["t", 0, 0, 10, 8]])
    reg.on_replica_states("b", [["t", 0, 0, 8, 8]])
    reg.on_replica_states("zz", [["t", 0, 0, 99, 99]])  # not a replica: ignored
    part = reg.describe("t")[0]
    assert part["high_watermark"] == 8 and part["replica_log_ends"] == {"a": 10, "b": 8}
    assert part["leader"] == "a" and part["isr"] == ["a", "b", "c"]


def test_the_assignment_carries_the_last_high_watermark_a_leader_published():
    """A new leader serves reads from it (replica.py, "High watermark across leader changes")."""
    from zbroker.protocol import messages as m
    reg = created()
    assert reg.on_report("a", [["t", 0, 0, 40, 4000]], 0) == [("t", 0, 0, 40)]
    reg.on_report("b", [["t", 0, 0, 99, 9900]], 0)  # a follower's report: not the leader's HW
    entries = reg.replicas_for("b")
    assert entries[0][2]["high_watermark"] == 40
    m.check_replicas("assign", entries)
    for bad in (-1, "40", True):
        with pytest.raises(ProtocolError):
            m.check_replicas("assign", [["t", 0, {**entries[0][2], "high_watermark": bad}]])
    del entries[0][2]["high_watermark"]
    m.check_replicas("assign", entries)  # optional: an older coordinator sends none


def test_snapshot_round_trip_keeps_replica_state():
    reg = created()
    confirm(reg, reg.deregister("a", reg.actors["a"].pid, 5))
    again = TopicRegistry()
    again.restore(reg.snapshot())
    assert state(again) == ctl.ReplicaSet(("a", "b", "c"), "b", 1, ("b", "c"), 2)
    assert again.topics["t"]["replication_factor"] == 3


# -- random actor joins and deaths ---------------------------------------------------------

ACTORS = ["a", "b", "c", "d", "e"]
EVENT = st.one_of(
    st.tuples(st.just("die"), st.sampled_from(ACTORS)),
    st.tuples(st.just("confirm"), st.just(True)),
    st.tuples(st.just("confirm"), st.just(True)),
    st.tuples(st.just("join"), st.sampled_from(ACTORS)),
    st.tuples(st.just("shrink"), st.integers(0, 3)),
    st.tuples(st.just("grow"), st.integers(0, 3)),
    st.tuples(st.just("confirm"), st.booleans()),
    st.tuples(st.just("reassign"), st.permutations(ACTORS).map(lambda p: p[:3])),
)


@settings(max_examples=150, deadline=None)
@given(events=st.lists(EVENT, max_size=60), unclean=st.booleans())
@example(events=[("confirm", True), ("reassign", ["a", "b", "d"]), ("confirm", True),
                 ("reassign", ["a", "b", "c"]), ("grow", 2)], unclean=False)
def test_random_joins_and_deaths_keep_the_controller_invariants(events, unclean):
    reg = registry({a: f"h{i % 3}" for i, a in enumerate(ACTORS)}, unclean=unclean)
    pending = list(reg.create_topic("t", 2, None, 0, replication_factor=3))
    epochs = {0: 0, 1: 0}
    now = 1
    pids = {a: 100 + i for i, a in enumerate(ACTORS)}

    def writes(effects):
        pending.extend(e for e in effects if isinstance(e, WriteMetadata))

    for kind, arg in events:
        now += 1
        if kind == "die" and reg.actors[arg].alive:
            writes(reg.deregister(arg, pids[arg], now))
        elif kind == "join":  # back from the dead, or restarted as a new process
            pids[arg] += 1000
            info = reg.actors[arg]
            writes(reg.register(arg, info.endpoint, info.storage_id, pids[arg], [], now))
        elif kind in ("shrink", "grow"):
            p = arg % 2
            rs = reg.partitions[("t", p)].replication
            if rs is None or rs.leader is None:
                continue
            others = [r for r in rs.replicas if r != rs.leader]
            isr = [rs.leader] + (others[:arg] if kind == "grow" else [r for r in rs.isr if r != rs.leader][:arg])
            try:
                writes(reg.alter_isr(rs.leader, "t", p, rs.leader_epoch, isr, None))
            except (StaleEpoch, Unavailable):
                # only while a newer epoch, or a move off a replica of `isr`, is pending
                assert reg.partitions[("t", p)].proposed is not None
        elif kind == "reassign":
            rs = reg.partitions[("t", 0)].replication
            if rs is not None and all(reg.actors[a].alive for a in arg):
                writes(reg.reassign("t", 0, list(arg), None))
        elif kind == "confirm" and pending:
            write = pending.pop(0)
            effects = reg.on_metadata_written(write.write_id, arg, now)
            writes(effects)
            if not arg:  # a refused write voids the ones queued behind it, as the store would
                for later in pending:
                    reg.on_metadata_written(later.write_id, False, now)
                pending.clear()
                # (the shell reloads; here the registry keeps its durable state and carries on)
        for p in (0, 1):
            part = reg.partitions[("t", p)]
            for rs in (part.replication, part.proposed):
                if rs is None:
                    continue
                assert rs.isr and set(rs.isr) <= set(rs.replicas)
                assert rs.leader is None or rs.leader in rs.isr
                assert len({reg.actors[a].storage_id for a in rs.replicas}) == len(rs.replicas)
            if part.replication is not None:
                assert part.replication.leader_epoch >= epochs[p]
                epochs[p] = part.replication.leader_epoch
                assert part.owner == part.replication.leader


def test_a_restarted_leader_hands_over_and_a_restarted_follower_leaves_the_isr():
    # A new process may have lost its unsynced tail: leading on at the same epoch would
    # write offsets again that its followers already hold under that epoch.
    reg = created()
    confirm(reg, reg.register("b", reg.actors["b"].endpoint, reg.actors["b"].storage_id, 999, [], 10))
    assert (state(reg).leader, state(reg).leader_epoch, state(reg).isr) == ("a", 0, ("a", "c"))
    confirm(reg, reg.register("a", reg.actors["a"].endpoint, reg.actors["a"].storage_id, 998, [], 11))
    assert (state(reg).leader, state(reg).leader_epoch, state(reg).isr) == ("c", 1, ("c",))
    # The only ISR member restarting leads again, at a new epoch.
    confirm(reg, reg.register("c", reg.actors["c"].endpoint, reg.actors["c"].storage_id, 997, [], 12))
    assert (state(reg).leader, state(reg).leader_epoch, state(reg).isr) == ("c", 2, ("c",))
    # A registration of the same process changes nothing.
    assert reg.register("c", reg.actors["c"].endpoint, reg.actors["c"].storage_id, 997, [], 13) == []


def test_a_restarted_leader_whose_isr_peers_are_all_dead_waits_for_one_of_them():
    """It may have come back on an empty disk; leading again would make the peers, which hold
    every acknowledged record, truncate to it when they return."""
    rs = ctl.ReplicaSet(("a", "b", "c"), "a", 4, ("a", "b"), 2)
    waiting = ctl.restarted(rs, "a", live={"a", "c"})
    assert (waiting.leader, waiting.leader_epoch, waiting.isr) == (None, 5, ("b",))
    assert ctl.elect(waiting, {"a", "c"}) == waiting  # neither a nor c may lead it
    back = ctl.elect(waiting, {"a", "b", "c"})
    assert (back.leader, back.leader_epoch, back.isr) == ("b", 6, ("b",))


def test_a_restarted_leader_is_not_told_to_lead_its_old_epoch_while_its_replacement_is_written():
    """The host-loss chaos run (2026-12-05 00:00 UTC): a leader restarted on a wiped disk was
    told by its registration reply to lead the epoch being replaced (the new election not yet
    durable); its empty epoch cache could not tell it had led that epoch, so it took 13
    records at offsets 0-12, which the ISR held otherwise, kept them as a follower (the
    epoch matched) and never caught up. Followers fetching from it would have cut their
    logs back to its end."""
    reg = created()
    a = reg.actors["a"]
    effects = reg.register("a", a.endpoint, a.storage_id, 998, [], 11)
    assert any(isinstance(e, WriteMetadata) for e in effects)  # b's election, not durable yet
    [[_t, _p, told]] = reg.replicas_for("a")
    assert told["leader"] is None and told["leader_epoch"] == 0 and told["leader_endpoint"] is None
    assert reg.replicas_for("b")[0][2]["leader"] == "a"  # the others hear of the change once it is durable
    confirm(reg, effects)
    assert [row[2]["leader"] for row in reg.replicas_for("a")] == ["b"]
    # The only ISR member restarting leads again at a new epoch: not at the old one before that.
    reg = created()
    reg.partitions[("t", 0)].replication = ctl.ReplicaSet(("a", "b", "c"), "a", 0, ("a",), 2)
    effects = reg.register("a", a.endpoint, a.storage_id, 997, [], 12)
    assert reg.replicas_for("a")[0][2]["leader"] is None
    confirm(reg, effects)
    assert (reg.replicas_for("a")[0][2]["leader"], reg.replicas_for("a")[0][2]["leader_epoch"]) == ("a", 1)


def test_a_restarted_coordinator_waits_for_the_leaders_to_register_before_electing():
    reg = created()
    again = TopicRegistry(actor_timeout_ms=TIMEOUT)
    again.restore(reg.snapshot())
    # b registers first: a, the leader, has not yet, which is no reason to depose it. (b ran
    # through the restart: it reports the replica it holds.)
    b = reg.actors["b"]
    assert not any(isinstance(e, WriteMetadata) for e in again.register("b", b.endpoint, b.storage_id, b.pid, [], 0,
                                                                           replica_states=[["t", 0, 0, 0, 0]]))
    assert again.tick(TIMEOUT - 1) == []
    # a never comes back within the actor timeout: now it is dead, and b leads.
    confirm(again, again.tick(TIMEOUT))
    assert (state(again).leader, state(again).leader_epoch) == ("b", 1)


def test_a_leader_restarted_while_the_coordinator_moved_is_elected_again_at_a_new_epoch():
    """Issue 26's cluster chaos run: the leading node was SIGKILLed whole (its coordinator and
    the partition actor leading t/0) and restarted within the actor timeout. The coordinator
    that took over never saw the old pid, so the pid could not tell it; the actor's empty
    replica states do. Left as leader at epoch 0, the new process refused to lead an epoch its
    cache held: the partition took no produce until the end of the run."""
    reg = created()
    again = TopicRegistry(actor_timeout_ms=TIMEOUT)
    again.restore(reg.snapshot())
    for name in ("b", "c"):  # they ran through the takeover
        x = reg.actors[name]
        confirm(again, again.register(name, x.endpoint, x.storage_id, x.pid, [], 0,
                                      replica_states=[["t", 0, 0, 0, 0]]))
    assert (state(again).leader, state(again).leader_epoch) == ("a", 0)
    a = reg.actors["a"]
    confirm(again, again.register("a", a.endpoint, a.storage_id, 555, [], 10))  # a new process, no states
    assert (state(again).leader, state(again).leader_epoch, state(again).isr) == ("b", 1, ("b", "c"))
    # A leader that ran through the takeover reports its replica: it leads on, at its epoch.
    reg2 = created()
    again2 = TopicRegistry(actor_timeout_ms=TIMEOUT)
    again2.restore(reg2.snapshot())
    assert not any(isinstance(e, WriteMetadata) for e in again2.register(
        "a", a.endpoint, a.storage_id, a.pid, [], 0, replica_states=[["t", 0, 0, 0, 0]]))
    assert (state(again2).leader, state(again2).leader_epoch) == ("a", 0)
