"""Idempotent producers: a retried batch is answered with its original offsets, across reopen."""

import pytest

from zbroker.protocol.errors import DuplicateSequence
from zbroker.storage.log.producers import REMEMBERED_BATCHES
from tests.log.support import make_payload, open_log, read_all

PRODUCER = 7


def produce(plog, sequence, count=3, producer_id=PRODUCER):
    """What the partition actor does: check, then append only when new."""
    earlier = plog.check_sequence(producer_id, sequence)
    if earlier is not None:
        return earlier
    base = plog.append(make_payload(sequence, count), count, append_time_ms=0, producer_id=producer_id,
                       producer_seq=sequence)
    return base, count


def test_a_retried_sequence_returns_the_original_batch(tmp_path):
    with open_log(tmp_path) as plog:
        assert produce(plog, 0) == (0, 3)
        assert produce(plog, 1, count=2) == (3, 2)
        assert produce(plog, 0) == (0, 3)
        assert produce(plog, 1) == (3, 2)
        assert plog.log_end == 5
        assert plog.check_sequence(PRODUCER, 2) is None


def test_sequence_gaps_are_allowed_and_can_be_filled_later(tmp_path):
    with open_log(tmp_path) as plog:
        produce(plog, 0)
        assert produce(plog, 5) == (3, 3)
        assert plog.check_sequence(PRODUCER, 6) is None
        # A pipelining producer's retry of batch 3 after batch 5 landed: never appended, so new...
        assert plog.check_sequence(PRODUCER, 3) is None
        assert produce(plog, 3) == (6, 3)
        # ...and from then on a duplicate like any other.
        assert plog.check_sequence(PRODUCER, 3) == (6, 3)
        assert plog.check_sequence(PRODUCER, 5) == (3, 3)


def test_a_sequence_older_than_the_remembered_batches_is_refused(tmp_path):
    with open_log(tmp_path) as plog:
        for sequence in range(REMEMBERED_BATCHES + 2):
            produce(plog, sequence)
        assert plog.check_sequence(PRODUCER, 2) == (6, 3)
        with pytest.raises(DuplicateSequence) as caught:
            plog.check_sequence(PRODUCER, 1)
    error = caught.value
    assert (error.data["producer_id"], error.data["sequence"], error.data["last_sequence"]) == (
        PRODUCER, 1, REMEMBERED_BATCHES + 1)
    assert not error.retriable


def test_producers_are_tracked_separately(tmp_path):
    with open_log(tmp_path) as plog:
        produce(plog, 0, producer_id=1)
        produce(plog, 0, producer_id=2)
        assert plog.check_sequence(1, 0) == (0, 3)
        assert plog.check_sequence(2, 0) == (3, 3)
        assert plog.check_sequence(3, 0) is None


def test_producer_id_zero_is_never_deduplicated(tmp_path):
    with open_log(tmp_path) as plog:
        for _ in range(3):
            assert plog.check_sequence(0, 0) is None
            plog.append(make_payload(0, 1), 1, append_time_ms=0, producer_id=0, producer_seq=0)
        assert plog.log_end == 3
        assert plog.producer_snapshot() == {}


def test_the_state_survives_reopen(tmp_path):
    with open_log(tmp_path, segment_bytes=1000) as plog:
        for sequence in range(12):
            produce(plog, sequence, producer_id=1 + sequence % 2)
        before = plog.producer_snapshot()
    with open_log(tmp_path, segment_bytes=1000) as plog:
        assert plog.producer_snapshot() == before
        assert plog.recovery.producers == 2
        assert produce(plog, 10, producer_id=1) == (30, 3)
        assert produce(plog, 12, producer_id=1) == (36, 3)


def test_only_the_last_window_of_segments_is_remembered_live_and_after_reopen(tmp_path):
    config = {"segment_bytes": 1000, "producer_window_segments": 2}
    with open_log(tmp_path, **config) as plog:
        produce(plog, 0, producer_id=1)   # only in segment 0
        for sequence in range(20):        # 20 batches of ~125 bytes: several segments
            produce(plog, sequence, producer_id=2)
        assert plog.statistics()["segments"] >= 3
        assert plog.check_sequence(1, 0) is None  # forgotten: segment 0 left the window
        live = plog.producer_snapshot()
        assert set(live) == {2}
    with open_log(tmp_path, **config) as plog:
        assert plog.producer_snapshot() == live


def test_a_torn_last_batch_is_not_remembered(tmp_path):
    with open_log(tmp_path) as plog:
        produce(plog, 0)
        produce(plog, 1)
    segment = tmp_path / "00000000000000000000.log"
    segment.write_bytes(segment.read_bytes()[:-1])
    with open_log(tmp_path) as plog:
        assert plog.check_sequence(PRODUCER, 1) is None
        assert produce(plog, 1) == (3, 3)
        assert len(read_all(plog)) == 6


def test_a_pipelining_producers_first_batch_may_land_after_its_second(tmp_path):
    # Batches 0 and 1 in flight; 0 is lost (its actor restarted), 1 lands, 0 is retried.
    # Refusing it (DUPLICATE_SEQUENCE, "do not resend") would drop records never appended.
    with open_log(tmp_path) as plog:
        assert produce(plog, 1) == (0, 3)
        assert plog.check_sequence(PRODUCER, 0) is None
        assert produce(plog, 0) == (3, 3)
        assert produce(plog, 0) == (3, 3)  # and from then on a duplicate like any other
    with open_log(tmp_path) as plog:  # the whole log is scanned again: nothing forgotten
        assert produce(plog, 1) == (0, 3)
        assert plog.check_sequence(PRODUCER, 2) is None


def test_below_batches_that_left_the_window_nothing_is_vouched_for(tmp_path):
    # segment_bytes small enough that every batch rolls a segment; the window is 2 of them
    with open_log(tmp_path, segment_bytes=60) as plog:
        for sequence in (2, 3, 4, 5):
            produce(plog, sequence)
        with pytest.raises(DuplicateSequence):  # 2 and 3 were forgotten: 1 may be older than them
            plog.check_sequence(PRODUCER, 1)
    with open_log(tmp_path, segment_bytes=60) as plog:
        assert len(plog._segments) > 2
        with pytest.raises(DuplicateSequence):  # rebuilt from the last segments only
            plog.check_sequence(PRODUCER, 3)
        assert plog.check_sequence(PRODUCER, 5) is not None


def test_a_forgotten_batch_is_not_vouched_for_even_above_an_older_gap(tmp_path):
    with open_log(tmp_path) as plog:
        for sequence in range(1, REMEMBERED_BATCHES + 3):  # 0 never sent; 1 and 2 then evicted
            produce(plog, sequence)
        with pytest.raises(DuplicateSequence):
            plog.check_sequence(PRODUCER, 0)
        with pytest.raises(DuplicateSequence):
            plog.check_sequence(PRODUCER, 2)
        assert plog.check_sequence(PRODUCER, 3) is not None
