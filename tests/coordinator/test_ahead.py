"""Ahead leases: an exclusive member leases the next offsets before they exist (Poll.ahead)."""

from zbroker.actors.group_coordinator.core import GroupConfig
from zbroker.protocol import messages as m
from zbroker.protocol.errors import StaleLease
from tests.coordinator import PARKED, Driver


def poll_ahead(d: Driver, member, ahead: int = 100, max_records: int = 1000, max_wait_ms: int = 0, token=None):
    return d.call("poll", m.Poll(group="g", member_id=member.member_id, generation=member.generation,
                                 max_records=max_records, max_wait_ms=max_wait_ms, ahead=ahead), token=token)


def spans(reply):
    return [(s, e, attempt, reason) for _t, _p, _l, s, e, attempt, reason in reply.deliveries]


def test_nothing_to_lease_grants_the_next_offsets_ahead_and_they_become_leases_as_they_appear():
    d = Driver(config=GroupConfig(ack_timeout_ms=1_000), logs={("t", 0): (0, 3)})
    a = d.join()
    assert spans(poll_ahead(d, a)) == [(0, 3, 1, "new")]  # records exist: an ordinary lease first
    reply = poll_ahead(d, a, ahead=10)
    assert spans(reply) == [(3, 13, 1, "ahead")]
    lease = reply.deliveries[0][2]
    assert d.partition()["ahead"] == {"member": a.member_id, "start": 3, "end": 13}
    assert d.describe()["members"][0]["in_flight"] == 13  # the whole ahead lease counts
    d.advance(5_000)  # 0..3 expire; the ahead lease has no record yet, so nothing of it can
    # Redeliveries are still leased while the ahead lease lives; new records are its alone.
    assert spans(poll_ahead(d, a)) == [(0, 3, 2, "timeout")]
    assert poll_ahead(d, a).deliveries == []
    d.log_range("t", 0, 0, 6)  # 3, 4, 5 appear now: leased under the ahead lease from now
    assert d.partition()["in_flight"] == 3 + 3
    assert d.settle("ack", a, [["t", 0, lease, 3, 6]]).applied == 3
    d.advance(999)
    d.log_range("t", 0, 0, 20)  # fills the rest (6..13) and ends the ahead lease; 13.. are new
    assert d.partition()["ahead"] is None
    d.advance(1)  # 6..13 were leased 1 ms ago: still theirs; the redelivered 0..3 expire again
    assert spans(poll_ahead(d, a, max_records=100)) == [(0, 3, 3, "timeout"), (13, 20, 1, "new")]
    d.advance(999)
    assert spans(poll_ahead(d, a, max_records=100)) == [(6, 13, 2, "timeout")]

def test_acks_that_beat_the_log_end_report_count_when_the_records_appear():
    d = Driver(logs={("t", 0): (0, 0)})
    a = d.join()
    lease = poll_ahead(d, a, ahead=5).deliveries[0][2]
    # The member fetched 0..3 from the partition actor before the coordinator heard of them.
    assert d.settle("ack", a, [["t", 0, lease, 0, 3]]).applied == 3
    assert d.committed() == 0
    d.log_range("t", 0, 0, 2)
    assert d.committed() == 2
    d.log_range("t", 0, 0, 5)
    assert d.committed() == 3  # 3 and 4 leased, not acked
    assert d.settle("ack", a, [["t", 0, lease, 0, 5]]).applied == 5  # repeats are harmless
    assert d.committed() == 5 and d.describe()["members"][0]["in_flight"] == 0


def test_beyond_the_ahead_lease_and_other_ops_before_the_record_exists_are_stale():
    d = Driver(logs={("t", 0): (0, 0)})
    a = d.join()
    lease = poll_ahead(d, a, ahead=5).deliveries[0][2]
    err = d.settle("ack", a, [["t", 0, lease, 3, 8]])
    assert isinstance(err, StaleLease) and err.data["applied"] == 2 and err.data["stale"] == [["t", 0, lease, 5, 8]]
    err = d.settle("nack", a, [["t", 0, lease, 0, 1]])
    assert isinstance(err, StaleLease) and err.data["applied"] == 0


def test_an_ahead_lease_ends_with_its_generation():
    d = Driver(logs={("t", 0): (0, 0), ("t", 1): (0, 0)}, topics={"t": 2})
    a = d.join()
    reply = poll_ahead(d, a, ahead=10)  # split over the member's two partitions
    assert sorted(spans(reply)) == [(0, 5, 1, "ahead"), (0, 5, 1, "ahead")]
    b = d.join()  # a second member: new generation, every ahead lease of the group ends
    assert all(p["ahead"] is None for p in d.describe()["partitions"])
    a = d.resync(a)
    assert all(mem["in_flight"] == 0 for mem in d.describe()["members"])
    d.log_range("t", 0, 0, 4)
    owner = a if ("t", 0) in {tuple(k) for k in a.assignment} else b
    assert spans(d.poll(owner)) == [(0, 4, 1, "new")]  # ordinary leases again, nothing lost


def test_a_waiting_poll_is_not_woken_by_records_that_belong_to_the_ahead_lease():
    d = Driver(logs={("t", 0): (0, 0)})
    a = d.join()
    poll_ahead(d, a, ahead=10)
    assert poll_ahead(d, a, ahead=10, max_wait_ms=5_000, token="w") is PARKED
    d.log_range("t", 0, 0, 4)
    assert "w" not in d.answers
    d.advance(5_000)
    assert d.answers["w"].deliveries == []


def test_shared_groups_and_polls_without_ahead_never_lease_ahead():
    d = Driver(config=GroupConfig(mode="shared"), logs={("t", 0): (0, 0)})
    a = d.join()
    assert poll_ahead(d, a).deliveries == []
    d2 = Driver(logs={("t", 0): (0, 0)})
    b = d2.join()
    assert d2.poll(b).deliveries == []


def test_in_flight_limits_bound_the_ahead_lease_and_a_reset_ends_it():
    d = Driver(config=GroupConfig(max_in_flight=8), logs={("t", 0): (0, 0)})
    a = d.join()
    reply = poll_ahead(d, a, ahead=100)
    assert spans(reply) == [(0, 8, 1, "ahead")]
    d.ok("reset_group", m.ResetGroup(group="g", topic="t", to="earliest"))
    assert d.partition()["ahead"] is None and d.describe()["members"][0]["in_flight"] == 0
    err = d.settle("ack", a, [["t", 0, reply.deliveries[0][2], 0, 1]])
    assert isinstance(err, StaleLease)  # the member learns its ahead lease is over
