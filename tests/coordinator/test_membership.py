"""Membership, generations, fencing, sticky assignment and revocation."""

from zbroker.actors.group_coordinator.core import GroupConfig
from zbroker.protocol import messages as m
from zbroker.protocol.errors import Fenced, StaleLease, UnknownMember, UnknownTopic
from tests.coordinator import PARKED, Driver, deliveries_of


def owners(d, group="g"):
    return {(t, p): o for t, p, o in d.describe(group)["assignment"]}


def test_every_membership_change_starts_a_generation():
    d = Driver()
    a = d.join()
    assert a.generation == 1 and a.assignment == [["t", 0]]
    b = d.join()
    assert b.generation == 2
    d.ok("leave", m.Leave(group="g", member_id=b.member_id, generation=b.generation))
    assert d.describe()["generation"] == 3


def test_old_generation_is_fenced_with_data_and_join_resyncs_without_a_new_generation():
    d = Driver(logs={("t", 0): (0, 10)})
    a = d.join()
    d.join()  # b joins: generation 2
    err = d.poll(a)
    assert isinstance(err, Fenced) and err.retriable
    assert err.data == {"group": "g", "generation": 2, "member_id": a.member_id, "member_known": True}
    again = d.resync(a)
    assert again.generation == 2 and again.member_id == a.member_id
    assert d.describe()["generation"] == 2  # re-sync is not a membership change
    assert d.poll(again).generation == 2


def test_every_group_request_is_fenced_in_an_old_generation():
    d = Driver(logs={("t", 0): (0, 10)})
    a = d.join()
    lease = d.poll(a).deliveries[0][2]
    d.join()
    assert isinstance(d.call("heartbeat", m.Heartbeat(group="g", member_id=a.member_id, generation=1)), Fenced)
    for op in ("ack", "nack", "extend", "reject"):
        assert isinstance(d.settle(op, a, [["t", 0, lease, 0, 1]]), Fenced)
    assert d.partition()["in_flight"] in (0, 10)  # nothing was applied by the fenced requests


def test_unknown_member_and_unknown_group():
    d = Driver()
    a = d.join()
    err = d.call("poll", m.Poll(group="g", member_id="who", generation=a.generation))
    assert isinstance(err, UnknownMember) and err.data["member_id"] == "who"
    err = d.call("heartbeat", m.Heartbeat(group="nope", member_id="who", generation=0))
    assert isinstance(err, UnknownMember)
    # An unknown member in an old generation is fenced, saying it is not known.
    err = d.call("poll", m.Poll(group="g", member_id="who", generation=0))
    assert isinstance(err, Fenced) and err.data["member_known"] is False


def test_join_with_unknown_topic_is_refused():
    d = Driver()
    err = d.call("join", m.Join(group="g", topics=["t", "missing"]))
    assert isinstance(err, UnknownTopic) and err.data["topic"] == "missing"
    assert d.ok("list_groups", m.ListGroups()).groups == []


def test_changing_topics_is_a_membership_change():
    d = Driver({"t": 1, "u": 1})
    a = d.join(topics=["t"])
    again = d.join(topics=["t", "u"], member_id=a.member_id)
    assert again.generation == 2 and sorted(again.assignment) == [["t", 0], ["u", 0]]


def test_session_expiry_removes_a_silent_member_and_any_request_is_a_heartbeat():
    d = Driver(logs={("t", 0): (0, 10)})
    a = d.join(session_timeout_ms=1_000)
    b = d.join(session_timeout_ms=5_000)
    a = d.resync(a)
    for _ in range(8):  # a keeps polling, b stays silent
        d.advance(600)
        assert not isinstance(d.poll(a, max_records=1), Exception)
    assert len(d.describe()["members"]) == 2  # 4.8 s: b is still within its 5 s
    d.advance(600)
    assert isinstance(d.poll(a, max_records=1), Fenced)  # b expired: a new generation
    assert [x["member_id"] for x in d.describe()["members"]] == [a.member_id]
    assert d.logs("member_expired")[0].fields["member_id"] == b.member_id
    assert isinstance(d.poll(b), Fenced)


def test_adding_a_third_member_moves_only_two_of_six_partitions_and_keeps_other_leases():
    d = Driver({"t": 6}, logs={("t", p): (0, 10) for p in range(6)})
    a = d.join()
    b = d.join()
    a = d.resync(a)
    before = owners(d)
    leases = {}
    for member in (a, b):
        for t, p, lease, s, e, _att, _r in d.poll(member, max_records=60).deliveries:
            leases[(t, p)] = (member, lease, s, e)
    c = d.join()
    after = owners(d)
    moved = {k for k in before if before[k] != after[k]}
    assert len(moved) == 2 and all(after[k] == c.member_id for k in moved)
    # Leases of partitions that stayed are still valid once their owner re-syncs.
    for key, (member, lease, s, e) in leases.items():
        member = d.resync(member)
        reply = d.settle("ack", member, [[key[0], key[1], lease, s, e]])
        if key in moved:
            assert isinstance(reply, StaleLease)
        else:
            assert reply.applied == e - s


def test_rebalance_revokes_moved_leases_and_the_new_owner_gets_them_as_rebalance():
    d = Driver({"t": 2}, logs={("t", 0): (0, 10), ("t", 1): (0, 10)})
    a = d.join()
    (t0, t1) = d.poll(a, max_records=20).deliveries
    b = d.join()
    moved = [t0, t1][[k for k, o in owners(d).items() if o == b.member_id][0][1]]
    # The old owner's ack in its old generation is fenced, after re-sync it is stale.
    assert isinstance(d.settle("ack", a, [moved[:5]]), Fenced)
    a = d.resync(a)
    err = d.settle("ack", a, [moved[:5]])
    assert isinstance(err, StaleLease) and err.data["applied"] == 0
    got = deliveries_of(d.poll(b, max_records=20))
    assert got == [(moved[0], moved[1], got[0][2], 0, 10, 2, "rebalance")]
    assert d.partition(moved[0], moved[1])["committed_pending"] == 0


def test_leave_releases_leases_at_once():
    d = Driver(logs={("t", 0): (0, 10)})
    a = d.join()
    d.poll(a, max_records=4)
    b = d.join()
    a = d.resync(a)
    d.ok("leave", m.Leave(group="g", member_id=a.member_id, generation=a.generation))
    b = d.resync(b)
    got = deliveries_of(d.poll(b))
    assert [(s, e, att, r) for _t, _p, _l, s, e, att, r in got] == [(0, 4, 2, "rebalance"), (4, 10, 1, "new")]
    # Leaving twice, or as a stranger, is harmless.
    assert d.ok("leave", m.Leave(group="g", member_id=a.member_id, generation=0)) == m.LeaveReply()


def test_a_waiting_poll_is_fenced_when_the_generation_moves():
    d = Driver()
    a = d.join()
    token = "waiting"
    assert d.call("poll", m.Poll(group="g", member_id=a.member_id, generation=1, max_wait_ms=5_000),
                  token=token) is PARKED
    d.join()
    assert isinstance(d.answers[token], Fenced)
    assert d.core.statistics()["parked_polls"] == 0


def test_shared_mode_leases_disjoint_ranges_of_one_partition_to_many_members():
    d = Driver(config=GroupConfig(mode="shared"), logs={("t", 0): (0, 10)})
    a = d.join()
    b = d.join()
    a = d.resync(a)
    assert a.mode == "shared" and a.assignment == b.assignment == [["t", 0]]
    ra = deliveries_of(d.poll(a, max_records=4))
    rb = deliveries_of(d.poll(b, max_records=4))
    assert [(s, e) for *_x, s, e, _a, _r in ra] == [(0, 4)]
    assert [(s, e) for *_x, s, e, _a, _r in rb] == [(4, 8)]
    assert d.describe()["assignment"] == []


def test_switching_mode_rebalances():
    d = Driver(config=GroupConfig(mode="shared"), logs={("t", 0): (0, 10)})
    a = d.join()
    b = d.join()
    a = d.resync(a)
    la = d.poll(a, max_records=3).deliveries[0]
    lb = d.poll(b, max_records=3).deliveries[0]
    d.ok("configure_group", m.ConfigureGroup(group="g", mode="exclusive"))
    assert d.describe()["generation"] == 3
    owner = owners(d)[("t", 0)]
    keep, lose = (la, lb) if owner == a.member_id else (lb, la)
    assert d.partition()["in_flight"] == 3
    keeper, loser = (d.resync(a), d.resync(b)) if owner == a.member_id else (d.resync(b), d.resync(a))
    assert d.settle("ack", keeper, [keep[:5]]).applied == 3
    assert isinstance(d.settle("ack", loser, [lose[:5]]), StaleLease)  # revoked by the switch
    got = deliveries_of(d.poll(keeper, max_records=3))
    assert [(s, e, r) for *_x, s, e, _a, r in got] == [(lose[3], lose[4], "rebalance")]


def test_a_shorter_session_timeout_on_re_sync_is_honoured():
    d = Driver()
    a = d.join(session_timeout_ms=3_600_000)
    d.join(member_id=a.member_id, session_timeout_ms=1_000)  # re-sync, now with one second
    d.advance(5_000)
    assert d.logs("member_expired"), "silent five times its session timeout, and not expired"
    assert d.describe()["members"] == []


def test_a_waiting_poll_answered_fenced_restarts_the_session_clock():
    """SEMANTICS.md: a member with a waiting poll is alive; its session clock restarts when
    the poll is answered, FENCED by a rebalance included."""
    d = Driver()
    d.log_range("t", 0, 0, 0)
    a = d.join(session_timeout_ms=10_000)
    d.advance(1)
    assert d.poll(a, max_wait_ms=60_000) is PARKED
    d.advance(9_999)
    d.advance(9_999)
    d.join()  # a second member: the waiting poll is answered FENCED
    assert any(isinstance(e, Fenced) for e in d.answers.values())
    d.advance(1)
    assert not d.logs("member_expired"), "expired 1 ms after its waiting poll was answered"


def test_a_generated_member_id_never_takes_over_an_id_a_client_chose():
    d = Driver()  # generated ids are m-1000-1, m-1000-2, ...
    d.log_range("t", 0, 0, 100)
    chosen = d.join(member_id="m-1000-1")
    assert d.poll(chosen, max_records=10).deliveries
    fresh = d.join()
    members = {mem["member_id"]: mem for mem in d.describe()["members"]}
    assert fresh.member_id != chosen.member_id and len(members) == 2
    assert members[chosen.member_id]["in_flight"] == 10
