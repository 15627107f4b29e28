"""Loading stored offsets, start positions, retention fallback, reset and topology changes."""

import pytest

from zbroker.actors.group_coordinator.core import MIN_SHARE, GroupConfig
from zbroker.actors.group_coordinator.effects import PersistGroupConfig
from zbroker.protocol import messages as m
from zbroker.protocol.errors import StaleLease, Unavailable, UnknownGroup, UnknownTopic
from tests.coordinator import Driver


def spans(reply):
    return [(s, e, attempt, reason) for _t, _p, _l, s, e, attempt, reason in reply.deliveries]


def test_every_group_op_is_unavailable_until_offsets_are_loaded():
    d = Driver(load=False, logs={("t", 0): (0, 10)})
    for op, msg in [("join", m.Join(group="g", topics=["t"])), ("list_groups", m.ListGroups()),
                    ("describe_group", m.DescribeGroup(group="g")),
                    ("poll", m.Poll(group="g", member_id="x", generation=1))]:
        err = d.call(op, msg)
        assert isinstance(err, Unavailable) and err.retriable
    assert d.core.tick(d.now) == []
    d.feed(d.core.load_offsets([], d.now))
    assert d.join().generation == 1


def test_restart_redelivers_the_unacked_gaps_below_the_highest_hole_as_restart():
    rows = [("g", "t", 0, 10, [[12, 14], [16, 17]], 7, 0)]
    d = Driver(rows=rows, logs={("t", 0): (0, 30)})
    group = d.describe()
    assert group["generation"] == 7 and group["members"] == []
    part = d.partition()
    assert (part["committed"], part["committed_pending"], part["lag"]) == (10, 10, 20)  # lag with no member
    a = d.join()
    assert a.generation == 8
    assert spans(d.poll(a, max_records=100)) == [(10, 12, 2, "restart"), (14, 16, 2, "restart"),
                                                 (17, 30, 1, "new")]


def test_loaded_groups_are_listed_and_keep_their_config():
    d = Driver(load=False)
    d.core.restore_group_config("g", GroupConfig(mode="shared", dlq="dead"))
    d.feed(d.core.load_offsets([("g", "t", 0, 3, [], 2, 1), ("h", "t", 0, 0, [], 1, 0)], d.now))
    assert d.ok("list_groups", m.ListGroups()).groups == [
        {"group": "g", "mode": "shared", "members": 0, "generation": 2},
        {"group": "h", "mode": "exclusive", "members": 0, "generation": 1}]
    described = d.describe()
    assert described["dlq"] == "dead" and described["config"]["mode"] == "shared"
    assert described["reset_epoch"] == 1


def test_start_latest_begins_at_the_log_end_and_persists_it():
    d = Driver(logs={("t", 0): (0, 50)})
    d.ok("configure_group", m.ConfigureGroup(group="g", start="latest"))
    mark = d.mark()
    a = d.join()
    assert [(p.committed, p.holes) for p in d.persisted(mark)] == [(50, [])]
    assert d.logs("start_position", mark)[0].fields["offset"] == 50
    assert d.poll(a).deliveries == []
    d.log_range("t", 0, 0, 52)
    assert spans(d.poll(a)) == [(50, 52, 1, "new")]


def test_start_position_waits_for_the_log_range():
    d = Driver(config=GroupConfig(start="latest"))
    a = d.join()
    assert d.partition()["committed_pending"] is None
    d.log_range("t", 0, 5, 9)
    assert d.committed() == 9
    d.log_range("t", 0, 5, 10)
    assert spans(d.poll(a)) == [(9, 10, 1, "new")]


def test_start_earliest_uses_the_log_start():
    d = Driver(logs={("t", 0): (40, 50)})
    a = d.join()
    assert spans(d.poll(a)) == [(40, 50, 1, "new")]


def test_stored_offset_below_the_log_start_follows_the_start_rule():
    rows = [("g", "t", 0, 5, [[7, 9]], 1, 0), ("h", "t", 0, 5, [], 1, 0)]
    d = Driver(load=False, logs={("t", 0): (20, 30)})
    d.core.restore_group_config("h", GroupConfig(start="latest"))
    d.feed(d.core.load_offsets(rows, d.now))
    assert d.committed(group="g") == 20 and d.committed(group="h") == 30
    events = d.logs("committed_below_log_start")
    assert {(e.fields["group"], e.fields["committed"], e.fields["offset"]) for e in events} == \
        {("g", 5, 20), ("h", 5, 30)}
    assert {(p.group, p.committed, tuple(map(tuple, p.holes))) for p in d.persisted()} == {("g", 20, ()),
                                                                                            ("h", 30, ())}


def test_retention_passing_a_live_group_drops_what_is_gone():
    d = Driver(logs={("t", 0): (0, 10)})
    a = d.join()
    lease = d.poll(a, max_records=6).deliveries[0][2]
    d.log_range("t", 0, 4, 12)
    assert d.committed() == 4
    assert d.describe()["members"][0]["in_flight"] == 2
    assert d.settle("ack", a, [["t", 0, lease, 4, 6]]).applied == 2
    assert isinstance(d.settle("ack", a, [["t", 0, lease, 0, 1]]), StaleLease)
    assert spans(d.poll(a)) == [(6, 12, 1, "new")]


def test_reset_group_moves_committed_bumps_epoch_and_revokes_leases():
    d = Driver({"t": 2}, logs={("t", 0): (10, 100), ("t", 1): (0, 5)})
    a = d.join()
    leases = {p: lease for _t, p, lease, *_ in d.poll(a, max_records=2 * MIN_SHARE).deliveries}
    d.settle("ack", a, [["t", 0, leases[0], 15, 16]])
    mark = d.mark()
    reply = d.ok("reset_group", m.ResetGroup(group="g", topic="t", to=50))
    assert reply == m.ResetGroupReply(partitions=[[0, 50], [1, 5]], reset_epoch=1)
    assert sorted((p.partition, p.committed, p.reset_epoch, tuple(p.holes)) for p in d.persisted(mark)) == \
        [(0, 50, 1, ()), (1, 5, 1, ())]
    assert d.describe()["members"][0]["in_flight"] == 0
    assert isinstance(d.settle("ack", a, [["t", 1, leases[1], 0, 5]]), StaleLease)
    assert sorted((p, s, e) for _t, p, _l, s, e, _a, _r in d.poll(a, max_records=4).deliveries) == [(0, 50, 54)]
    # A durable report of the reset applies even though its offset is lower than before.
    d.feed(d.core.on_durable([("g", "t", 0, 60, 0)], d.now))
    d.feed(d.core.on_durable([("g", "t", 0, 50, 1)], d.now))
    assert d.partition()["committed"] == 50
    assert d.ok("reset_group", m.ResetGroup(group="g", topic="t", to="earliest")).partitions == [[0, 10], [1, 0]]
    assert d.ok("reset_group", m.ResetGroup(group="g", topic="t", to="latest")).reset_epoch == 3


def test_reset_group_errors():
    d = Driver({"t": 1, "u": 1}, logs={("t", 0): (0, 1)})
    assert isinstance(d.call("reset_group", m.ResetGroup(group="g", topic="t", to=0)), UnknownGroup)
    d.join()
    assert isinstance(d.call("reset_group", m.ResetGroup(group="g", topic="x", to=0)), UnknownTopic)
    err = d.call("reset_group", m.ResetGroup(group="g", topic="u", to=0))
    assert isinstance(err, Unavailable) and err.data["topic"] == "u"  # log range not known yet


def test_dead_letter_confirmation_after_a_reset_is_ignored():
    d = Driver(logs={("t", 0): (0, 3)})
    a = d.join()
    d.settle("reject", a, [["t", 0, d.poll(a).deliveries[0][2], 0, 1]])
    d.ok("reset_group", m.ResetGroup(group="g", topic="t", to="earliest"))
    d.feed(d.core.on_dead_letter_done(d.dead_letter(0), d.now))
    assert d.committed() == 0 and d.logs("dead_letter_confirmation_ignored")


def test_configure_group_persists_and_validates():
    d = Driver()
    mark = d.mark()
    reply = d.ok("configure_group", m.ConfigureGroup(group="new", max_in_flight=7, dlq="x"))
    assert reply.config == {**GroupConfig().to_dict(), "max_in_flight": 7, "dlq": "x"}
    assert [e for e in d.effects[mark:] if isinstance(e, PersistGroupConfig)] == [PersistGroupConfig("new",
                                                                                                     reply.config)]
    assert d.ok("configure_group", m.ConfigureGroup(group="new", dlq="")).config["dlq"] is None
    assert GroupConfig.from_dict({**reply.config, "unknown": 1}) == GroupConfig(max_in_flight=7, dlq="x")


def test_a_refused_configure_group_creates_no_group():
    """The codec refuses a bad value first; the core must not depend on it (found by a reviewer)."""
    d = Driver()
    mark = d.mark()
    err = d.call("configure_group", m.ConfigureGroup(group="typo", mode="exclusiv"))
    assert err.code.name == "BAD_REQUEST"
    assert d.ok("list_groups", m.ListGroups()).groups == []
    assert not [e for e in d.effects[mark:] if isinstance(e, PersistGroupConfig)]


def test_partitions_added_to_a_topic_are_assigned_at_the_next_tick():
    d = Driver({"t": 1}, logs={("t", 0): (0, 1), ("t", 1): (0, 1)})
    a = d.join()
    d.join()
    a = d.resync(a)
    d.core.set_topic("t", 2)
    assert d.core.next_deadline() == 0  # in the past: tick now
    d.advance(0)
    owners = {p: o for _t, p, o in d.describe()["assignment"]}
    assert sorted(owners) == [0, 1] and len(set(owners.values())) == 2
    assert d.describe()["generation"] == 3


def test_lease_ids_and_member_ids_come_from_the_base():
    d = Driver(lease_id_base=5_000_000, logs={("t", 0): (0, 1)})
    a = d.join()
    assert "5000000" in a.member_id
    assert d.poll(a).deliveries[0][2] > 5_000_000


def test_a_group_stored_with_an_ack_timeout_over_the_lease_cap_loads_capped():
    """Stored before leases were capped at 12 hours (m.MAX_LEASE_MS): the coordinator
    must still start, and no lease of that group may outlast the cap."""
    stored = GroupConfig(ack_timeout_ms=30_000).to_dict() | {"ack_timeout_ms": 365 * 24 * 3600 * 1000}
    assert GroupConfig.from_dict(stored).ack_timeout_ms == m.MAX_LEASE_MS
    assert GroupConfig.from_dict(GroupConfig(ack_timeout_ms=m.MAX_LEASE_MS).to_dict()).ack_timeout_ms == m.MAX_LEASE_MS
    with pytest.raises(ValueError, match="at most"):
        GroupConfig(ack_timeout_ms=m.MAX_LEASE_MS + 1)
