"""Admin operations on the pure core: delete_group and its tombstones."""

from zbroker.actors.group_coordinator.core import TOMBSTONE_GENERATION
from zbroker.actors.group_coordinator.effects import PersistGroupConfig
from zbroker.protocol import messages as m
from zbroker.protocol.errors import GroupNotEmpty, UnknownGroup
from tests.coordinator import Driver


def consumed(d: Driver, upto: int) -> None:
    a = d.join()
    reply = d.poll(a, max_records=upto)
    d.settle("ack", a, [[t, p, lease, s, e] for t, p, lease, s, e, *_ in reply.deliveries])
    d.ok("leave", m.Leave(group="g", member_id=a.member_id, generation=a.generation))


def test_a_group_with_a_live_member_is_not_deleted():
    d = Driver(logs={("t", 0): (0, 10)})
    a = d.join()
    err = d.call("delete_group", m.DeleteGroup(group="g"))
    assert isinstance(err, GroupNotEmpty) and not err.retriable and err.data["members"] == 1
    assert d.describe()["members"][0]["member_id"] == a.member_id  # nothing changed


def test_an_unknown_group_is_unknown():
    d = Driver()
    assert isinstance(d.call("delete_group", m.DeleteGroup(group="nope")), UnknownGroup)


def test_deleting_writes_tombstones_above_every_epoch_and_a_new_incarnation_starts_afresh():
    d = Driver(logs={("t", 0): (0, 10)})
    consumed(d, 10)
    assert d.committed() == 10
    mark = d.mark()
    reply = d.ok("delete_group", m.DeleteGroup(group="g"))
    assert reply.partitions == [["t", 0]]
    tombstones = d.persisted(mark)
    assert [(p.group, p.topic, p.partition, p.generation, p.reset_epoch) for p in tombstones] == [
        ("g", "t", 0, TOMBSTONE_GENERATION, 1)]
    assert PersistGroupConfig("g", None) in d.effects[mark:]
    assert isinstance(d.call("describe_group", m.DescribeGroup(group="g")), UnknownGroup)

    # The group comes back with no offset (start rule: earliest) at an epoch above the tombstone.
    a = d.join()
    assert [(s, e) for _t, _p, _l, s, e, *_ in d.poll(a).deliveries] == [(0, 10)]
    assert d.describe()["reset_epoch"] == 1


def test_loading_skips_tombstones_but_keeps_their_epoch():
    rows = [("g", "t", 0, 0, [], TOMBSTONE_GENERATION, 3), ("h", "t", 0, 4, [], 2, 0)]
    d = Driver(rows=rows, logs={("t", 0): (0, 10)})
    assert [g["group"] for g in d.ok("list_groups", m.ListGroups()).groups] == ["h"]
    d.join()
    assert d.describe()["reset_epoch"] == 3
    assert d.committed() == 0  # not the tombstone's offset: the start rule's
