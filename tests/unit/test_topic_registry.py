"""Topic creation and partition placement across partition-log actors."""

import pytest

from zbroker.actors.group_coordinator.topics import AssignActor, PersistTopics, TopicRegistry
from zbroker.protocol.errors import ProtocolError, TopicExists, UnknownTopic


def owners(reg: TopicRegistry, topic: str) -> list:
    return [reg.partitions[(topic, p)].owner for p in range(reg.topics[topic]["partitions"])]


def test_create_spreads_partitions_over_live_actors_and_persists():
    reg = TopicRegistry()
    reg.register("a", "tcp://a", "s1", 1, [], 0)
    reg.register("b", "tcp://b", "s1", 2, [], 0)
    effects = reg.create_topic("orders", 4, None, 0)
    assert PersistTopics() in effects
    assert {e.actor_id for e in effects if isinstance(e, AssignActor)} == {"a", "b"}
    assert sorted(owners(reg, "orders")) == ["a", "a", "b", "b"]


def test_unknown_and_duplicate_topics_and_bad_names():
    reg = TopicRegistry()
    reg.create_topic("t", 1, None, 0)
    with pytest.raises(TopicExists):
        reg.create_topic("t", 2, None, 0)
    with pytest.raises(UnknownTopic):
        reg.metadata(["nope"])
    for bad in ["", "../x", "a/b", ".hidden", "a" * 201, "sp ace"]:
        with pytest.raises(ProtocolError):
            reg.create_topic(bad, 1, None, 0)
    with pytest.raises(ProtocolError):
        reg.create_topic("bad-config", 1, {"segment_bytes": -5}, 0)


def test_partitions_wait_for_an_actor_then_get_placed():
    reg = TopicRegistry()
    reg.create_topic("t", 2, None, 0)
    assert owners(reg, "t") == [None, None]
    effects = reg.register("a", "tcp://a", "s1", 1, [], 0)
    assert AssignActor("a") in effects
    assert owners(reg, "t") == ["a", "a"]
    assert reg.assignment_for("a")[0][:2] == ["t", 0]


def test_a_new_actor_on_the_same_storage_takes_half():
    reg = TopicRegistry()
    reg.register("a", "tcp://a", "s1", 1, [], 0)
    reg.create_topic("t", 4, None, 0)
    effects = reg.register("b", "tcp://b", "s1", 2, [], 10)
    assert {e.actor_id for e in effects if isinstance(e, AssignActor)} == {"a", "b"}
    assert sorted(owners(reg, "t")) == ["a", "a", "b", "b"]


def test_an_actor_on_other_storage_does_not_take_placed_partitions():
    reg = TopicRegistry()
    reg.register("a", "tcp://a", "s1", 1, [], 0)
    reg.create_topic("t", 4, None, 0)
    reg.register("far", "tcp://far", "s2", 9, [], 10)
    assert owners(reg, "t") == ["a"] * 4
    reg.create_topic("u", 2, None, 10)
    assert sorted(owners(reg, "u")) == ["a", "far"] or sorted(owners(reg, "u")) == ["far", "far"]


def test_dead_actor_partitions_move_only_within_storage():
    reg = TopicRegistry(actor_timeout_ms=100)
    reg.register("a", "tcp://a", "s1", 1, [], 0)
    reg.register("b", "tcp://b", "s1", 2, [], 0)
    reg.create_topic("t", 4, None, 0)
    reg.register("b", "tcp://b", "s1", 2, [], 150)  # b stays alive
    effects = reg.tick(150)
    assert AssignActor("b") in effects
    assert owners(reg, "t") == ["b"] * 4
    assert reg.endpoint_of("t", 0) == "tcp://b"


def test_an_actor_that_deregisters_hands_its_partitions_over_at_once():
    reg = TopicRegistry(actor_timeout_ms=60_000)
    reg.register("a", "tcp://a", "s1", 1, [], 0)
    reg.register("b", "tcp://b", "s1", 2, [], 0)
    reg.create_topic("t", 4, None, 0)
    assert sorted(owners(reg, "t")) == ["a", "a", "b", "b"]
    assert reg.deregister("b", 99, 10) == []  # not b's process: an earlier one, or a forgery
    assert reg.deregister("b", 2, 10) == [PersistTopics(), AssignActor("a")]  # long before the timeout
    assert owners(reg, "t") == ["a"] * 4
    assert reg.endpoint_of("t", 0) == "tcp://a"
    assert reg.deregister("b", 2, 11) == []  # said twice: nothing more moves
    reg.register("b", "tcp://b", "s1", 3, [], 20)  # restarted: it takes its share back
    assert sorted(owners(reg, "t")) == ["a", "a", "b", "b"]


def test_restarted_actor_keeps_its_partitions_and_reports_update_log_ends():
    reg = TopicRegistry()
    reg.register("a", "tcp://a", "s1", 1, [], 0)
    reg.create_topic("t", 2, None, 0)
    reg.register("a", "tcp://a", "s1", 2, [["t", 0, 0, 50, 5000], ["t", 1, 0, 7, 700]], 10)
    assert owners(reg, "t") == ["a", "a"]
    assert reg.describe("t")[0]["log_end"] == 50
    changed = reg.on_report("a", [["t", 1, 0, 9, 900], ["t", 5, 0, 1, 1]], 20)
    assert changed == [("t", 1, 0, 9)]


def test_snapshot_restore_round_trip():
    reg = TopicRegistry()
    reg.register("a", "tcp://a", "s1", 1, [], 0)
    reg.create_topic("t", 3, {"retention_ms": 1000}, 0)
    other = TopicRegistry()
    other.restore(reg.snapshot())
    assert other.topics == reg.topics
    assert owners(other, "t") == owners(reg, "t")


def test_the_actor_registry_is_bounded_and_forgets_long_dead_actors():
    from zbroker.actors.group_coordinator import topics
    from zbroker.protocol.errors import Unavailable

    reg = TopicRegistry(actor_timeout_ms=100)
    reg.register("real", "tcp://real", "s1", 1, [], 0)
    reg.create_topic("t", 2, None, 0)
    for i in range(topics.MAX_ACTORS - 1):  # forged registrations fill the registry
        reg.register(f"forged-{i}", f"tcp://f{i}", f"x{i}", 100 + i, [], 0)
    with pytest.raises(Unavailable):
        reg.register("one-more", "tcp://m", "x", 9, [], 50)
    reg.register("real", "tcp://real", "s1", 1, [], 50)  # a known actor still re-registers

    reg.register("real", "tcp://real", "s1", 1, [], 200)
    reg.tick(200)  # the forged ones fall silent and are marked dead, not yet forgotten
    assert len(reg.actors) == topics.MAX_ACTORS
    reg.register("late", "tcp://l", "s2", 7, [], 300)  # room is made from dead actors that own nothing
    later = 300 + topics.FORGET_DEAD_ACTOR_MS
    reg.register("real", "tcp://real", "s1", 1, [], later)
    reg.register("late", "tcp://l", "s2", 7, [], later)
    reg.tick(later)
    assert set(reg.actors) == {"real", "late"}
    assert owners(reg, "t") == ["real", "real"]  # an owner is never forgotten


def test_an_actor_with_partitions_it_could_not_open_is_alive_but_not_healthy():
    # A partition actor short of file descriptors kept serving its other partitions
    # and `zbroker status` called it healthy; only its log said otherwise.
    reg = TopicRegistry()
    reg.register("a", "tcp://a", "s1", 1, [], 0)
    reg.create_topic("t", 3, None, 0)
    why = "out of file descriptors: raise the open-file limit (ulimit -n)"
    reg.register("a", "tcp://a", "s1", 1, [["t", 0, 0, 0, 0]], 1000,
                 not_open=[["t", 1, why], ["t", 2, why]], not_open_count=2)
    (actor,) = reg.actor_status(1000)
    assert actor["alive"] is True and actor["healthy"] is False
    assert actor["not_open_count"] == 2 and actor["not_open"] == [["t", 1, why], ["t", 2, why]]
    reg.register("a", "tcp://a", "s1", 1, [["t", p, 0, 0, 0] for p in range(3)], 2000)  # the limit was raised
    (actor,) = reg.actor_status(2000)
    assert actor["healthy"] is True and actor["not_open_count"] == 0 and actor["not_open"] == []


def test_a_bad_topic_setting_names_the_field_and_the_value():
    reg = TopicRegistry()
    with pytest.raises(ProtocolError) as caught:
        reg.create_topic("t", 1, {"segment_bytes": 1 << 32}, 0)
    assert caught.value.data == {"topic": "t", "field": "config.segment_bytes", "got": 1 << 32}
    with pytest.raises(ProtocolError) as caught:
        reg.create_topic("t", 1, {"retention_ms": "soon"}, 0)
    assert caught.value.data["field"] == "config.retention_ms"
