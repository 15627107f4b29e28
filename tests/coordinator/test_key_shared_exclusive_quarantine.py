"""Key quarantine in exclusive groups (key_quarantine.ExclusiveQuarantine), by hand.

An exclusive group keeps leasing in offset order, many records of one key at
once; only a parked key's records are held back, and leasing goes past them.
"""

from __future__ import annotations

import pytest

from zbroker.actors.group_coordinator.core import GroupConfig
from zbroker.actors.group_coordinator.effects import DeadLetter, FetchKeyHashes, Log
from zbroker.actors.group_coordinator.key_order import RELEASED
from zbroker.protocol import messages as m
from zbroker.protocol.batch import key_hash
from tests.coordinator.test_key_shared import KeyDriver


def exclusive(keys, after=2, **kw):
    config = GroupConfig(mode="exclusive", quarantine_after=after, max_deliveries=5, ack_timeout_ms=1_000)
    return KeyDriver({("t", 0): keys}, config=config, **kw)


def test_leasing_stays_in_bulk_and_in_order_while_nothing_is_parked():
    d = exclusive(["a", "a", "b", None, "a"])
    x = d.join()
    reply = d.poll(x)
    assert [(s, e) for _t, _p, _l, s, e, _a, _r in reply.deliveries] == [(0, 5)]  # one lease, same key twice
    assert [e for e in d.effects if isinstance(e, FetchKeyHashes)]


def test_nothing_is_leased_past_the_known_key_hashes_and_no_ahead_lease_is_granted():
    d = exclusive(["a", "b"], answer=False)
    x = d.join()
    assert d.ok("poll", m.Poll(group="g", member_id=x.member_id, generation=x.generation, max_records=10,
                               ahead=100)).deliveries == []
    fetch = [e for e in d.effects if isinstance(e, FetchKeyHashes)][-1]
    d.answer(fetch, limit=1)
    assert d.offsets(d.poll(x)) == [0]


def test_a_poison_key_is_parked_and_leasing_goes_past_its_records():
    d = exclusive(["p", "ok", "p", "ok", "p", "q"])
    x = d.join()
    first = d.poll(x, max_records=2)
    assert d.offsets(first) == [0, 1]
    lease = first.deliveries[0][2]
    d.settle("ack", x, [["t", 0, lease, 1, 2]])
    d.settle("nack", x, [["t", 0, lease, 0, 1]], reason="boom")
    second = d.poll(x, max_records=1)
    assert [(s, a, r) for _t, _p, _l, s, _e, a, r in second.deliveries] == [(0, 2, "nack:boom")]
    mark = d.mark()
    d.settle("nack", x, [["t", 0, second.deliveries[0][2], 0, 1]], reason="boom")
    assert [e.event for e in d.since(mark, Log)] == ["key_quarantined"]
    rest = d.poll(x)
    assert d.offsets(rest) == [3, 5]  # p@2 and p@4 are held; ok and q flow
    d.ack_all(x, rest)
    d.append("t", 0, ["p", "z"])
    assert d.offsets(d.poll(x)) == [7]
    rows = d.ok("list_quarantine", m.ListQuarantine(group="g")).keys
    assert [(r["key_hash"], r["first_offset"], r["held"], r["failures"]) for r in rows] == [
        (key_hash(b"p"), 0, 4, 2)]
    part = d.partition()
    assert part["committed_pending"] == 0 and part["blocker"]["state"] == "quarantined"
    assert d.dead_letters() == []


def test_a_parked_keys_record_that_was_already_in_flight_is_held_when_it_fails():
    d = exclusive(["p", "p", "q"], after=2)
    x = d.join()
    got = d.poll(x)
    assert d.offsets(got) == [0, 1, 2]
    d.settle("nack", x, [["t", 0, got.deliveries[0][2], 0, 1]])
    again = d.poll(x)
    assert d.offsets(again) == [0]
    d.settle("nack", x, [["t", 0, again.deliveries[0][2], 0, 1]])  # the second failure in a row parks p
    d.advance(1_000)  # p@1 and q@2 time out (their first failure): p@1 is held, q@2 comes back
    assert d.offsets(d.poll(x)) == [2]
    rows = d.ok("list_quarantine", m.ListQuarantine(group="g")).keys
    assert rows[0]["held"] == 2


def test_release_to_flow_redelivers_the_held_records_in_order_attempts_afresh():
    d = exclusive(["p", "x", "p"], after=1)
    x = d.join()
    got = d.poll(x, max_records=1)
    d.settle("nack", x, [["t", 0, got.deliveries[0][2], 0, 1]])
    middle = d.poll(x)
    assert d.offsets(middle) == [1]
    d.ack_all(x, middle)
    d.ok("release_key", m.ReleaseKey(group="g", key="p"))
    again = d.poll(x)
    assert [(s, e, a, r) for _t, _p, _l, s, e, a, r in again.deliveries] == [(0, 1, 1, RELEASED),
                                                                              (2, 3, 1, RELEASED)]
    d.ack_all(x, again)
    assert d.committed() == 3


def test_release_to_the_dead_letter_topic_copies_the_held_records():
    d = exclusive(["p", "p", "q"], after=1)
    x = d.join()
    got = d.poll(x, max_records=1)
    d.settle("nack", x, [["t", 0, got.deliveries[0][2], 0, 1]])
    rest = d.poll(x)
    assert d.offsets(rest) == [2]
    d.ack_all(x, rest)
    mark = d.mark()
    assert d.ok("release_key", m.ReleaseKey(group="g", key="p", to_dlq=True)).released[0]["records"] == 2
    letters = d.since(mark, DeadLetter)
    assert [e.offset for e in letters] == [0, 1]
    for e in letters:
        d.feed(d.core.on_dead_letter_done(e, d.now))
    assert d.committed() == 3


def test_turning_quarantine_off_makes_the_held_records_ready_again():
    d = exclusive(["p", "p"], after=1)
    x = d.join()
    got = d.poll(x, max_records=1)
    d.settle("nack", x, [["t", 0, got.deliveries[0][2], 0, 1]])
    assert d.offsets(d.poll(x)) == []
    d.ok("configure_group", m.ConfigureGroup(group="g", quarantine_after=0))
    x = d.resync(x)
    assert d.offsets(d.poll(x)) == [0, 1]


# -- the quarantine across a coordinator restart (persisted with the holes) --------------

def park_p(d: KeyDriver, x) -> None:
    """Fail the first record (key p) until its key is parked (quarantine_after=1)."""
    got = d.poll(x, max_records=1)
    assert d.offsets(got) == [0]
    d.settle("nack", x, [["t", 0, got.deliveries[0][2], 0, 1]], reason="boom")


@pytest.mark.parametrize("mode", ["exclusive", "key_shared"])
def test_the_quarantine_is_persisted_with_the_holes_and_survives_a_restart(mode):
    config = GroupConfig(mode=mode, quarantine_after=1, max_deliveries=5)
    keys = ["p", "q", "p", "r"]
    d = KeyDriver({("t", 0): keys}, config=config)
    x = d.join()
    mark = d.mark()
    park_p(d, x)
    persisted = d.persisted(mark)[-1]
    assert persisted.quarantine == [[key_hash(b"p"), 1, "nack:boom"]]
    assert persisted.as_advance()[7] == persisted.quarantine
    rest = d.poll(x)
    assert d.offsets(rest) == [1, 3]
    d.ack_all(x, rest)
    rows = [d.persisted()[-1].as_advance()]

    again = KeyDriver({("t", 0): keys}, config=config, rows=rows, lease_id_base=10**6)
    listed = again.ok("list_quarantine", m.ListQuarantine(group="g")).keys
    assert [(r["key_hash"], r["failures"], r["reason"]) for r in listed] == [(key_hash(b"p"), 1, "nack:boom")]
    y = again.join()
    assert again.offsets(again.poll(y)) == []  # p@0 and p@2 are held, not redelivered as "restart"
    assert again.partition()["blocker"]["state"] == "quarantined"
    listed = again.ok("list_quarantine", m.ListQuarantine(group="g")).keys
    assert listed[0]["first_offset"] == 0 and listed[0]["held"] == 2
    mark = again.mark()
    again.ok("release_key", m.ReleaseKey(group="g", key="p"))
    assert again.persisted(mark)[-1].quarantine == []  # the release is persisted too
    assert len(again.persisted(mark)[-1].as_advance()) == 7
    flowed = []
    for _ in range(3):
        got = again.poll(y)
        flowed += again.offsets(got)
        again.ack_all(y, got)
    assert flowed == [0, 2] and again.committed() == 4


def test_a_stored_quarantine_of_a_group_that_no_longer_quarantines_is_dropped():
    rows = [["g", "t", 0, 0, [], 1, 0, [[key_hash(b"p"), 3, "nack"]]]]
    d = KeyDriver({("t", 0): ["p"]}, config=GroupConfig(mode="exclusive"), rows=rows)
    assert d.ok("list_quarantine", m.ListQuarantine(group="g")).keys == []
    x = d.join()
    assert d.offsets(d.poll(x)) == [0]
