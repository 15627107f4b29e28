"""Acks riding on a poll (Poll.acks): applied like an `ack`, before the poll leases anything."""

from zbroker.actors.group_coordinator.core import GroupConfig
from zbroker.protocol import messages as m
from zbroker.protocol.errors import Fenced
from tests.coordinator import PARKED, Driver


def poll_acking(d: Driver, member, acks: list, max_records: int = 1000, max_wait_ms: int = 0, token=None):
    return d.call("poll", m.Poll(group="g", member_id=member.member_id, generation=member.generation,
                                 max_records=max_records, max_wait_ms=max_wait_ms, acks=acks), token=token)


def spans(reply):
    return [(s, e, attempt, reason) for _t, _p, _l, s, e, attempt, reason in reply.deliveries]


def test_the_acks_count_and_commit_exactly_as_an_ack_would():
    d = Driver(logs={("t", 0): (0, 10)})
    a = d.join()
    lease = d.poll(a, max_records=4).deliveries[0][2]
    reply = poll_acking(d, a, [["t", 0, lease, 0, 2], ["t", 0, lease, 3, 4]], max_records=3)
    assert reply.acked == 3 and reply.stale == []
    assert spans(reply) == [(4, 7, 1, "new")]
    assert d.committed() == 2  # 2 is not finished: the commit stops below it
    again = poll_acking(d, a, [["t", 0, lease, 0, 4]], max_records=1)  # repeats are harmless
    assert again.acked == 4 and d.committed() == 4


def test_the_capacity_the_acks_free_is_leased_by_the_same_poll():
    d = Driver(config=GroupConfig(max_in_flight=5), logs={("t", 0): (0, 20)})
    a = d.join()
    lease = d.poll(a).deliveries[0][2]
    assert d.poll(a).deliveries == []  # at the limit
    reply = poll_acking(d, a, [["t", 0, lease, 0, 5]])
    assert spans(reply) == [(5, 10, 1, "new")]


def test_stale_acks_are_reported_in_the_reply_and_the_poll_still_leases():
    d = Driver(config=GroupConfig(ack_timeout_ms=1_000), logs={("t", 0): (0, 10)})
    a = d.join()
    lease = d.poll(a, max_records=4).deliveries[0][2]
    d.advance(1_000)  # expired: 0..4 are ready again
    reply = poll_acking(d, a, [["t", 0, lease, 0, 4], ["t", 0, 999_999, 7, 8]], max_records=10)
    assert reply.acked == 0
    assert reply.stale == [["t", 0, lease, 0, 4], ["t", 0, 999_999, 7, 8]]
    assert spans(reply) == [(0, 4, 2, "timeout"), (4, 10, 1, "new")]
    assert d.committed() == 0  # never silently applied


def test_a_poll_that_waits_applies_its_acks_at_once_and_reports_them_when_answered():
    d = Driver(logs={("t", 0): (0, 3)})
    a = d.join()
    lease = d.poll(a).deliveries[0][2]
    assert poll_acking(d, a, [["t", 0, lease, 0, 3]], max_wait_ms=500, token="w") is PARKED
    assert d.committed() == 3  # applied while the poll waits
    effects = d.log_range("t", 0, 0, 5)
    (reply,) = [e.msg for e in effects if getattr(e, "token", None) == "w"]
    assert reply.acked == 3 and spans(reply) == [(3, 5, 1, "new")]
    assert poll_acking(d, a, [["t", 0, 424242, 0, 1]], max_wait_ms=500, token="x") is PARKED
    (empty,) = [e.msg for e in d.advance(500) if getattr(e, "token", None) == "x"]
    assert empty.deliveries == [] and empty.acked == 0 and empty.stale == [["t", 0, 424242, 0, 1]]


def test_a_fenced_poll_applies_none_of_its_acks():
    d = Driver(logs={("t", 0): (0, 3)})
    a = d.join()
    lease = d.poll(a).deliveries[0][2]
    d.join()  # a second member: a new generation, `a` is fenced until it re-joins
    err = poll_acking(d, a, [["t", 0, lease, 0, 3]])
    assert isinstance(err, Fenced)
    assert d.committed() == 0


def test_a_waiting_poll_fenced_by_a_rebalance_says_its_acks_were_applied():
    d = Driver(logs={("t", 0): (0, 3)})
    a = d.join()
    lease = d.poll(a).deliveries[0][2]
    assert poll_acking(d, a, [["t", 0, lease, 0, 3], ["t", 0, 5_555, 0, 1]], max_wait_ms=5_000, token="w") is PARKED
    d.join()  # a second member: the waiting poll is answered FENCED
    err = d.answers["w"]
    assert isinstance(err, Fenced)
    assert err.data["acked"] == 3 and err.data["stale"] == [["t", 0, 5_555, 0, 1]]
    assert d.committed() == 3
