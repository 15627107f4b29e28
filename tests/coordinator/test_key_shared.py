"""key_shared groups and key quarantine, driven by hand through the pure core.

`KeyDriver` plays the shell's part of answering `FetchKeyHashes` from a list of
keys per partition (what the partition log holds), so the tests read as
"these records exist with these keys".
"""

from __future__ import annotations

from zbroker.actors.group_coordinator.core import GroupConfig
from zbroker.actors.group_coordinator.effects import DeadLetter, FetchKeyHashes, Log
from zbroker.actors.group_coordinator.key_order import RELEASED
from zbroker.protocol import messages as m
from zbroker.protocol.batch import NO_KEY_HASH, key_hash
from tests.coordinator import Driver


class KeyDriver(Driver):
    """A driver whose partitions hold records with the given keys (None: keyless)."""

    def __init__(self, keys: dict[tuple[str, int], list], *, answer: bool = True, **kw) -> None:
        self.keys = {k: list(v) for k, v in keys.items()}
        self.answer_fetches = answer
        kw.setdefault("config", GroupConfig(mode="key_shared"))
        super().__init__(topics={"t": max(p for _t, p in keys) + 1}, **kw)
        for (topic, p), records in self.keys.items():
            self.log_range(topic, p, 0, len(records))

    def feed(self, effects: list) -> list:
        out = super().feed(effects)
        if getattr(self, "answer_fetches", False):
            for e in [e for e in effects if isinstance(e, FetchKeyHashes)]:
                self.answer(e)
        return out

    def answer(self, e: FetchKeyHashes, limit: int = 10_000) -> None:
        records = self.keys[(e.topic, e.partition)][e.start:e.start + limit]
        hashes = [key_hash(None if k is None else str(k).encode()) for k in records]
        self.feed(self.core.on_key_hashes(e, e.start, hashes, self.now))

    def append(self, topic: str, p: int, keys: list) -> None:
        self.keys[(topic, p)].extend(keys)
        self.log_range(topic, p, 0, len(self.keys[(topic, p)]))

    def members(self, n: int) -> list:
        joined = [self.join() for _ in range(n)]
        return [self.resync(j) for j in joined]  # everyone in the last generation

    def offsets(self, reply) -> list[int]:
        return [o for _t, _p, _l, s, e, _a, _r in reply.deliveries for o in range(s, e)]

    def ack_all(self, member, reply) -> None:
        ranges = [[t, p, lease, s, e] for t, p, lease, s, e, _a, _r in reply.deliveries]
        if ranges:
            assert self.settle("ack", member, ranges).applied == sum(r[4] - r[3] for r in ranges)


def test_one_record_per_key_in_flight_and_keyless_records_flow_freely():
    d = KeyDriver({("t", 0): ["a", "a", "b", None, "a", None, "b", "c"]})
    x, y = d.members(2)
    first = d.poll(x)
    # a@0, b@2, keyless 3 and 5, c@7; a@1, a@4 and b@6 wait behind their keys.
    assert d.offsets(first) == [0, 2, 3, 5, 7]
    assert d.offsets(d.poll(y)) == []
    d.ack_all(x, first)
    second = d.poll(y)
    assert d.offsets(second) == [1, 6]  # the next record of a and of b, to whoever polls
    d.ack_all(y, second)
    third = d.poll(x)
    assert d.offsets(third) == [4]
    d.ack_all(x, third)
    assert d.committed() == 8
    assert d.partition()["keys_pending"] == 0 and d.partition()["held"] == 0


def test_a_key_waits_for_its_record_to_be_finished_not_only_delivered():
    d = KeyDriver({("t", 0): ["a", "a"]}, config=GroupConfig(mode="key_shared", ack_timeout_ms=1_000))
    x, y = d.members(2)
    lease = d.poll(x).deliveries[0]
    assert d.offsets(d.poll(y)) == []
    d.advance(1_000)  # expired: offset 0 again, before 1
    again = d.poll(y)
    assert [(s, e, a, r) for _t, _p, _l, s, e, a, r in again.deliveries] == [(0, 1, 2, "timeout")]
    d.settle("nack", y, [["t", 0, again.deliveries[0][2], 0, 1]])
    assert d.offsets(d.poll(x)) == [0]
    assert lease[3] == 0


def test_hashes_not_known_yet_lease_nothing_keyed_and_the_core_asks_for_them():
    d = KeyDriver({("t", 0): ["a", "b"]}, answer=False)
    x = d.join()
    assert d.poll(x).deliveries == []
    fetches = [e for e in d.effects if isinstance(e, FetchKeyHashes)]
    assert fetches and fetches[-1].start == 0
    assert not [e for e in d.core.tick(d.now) if isinstance(e, FetchKeyHashes)]  # one at a time
    d.answer(fetches[-1], limit=1)
    assert d.offsets(d.poll(x)) == [0]
    more = [e for e in d.effects if isinstance(e, FetchKeyHashes)]
    assert more[-1].start == 1


def test_a_failed_hash_fetch_is_retried():
    d = KeyDriver({("t", 0): ["a"]}, answer=False)
    x = d.join()
    fetch = [e for e in d.effects if isinstance(e, FetchKeyHashes)][-1]
    d.feed(d.core.on_key_hashes(fetch, None, None, d.now))
    assert d.core.next_deadline() is not None
    mark = d.mark()
    d.advance(1_000)
    retry = d.since(mark, FetchKeyHashes)
    assert retry and retry[0].start == 0
    d.answer(retry[0])
    assert d.offsets(d.poll(x)) == [0]


def test_the_key_limit_pauses_new_leasing_and_says_so():
    d = KeyDriver({("t", 0): ["a", "b", "c", "a"]}, config=GroupConfig(mode="key_shared", max_keys=2))
    x = d.join()
    reply = d.poll(x)
    assert d.offsets(reply) == [0, 1]
    part = d.partition()
    assert part["key_limit_reached"] is True and part["keys_pending"] == 2
    d.ack_all(x, reply)
    assert d.offsets(d.poll(x)) == [2, 3]
    assert d.partition()["key_limit_reached"] is False


def test_a_member_leaving_gives_its_keys_to_the_others_in_order():
    d = KeyDriver({("t", 0): ["a", "a", "b"]})
    x, y = d.members(2)
    assert d.offsets(d.poll(x)) == [0, 2]
    y = d.resync(y)
    d.ok("leave", m.Leave(group="g", member_id=x.member_id, generation=x.generation))
    y = d.resync(y)
    got = d.poll(y)
    assert d.offsets(got) == [0, 2]
    d.ack_all(y, got)
    assert d.offsets(d.poll(y)) == [1]


def quarantine_driver(keys, after=2, **kw):
    return KeyDriver({("t", 0): keys}, config=GroupConfig(mode="key_shared", quarantine_after=after,
                                                           max_deliveries=5), **kw)


def test_a_key_failing_n_times_is_quarantined_and_the_others_flow():
    d = quarantine_driver(["p", "ok", "p", "ok2"])
    x = d.join()
    first = d.poll(x)
    assert d.offsets(first) == [0, 1, 3]
    lease = first.deliveries[0][2]
    d.settle("ack", x, [["t", 0, lease, 1, 2], ["t", 0, lease, 3, 4]])
    d.settle("nack", x, [["t", 0, lease, 0, 1]], reason="boom")
    second = d.poll(x)
    assert d.offsets(second) == [0]
    mark = d.mark()
    d.settle("nack", x, [["t", 0, second.deliveries[0][2], 0, 1]], reason="boom")
    assert [e.event for e in d.since(mark, Log)] == ["key_quarantined"]
    assert d.offsets(d.poll(x)) == []
    d.append("t", 0, ["p", "ok3"])
    assert d.offsets(d.poll(x)) == [5]  # the new record of p is held, ok3 flows
    rows = d.ok("list_quarantine", m.ListQuarantine(group="g")).keys
    assert [(r["key_hash"], r["first_offset"], r["held"], r["failures"], r["reason"]) for r in rows] == [
        (key_hash(b"p"), 0, 3, 2, "nack:boom")]
    blocker = d.partition()["blocker"]
    assert blocker["state"] == "quarantined" and blocker["offset"] == 0
    assert d.dead_letters() == []


def test_release_to_flow_delivers_the_key_again_in_order():
    d = quarantine_driver(["p", "p"], after=1)
    x = d.join()
    got = d.poll(x)
    d.settle("nack", x, [["t", 0, got.deliveries[0][2], 0, 1]])
    assert d.offsets(d.poll(x)) == []
    released = d.ok("release_key", m.ReleaseKey(group="g", key="p")).released
    assert released == [{"topic": "t", "partition": 0, "key_hash": key_hash(b"p"), "records": 0}]
    again = d.poll(x)
    assert [(s, a, r) for _t, _p, _l, s, _e, a, r in again.deliveries] == [(0, 1, RELEASED)]
    d.ack_all(x, again)
    last = d.poll(x)
    assert d.offsets(last) == [1]
    d.ack_all(x, last)
    assert d.committed() == 2 and d.ok("list_quarantine", m.ListQuarantine(group="g")).keys == []


def test_release_to_the_dead_letter_topic_copies_every_held_record_of_the_key():
    d = quarantine_driver(["p", "p", "q", "p"], after=1)
    x = d.join()
    got = d.poll(x)
    assert d.offsets(got) == [0, 2]
    d.settle("nack", x, [["t", 0, got.deliveries[0][2], 0, 1]])
    d.settle("ack", x, [["t", 0, got.deliveries[0][2], 2, 3]])
    mark = d.mark()
    released = d.ok("release_key", m.ReleaseKey(group="g", key_hash=key_hash(b"p"), to_dlq=True)).released
    assert released[0]["records"] == 3
    letters = d.since(mark, DeadLetter)
    assert [(e.offset, e.last_reason) for e in letters] == [(0, "quarantine_release"), (1, "quarantine_release"),
                                                            (3, "quarantine_release")]
    for e in letters:
        d.feed(d.core.on_dead_letter_done(e, d.now))
    assert d.committed() == 4


def test_releasing_a_key_that_is_not_parked_releases_nothing():
    d = quarantine_driver(["p"])
    d.join()
    assert d.ok("release_key", m.ReleaseKey(group="g", key="p")).released == []


def test_keyless_records_are_never_quarantined():
    d = quarantine_driver([None], after=1)
    x = d.join()
    got = d.poll(x)
    d.settle("nack", x, [["t", 0, got.deliveries[0][2], 0, 1]])
    assert d.offsets(d.poll(x)) == [0]


def test_key_hash_reserves_zero_for_keyless_records():
    assert key_hash(None) == NO_KEY_HASH
    assert key_hash(b"") != NO_KEY_HASH and key_hash(b"a") == key_hash(b"a") != key_hash(b"b")


def test_shared_and_exclusive_groups_never_fetch_key_hashes():
    for mode in ("shared", "exclusive"):
        d = KeyDriver({("t", 0): ["a", "a"]}, config=GroupConfig(mode=mode))
        x = d.join()
        assert d.offsets(d.poll(x)) == [0, 1]
        assert not [e for e in d.effects if isinstance(e, FetchKeyHashes)]
