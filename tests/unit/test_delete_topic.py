"""delete_topic in the pure pieces: the registry's pending deletions, the group core's
tombstones and epochs, the partition actor's closing and removing, and the real remover's
crash-safe rename (all without sockets)."""

import pytest

from zbroker.actors.group_coordinator.core import TOMBSTONE_GENERATION
from zbroker.actors.group_coordinator.topics import (DELETE_RESEND_MS, AssignActor, DeletePartitionsOn,
                                                     PersistTopics, TopicRegistry)
from zbroker.actors.partition_log import shell
from zbroker.actors.partition_log.core import OpenFailed, PartitionActorCore, Reply, ReplyError
from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.errors import ErrorCode, Unavailable, UnknownTopic
from zbroker.storage.log.partition_log import LogConfig
from tests.coordinator import Driver
from tests.coordinator.test_admin_ops import consumed


def registry_with_topic():
    reg = TopicRegistry()
    reg.register("a", "tcp://h:1", "h:/d1", 1, [], 0)
    reg.create_topic("t", 2, None, 0)
    return reg


def test_the_registry_forgets_the_topic_and_asks_its_actor_until_it_confirms():
    reg = registry_with_topic()
    effects = reg.delete_topic("t", 10)
    assert effects == [PersistTopics(), AssignActor("a"), DeletePartitionsOn("a", [["t", 0], ["t", 1]])]
    assert "t" not in reg.topics and reg.assignment_for("a") == []
    assert reg.pending_deletion("t") == [[0, "a"], [1, "a"]]
    with pytest.raises(Unavailable) as info:  # the name waits for the files to go
        reg.create_topic("t", 1, None, 20)
    assert info.value.data["pending"] == [[0, "a"], [1, "a"]]
    with pytest.raises(UnknownTopic):
        reg.delete_topic("t", 20)

    reg.register("a", "tcp://h:1", "h:/d1", 1, [], 20)
    assert not any(isinstance(e, DeletePartitionsOn) for e in reg.tick(10 + DELETE_RESEND_MS - 1))
    assert reg.tick(10 + DELETE_RESEND_MS) == [DeletePartitionsOn("a", [["t", 0], ["t", 1]])]  # unanswered: again
    assert reg.on_partitions_deleted("a", [["t", 0]]) == [PersistTopics()]
    assert reg.pending_deletion("t") == [[1, "a"]]

    again = TopicRegistry()  # the pending deletion survives a restart
    again.restore(reg.snapshot())
    assert again.pending_deletion("t") == [[1, "a"]]
    reg.on_partitions_deleted("a", [["t", 1]])
    assert reg.pending_deletion("t") == [] and reg.tick(10 * DELETE_RESEND_MS) == []
    reg.create_topic("t", 1, None, 30)


def test_a_dead_holder_is_asked_once_it_is_back():
    reg = registry_with_topic()
    reg.tick(6000)  # silent past the dead-actor timeout
    assert not reg.actors["a"].alive
    assert not any(isinstance(e, DeletePartitionsOn) for e in reg.delete_topic("t", 6000))
    reg.register("a", "tcp://h:1", "h:/d1", 2, [], 7000)
    assert DeletePartitionsOn("a", [["t", 0], ["t", 1]]) in reg.tick(7000)


def test_the_core_tombstones_every_groups_offsets_on_the_topic_only():
    d = Driver(topics={"t": 1, "u": 1}, logs={("t", 0): (0, 10), ("u", 0): (0, 4)})
    consumed(d, 10)
    a = d.join(topics=["u"])
    d.poll(a)
    assert d.core.consumers_of("u") == {"g": 1} and d.core.consumers_of("t") == {}
    mark = d.mark()
    d.feed(d.core.forget_topic("t", d.now))
    [tomb] = d.persisted(mark)
    assert (tomb.topic, tomb.partition, tomb.generation, tomb.reset_epoch) == ("t", 0, TOMBSTONE_GENERATION, 1)
    assert [(p["topic"], p["partition"]) for p in d.describe()["partitions"]] == [("u", 0)]
    assert d.core.groups_on_topic("t") == []


def test_after_a_restart_the_group_goes_on_above_the_tombstones_epoch():
    # Sorted as the store returns them: the live row of "a" comes before the tombstone of "t".
    rows = [("g", "a", 0, 5, [], 1, 0), ("g", "t", 0, 0, [], TOMBSTONE_GENERATION, 2)]
    d = Driver(topics={"a": 1, "t": 1}, rows=rows, logs={("a", 0): (0, 9)})
    assert d.describe()["reset_epoch"] == 2  # below it the writer would refuse the group's new rows


class Remover:
    def __init__(self):
        self.removed, self.locked = [], set()

    def __call__(self, topic, partition):
        if (topic, partition) in self.locked:
            raise OpenFailed("locked by another actor")
        self.removed.append((topic, partition))


def env(msg):
    return codec.decode_request(codec.encode_request(msg, 1, []))


def test_the_partition_actor_closes_then_removes_and_reports_what_it_could_not(tmp_path):
    from tests.unit.test_partition_actor_core import Opener
    remover = Remover()
    core = PartitionActorCore("p0", open_log=Opener(tmp_path), remove_log=remover)
    core.on_assign([["t", 0, None], ["t", 1, None]], 0)
    remover.locked.add(("t", 1))
    request = m.DeletePartitions(partitions=[["t", 0], ["t", 1]])
    refused = core.handle("tok", env(request), 1)
    assert isinstance(refused[0], ReplyError) and refused[0].error.code is ErrorCode.UNAUTHORIZED
    [reply] = core.handle("tok", env(request), 1, from_coordinator=True)
    assert isinstance(reply, Reply)
    assert reply.msg.deleted == [["t", 0]] and reply.msg.failed == [["t", 1, "locked by another actor"]]
    assert core.owned() == [] and remover.removed == [("t", 0)]
    core.coordinator_epoch = 3
    [stale] = core.handle("tok", env(m.DeletePartitions(partitions=[["t", 1]], coordinator_epoch=2)), 1,
                          from_coordinator=True)
    assert stale.error.code is ErrorCode.STALE_EPOCH
    core.close()


def test_the_remover_takes_the_whole_directory_or_nothing_and_frees_the_name(tmp_path):
    opener = shell.LockedLogOpener(tmp_path)
    plog = opener("t", 0, LogConfig(), 0)
    with pytest.raises(OpenFailed):  # still open here: never removed under a live log
        opener.remove("t", 0)
    plog.close()
    other = shell.LockedLogOpener(tmp_path)  # another actor on this storage holding it
    held = other("t", 0, LogConfig(), 0)
    with pytest.raises(OpenFailed):
        opener.remove("t", 0)
    held.close()
    opener.remove("t", 0)
    assert not (tmp_path / "logs" / "t").exists()
    assert list(shell.trash_dir(tmp_path).iterdir()) == []
    opener.remove("t", 0)  # already gone: done
    fresh = opener("t", 0, LogConfig(), 0)
    assert (fresh.log_start, fresh.log_end) == (0, 0)
    fresh.close()
