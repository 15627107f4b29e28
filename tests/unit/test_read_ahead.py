"""The consumer's read-ahead: which bytes it holds, which fetches it asks for, what it forgets."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zbroker.protocol.batch import build_batch_header, decode_fetched, encode_records, stored_range
from zbroker.protocol.errors import CorruptBatch
from zbroker.client.core import ConsumedRecord, ReadAhead

KEY = ("t", 0)


def stored(base: int, count: int, size: int = 10) -> bytes:
    """A fetch reply frame: one stored batch of `count` records from `base`."""
    payload = encode_records([[1, None, bytes([base % 256]) * size, None] for _ in range(count)])
    return build_batch_header(payload, base_offset=base, record_count=count, append_time_ms=1) + payload


def test_stored_range_reads_headers_only():
    frame = stored(10, 5) + stored(15, 3)
    assert stored_range(frame) == (10, 18)
    assert stored_range(b"") is None
    with pytest.raises(CorruptBatch):
        stored_range(frame[:-1])  # a torn last batch is not silently shortened


@given(st.lists(st.integers(1, 20), min_size=1, max_size=6), st.data())
def test_decoding_any_window_gives_exactly_its_offsets(counts, data):
    frame, base = b"", 100
    for n in counts:
        frame += stored(base, n)
        base += n
    lo = data.draw(st.integers(90, base + 5))
    hi = data.draw(st.integers(lo, base + 10))
    got = decode_fetched(frame, "t", 0, from_offset=lo, until_offset=hi, make=ConsumedRecord, extra=(7, 2, "r"))
    assert [r.offset for r in got] == list(range(max(lo, 100), min(hi, base)))
    assert all(r.lease_id == 7 and r.attempt == 2 and r.reason == "r" and r.topic == "t" for r in got)


def test_nothing_is_fetched_ahead_before_a_first_lease():
    assert ReadAhead().wanted() == []


def test_after_a_lease_it_fetches_where_the_next_one_starts():
    ahead = ReadAhead(fetch_bytes=4096)
    ahead.leased(KEY, 0, 100)
    assert ahead.wanted() == [(KEY, 100, 4096)]
    ahead.sent(KEY, corr=7, offset=100)
    assert ahead.wanted() == []  # one fetch out per partition
    assert ahead.awaited(KEY, 100) == 7 and ahead.awaited(KEY, 150) == 7
    assert ahead.awaited(KEY, 99) is None  # a fetch from 100 cannot bring 99


def test_a_frame_that_came_back_serves_the_next_lease():
    ahead = ReadAhead()
    ahead.leased(KEY, 0, 100)
    ahead.sent(KEY, 1, 100)
    frame = stored(100, 50)
    ahead.arrived(KEY, 1, frame)
    assert ahead.covering(KEY, 100) is frame and ahead.covering(KEY, 149) is frame
    assert ahead.covering(KEY, 150) is None
    # The next fetch starts after what is held, not at the lease's end again.
    assert [w[1] for w in ahead.wanted()] == [150]


def test_frames_behind_every_lease_are_dropped():
    ahead = ReadAhead()
    ahead.leased(KEY, 0, 100)
    ahead.sent(KEY, 1, 100)
    ahead.arrived(KEY, 1, stored(100, 50))
    ahead.leased(KEY, 100, 150)
    ahead.wanted()
    assert ahead.held_bytes() == 0 and ahead.covering(KEY, 120) is None


def test_an_empty_reply_holds_nothing_and_a_failure_forgets_the_partition():
    ahead = ReadAhead()
    ahead.leased(KEY, 0, 10)
    ahead.sent(KEY, 1, 10)
    ahead.arrived(KEY, 1, b"")  # the parked fetch timed out: nothing new yet
    assert ahead.held_bytes() == 0 and [w[1] for w in ahead.wanted()] == [10]
    ahead.sent(KEY, 2, 10)
    ahead.arrived(KEY, 2, None)  # NOT_OWNER, a timeout...: start over from the next lease
    assert ahead.wanted() == []


def test_replies_to_fetches_it_gave_up_on_are_ignored():
    ahead = ReadAhead()
    ahead.leased(KEY, 0, 10)
    ahead.sent(KEY, 1, 10)
    ahead.arrived(KEY, 99, stored(10, 5))
    assert ahead.held_bytes() == 0 and ahead.awaited(KEY, 10) == 1


def test_redelivered_leases_below_the_cursor_do_not_move_it_back():
    ahead = ReadAhead()
    ahead.leased(KEY, 100, 200)
    ahead.leased(KEY, 10, 20)  # an expired lease coming back
    assert [w[1] for w in ahead.wanted()] == [200]


def test_memory_is_bounded_per_partition_and_in_total():
    ahead = ReadAhead(max_bytes=3000, ahead_bytes=1500, fetch_bytes=1000)
    keys = [("t", p) for p in range(4)]
    for k in keys:
        ahead.leased(k, 0, 1)
    wanted = ahead.wanted()
    assert len(wanted) == 3  # the fourth would pass max_bytes
    for i, (k, offset, _n) in enumerate(wanted):
        ahead.sent(k, i, offset)
    big = stored(1, 100, size=20)  # ~2.5 kB: more than ahead_bytes on its own
    ahead.arrived(keys[0], 0, big)
    assert all(w[0] != keys[0] for w in ahead.wanted())  # partition 0 holds enough


def test_retain_drops_revoked_partitions_and_returns_their_fetches():
    ahead = ReadAhead()
    for p in range(3):
        ahead.leased(("t", p), 0, 5)
        ahead.sent(("t", p), 10 + p, 5)
    orphans = ahead.retain([("t", 1)])
    assert sorted(orphans) == [(10, 10), (12, 12)]
    assert ahead.awaited(("t", 0), 5) is None and ahead.awaited(("t", 1), 5) == 11
    assert ahead.clear() == [(11, 11)]


def test_in_flight_lists_the_fetches_out():
    ahead = ReadAhead()
    ahead.leased(KEY, 0, 5)
    ahead.leased(("t", 1), 0, 5)
    ahead.sent(KEY, 3, 5)
    assert ahead.in_flight() == [(KEY, 3)]
    ahead.arrived(KEY, 3, b"")
    assert ahead.in_flight() == []


# -- a fetch that follows the log end: one reply per append, ids id, id + 1, ... -------------

def test_a_followed_fetch_stays_out_while_its_replies_say_more():
    ahead = ReadAhead()
    ahead.leased(KEY, 0, 10)
    ahead.sent(KEY, 40, 10, follow=3)  # replies may come as 40, 41, 42, 43
    assert ahead.arrived(KEY, 40, stored(10, 2), more=True) == 41
    assert ahead.in_flight() == [(KEY, 41)] and ahead.awaited(KEY, 12) == 41 and ahead.awaited(KEY, 11) is None
    assert ahead.wanted() == []  # no second fetch while this one follows
    assert ahead.arrived(KEY, 41, stored(12, 1), more=True) == 42
    assert ahead.arrived(KEY, 42, stored(13, 4), more=False) is None  # it ended: fetch again
    assert ahead.in_flight() == [] and [w[1] for w in ahead.wanted()] == [17]
    assert [(c[0], c[1]) for c in ahead._slots[KEY].chunks] == [(10, 12), (12, 13), (13, 17)]


def test_the_last_reserved_id_ends_a_followed_fetch_even_if_it_says_more():
    ahead = ReadAhead()
    ahead.leased(KEY, 0, 10)
    ahead.sent(KEY, 40, 10, follow=1)
    assert ahead.arrived(KEY, 40, stored(10, 1), more=True) == 41
    assert ahead.arrived(KEY, 41, stored(11, 1), more=True) is None
    assert ahead.in_flight() == []


def test_dropping_a_followed_fetch_orphans_every_id_it_may_still_get():
    ahead = ReadAhead()
    ahead.leased(KEY, 0, 10)
    ahead.sent(KEY, 40, 10, follow=3)
    ahead.arrived(KEY, 40, stored(10, 1), more=True)
    assert ahead.drop(KEY) == [(41, 43)]
    assert ahead.drop(KEY) == []


def test_a_reply_overtaken_by_a_later_one_of_its_fetch_was_dropped():
    ahead = ReadAhead()
    ahead.leased(KEY, 0, 10)
    ahead.sent(KEY, 40, 10, follow=3)
    assert not ahead.overtaken(KEY, {40, 41})  # the awaited one is there
    assert ahead.overtaken(KEY, {41}) and ahead.overtaken(KEY, {42}) and ahead.overtaken(KEY, {43})
    ahead.sent(KEY, 50, 10, follow=0)
    assert not ahead.overtaken(KEY, {51, 52})  # ids past the fetch's last belong to other requests


def test_a_fetch_whose_reply_is_overdue_is_named_and_a_followed_one_gets_time_again_per_reply():
    # An actor killed with the fetch parked never answers: the consumer must learn that the
    # fetch is dead, or a partition served only through it (an ahead lease) waits for ever.
    ahead = ReadAhead()
    ahead.leased(KEY, 0, 10)
    ahead.sent(KEY, 40, 10, follow=3, patience=5.0, now=100.0)
    assert ahead.overdue(104.9) == [] and ahead.overdue(105.0) == [KEY]
    assert ahead.arrived(KEY, 40, stored(10, 1), more=True, now=104.0) == 41
    assert ahead.overdue(108.9) == [] and ahead.overdue(109.0) == [KEY]  # from its last reply
    ahead.arrived(KEY, 41, b"", more=False, now=109.0)
    assert ahead.overdue(1e9) == []  # it ended: nothing is out
    ahead.sent(KEY, 50, 11)  # without a patience: never overdue
    assert ahead.overdue(1e9) == []
