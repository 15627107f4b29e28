"""The chaos consumer dates each lease by the poll() call that sent its Poll, not the one that handed it out."""

from __future__ import annotations

from types import SimpleNamespace

from tests.chaos.workload import LeaseClock


def records(lease_id: int, *offsets: int) -> list:
    return [SimpleNamespace(partition=0, lease_id=lease_id, offset=o) for o in offsets]


def test_a_poll_sent_ahead_dates_its_leases_from_the_call_that_sent_it():
    clock, ahead, next_ahead = LeaseClock(), object(), object()
    clock.polled(100, None, ahead)  # returned records of its own Poll, and sent the next one ahead
    clock.polled(200, ahead, next_ahead)  # handed out the ahead Poll's leases
    assert clock.group(records(7, 1, 2)) == {100: records(7, 1, 2)}
    clock.polled(300, next_ahead, None)
    # Held back by max_records earlier, lease 7 keeps its date; lease 8 came with the Poll sent at 200.
    assert clock.group(records(7, 3) + records(8, 4)) == {100: records(7, 3), 200: records(8, 4)}


def test_a_poll_kept_in_flight_past_an_empty_call_is_dated_by_the_call_that_sent_it():
    clock, kept = LeaseClock(), object()
    clock.polled(400, None, kept)  # timed out empty: the Poll stays in flight
    clock.polled(500, kept, kept)  # again
    clock.polled(600, kept, None)  # its reply came
    assert clock.group(records(9, 5)) == {400: records(9, 5)}


def test_without_a_poll_in_flight_a_lease_is_dated_by_the_call_itself():
    clock = LeaseClock()
    clock.polled(700, None, None)
    assert clock.group(records(10, 6)) == {700: records(10, 6)}


def test_an_ahead_lease_is_dated_when_it_is_filed_not_when_its_records_arrive():
    clock = LeaseClock()
    clock.polled(800, None, None, {("t", 0): [[11, 50, 60]]})  # an ahead lease on offsets 50-59, none there yet
    clock.polled(900, None, None, {("t", 0): [[11, 52, 60]]})  # its first records arrived and went out
    assert clock.group(records(11, 50, 51)) == {800: records(11, 50, 51)}
