"""The consumer core's side of ahead leases, without sockets: what it hands out and in which order."""

from __future__ import annotations

from tests.unit.test_read_ahead import KEY, stored
from zbroker.client.consumer_core import ConsumerCore


def bare_consumer() -> ConsumerCore:
    return ConsumerCore(group="g", topics=["t"], lease_ahead=True)


def served(core: ConsumerCore, max_records: int) -> list:
    parts, damaged = core.serve_ahead(max_records)
    assert damaged == []
    return parts


def frame_arrived(consumer: ConsumerCore, frame: bytes, asked_from: int) -> None:
    consumer.ahead.sent(KEY, 99, asked_from)
    consumer.ahead.arrived(KEY, 99, frame)


def test_records_are_handed_out_under_the_ahead_lease_as_they_arrive_and_no_further():
    c = bare_consumer()
    assert c.take_ahead_leases([["t", 0, 7, 0, 10, 1, "ahead"]]) == []
    assert served(c, 100) == []  # nothing has arrived
    frame_arrived(c, stored(0, 4), 0)
    parts = served(c, 100)
    assert [[(r.offset, r.lease_id, r.attempt, r.reason) for r in p] for p in parts] == \
        [[(o, 7, 1, "new") for o in range(4)]]
    frame_arrived(c, stored(4, 20), 4)  # more than the lease: offsets 10.. belong to no lease yet
    assert [r.offset for p in served(c, 100) for r in p] == list(range(4, 10))
    assert c.ahead_leases == {}  # used up


def test_max_records_bounds_what_is_handed_out():
    c = bare_consumer()
    c.take_ahead_leases([["t", 0, 7, 0, 10, 1, "ahead"]])
    frame_arrived(c, stored(0, 10), 0)
    assert [r.offset for p in served(c, 3) for r in p] == [0, 1, 2]
    assert c.ahead_leases[KEY] == [[7, 3, 10]]


def test_the_tail_of_a_filled_ahead_lease_goes_before_the_ordinary_lease_after_it():
    # The coordinator leases 10.. the ordinary way once the log passed the ahead lease's end,
    # which can be before this consumer handed out 3..10. Read-ahead keeps one position per
    # partition: serving 10.. first would drop the frames of 3..10, and they would come back
    # only when their leases expire.
    c = bare_consumer()
    c.take_ahead_leases([["t", 0, 7, 0, 10, 1, "ahead"]])
    frame_arrived(c, stored(0, 3), 0)
    served(c, 100)
    to_fetch = c.take_ahead_leases([["t", 0, 8, 10, 20, 1, "new"]])
    assert to_fetch == [["t", 0, 7, 3, 10, 1, "new"], ["t", 0, 8, 10, 20, 1, "new"]]
    assert c.ahead_leases == {}


def test_redeliveries_below_an_ahead_lease_leave_it_alone_and_a_second_one_waits_its_turn():
    c = bare_consumer()
    c.take_ahead_leases([["t", 0, 7, 50, 60, 1, "ahead"]])
    assert c.take_ahead_leases([["t", 0, 5, 10, 12, 2, "timeout"], ["t", 0, 9, 60, 70, 1, "ahead"]]) == \
        [["t", 0, 5, 10, 12, 2, "timeout"]]
    assert c.ahead_leases[KEY] == [[7, 50, 60], [9, 60, 70]]
    frame_arrived(c, stored(50, 15), 50)
    assert [(r.offset, r.lease_id) for p in served(c, 100) for r in p] == \
        [(o, 7) for o in range(50, 60)] + [(o, 9) for o in range(60, 65)]
    assert c.ahead_leases[KEY] == [[9, 65, 70]]
