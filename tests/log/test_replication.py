"""What a replicated partition needs from its log: the leader-epoch cache, appending a leader's
stored batches byte for byte, and truncation that survives a crash at any step."""

import dataclasses
import os

import pytest

from zbroker.protocol.batch import parse_batch_header
from zbroker.protocol.errors import CorruptBatch, OffsetOutOfRange
from zbroker.storage.log.epochs import CHECKPOINT_NAME, NO_EPOCH, CorruptEpochCheckpoint, LeaderEpochCache
from tests.log.support import make_payload, open_log, read_all, record_value

CONFIG = {"segment_bytes": 600, "index_interval_bytes": 100, "producer_window_segments": 2}


def segment_files(directory):
    return {path.name: path.read_bytes() for path in directory.glob("*.log")}


def fill(plog, batches, *, first_tag=0, producer_id=7):
    """Append `batches` idempotent batches of 1..3 records; returns the value at every offset."""
    values = []
    for tag in range(first_tag, first_tag + batches):
        count = 1 + tag % 3
        plog.append(make_payload(tag, count), count, append_time_ms=tag, producer_id=producer_id,
                    producer_seq=tag)
        values.extend(record_value(tag, i, 20) for i in range(count))
    return values


def batch_starts(plog):
    starts, offset = [], plog.log_start
    while offset < plog.log_end:
        starts.append(offset)
        offset = parse_batch_header(plog.read(offset, 1)).next_offset
    return starts


# -- the epoch cache ------------------------------------------------------------------------

def test_epoch_cache_answers_where_each_epoch_ends_and_survives_a_reopen(tmp_path):
    cache = LeaderEpochCache.load(tmp_path)
    assert not (tmp_path / CHECKPOINT_NAME).exists()
    assert cache.latest_epoch == NO_EPOCH and cache.end_offset_for(3, 10) == (NO_EPOCH, NO_EPOCH)
    assert cache.assign(0, 0) and cache.assign(2, 10) and cache.assign(5, 25)
    assert not cache.assign(4, 30)  # a stale leader's epoch changes nothing
    assert cache.end_offset_for(0, 40) == (0, 10)
    assert cache.end_offset_for(1, 40) == (0, 10)  # epoch 1 never wrote here: its predecessor's end
    assert cache.end_offset_for(2, 40) == (2, 25)
    assert cache.end_offset_for(9, 40) == (5, 40)
    assert [cache.epoch_at(o) for o in (0, 9, 10, 24, 25, 99)] == [0, 0, 2, 2, 5, 5]
    assert cache.entries_from(12) == [[2, 10], [5, 25]]
    assert LeaderEpochCache.load(tmp_path).entries() == [(0, 0), (2, 10), (5, 25)]


def test_an_epoch_that_wrote_nothing_is_replaced_and_truncation_drops_what_starts_at_the_cut(tmp_path):
    cache = LeaderEpochCache.load(tmp_path)
    cache.assign(1, 0)
    cache.assign(2, 5)
    cache.assign(3, 5)  # epoch 2 led without writing a record
    assert cache.entries() == [(1, 0), (3, 5)]
    with pytest.raises(ValueError):
        cache.assign(4, 4)
    assert cache.truncate_from_end(5) and cache.entries() == [(1, 0)]
    assert not cache.truncate_from_end(5)
    assert LeaderEpochCache.load(tmp_path).entries() == [(1, 0)]


@pytest.mark.parametrize("text", ["", "garbage\n", "zbroker-leader-epochs 1\n1 x\n",
                                  "zbroker-leader-epochs 1\n2 5\n1 9\n", "zbroker-leader-epochs 1\n1 5\n2 5\n"])
def test_a_damaged_checkpoint_is_refused_not_guessed(tmp_path, text):
    (tmp_path / CHECKPOINT_NAME).write_text(text)
    with pytest.raises(CorruptEpochCheckpoint):
        LeaderEpochCache.load(tmp_path)


def test_an_unreplicated_log_never_writes_a_checkpoint(tmp_path):
    with open_log(tmp_path, **CONFIG) as plog:
        fill(plog, 10)
        plog.truncate_to(3)
    assert not (tmp_path / CHECKPOINT_NAME).exists()


def test_open_trims_epochs_beyond_the_recovered_log_end(tmp_path):
    with open_log(tmp_path, **CONFIG) as plog:
        plog.epochs.assign(0, 0)
        fill(plog, 4)
        end = plog.log_end
        plog.epochs.assign(1, end)
        plog.epochs.assign(2, end + 50)  # as if the tail it wrote was lost in a crash
    with open_log(tmp_path, **CONFIG) as plog:
        assert plog.epochs.entries() == [(0, 0), (1, end)]


# -- byte-for-byte replication ----------------------------------------------------------------

def test_append_stored_makes_a_byte_identical_copy_with_the_same_producer_state(tmp_path):
    leader = open_log(tmp_path / "leader", **CONFIG)
    # The topic's config travels with the assignment, so both roll at the same batches and
    # the producer window (counted in segments) covers the same batches on both.
    follower = open_log(tmp_path / "follower", **CONFIG)
    values = fill(leader, 30)
    offset = 0
    while offset < leader.log_end:
        data = leader.read(offset, 250)
        offset = follower.append_stored(data)
    assert follower.log_end == leader.log_end
    assert segment_files(tmp_path / "leader") == segment_files(tmp_path / "follower")
    assert follower.producer_snapshot() == leader.producer_snapshot()
    assert follower.check_sequence(7, 29) == leader.check_sequence(7, 29)
    assert [r.value for r in read_all(follower)] == values
    leader.close()
    follower.close()
    with open_log(tmp_path / "follower", **CONFIG) as reopened:
        assert reopened.log_end == len(values)


def test_append_stored_refuses_a_gap_or_a_bad_crc_and_writes_nothing(tmp_path):
    leader = open_log(tmp_path / "leader", **CONFIG)
    follower = open_log(tmp_path / "follower", **CONFIG)
    fill(leader, 6)
    first = leader.read(0, 1)
    follower.append_stored(first)
    end = follower.log_end
    with pytest.raises(CorruptBatch):
        follower.append_stored(leader.read(parse_batch_header(leader.read(end, 1)).next_offset, 1))
    good = leader.read(end, 10_000)
    damaged = bytearray(good)
    damaged[-1] ^= 0xFF
    with pytest.raises(CorruptBatch):
        follower.append_stored(bytes(damaged))
    assert follower.log_end == end and follower.size_bytes == len(first)
    leader.close()
    follower.close()


# -- truncation -------------------------------------------------------------------------------

def build(directory, batches=40):
    plog = open_log(directory, **CONFIG)
    plog.epochs.assign(0, 0)
    values = fill(plog, batches // 2)
    plog.epochs.assign(3, plog.log_end)
    values += fill(plog, batches - batches // 2, first_tag=batches // 2)
    return plog, values


def reference_producers(directory, values_end, batches=40):
    """The producer state of a log that only ever held the first `values_end` offsets."""
    with open_log(directory, **CONFIG) as plog:
        tag = 0
        while plog.log_end < values_end:
            count = 1 + tag % 3
            plog.append(make_payload(tag, count), count, append_time_ms=tag, producer_id=7, producer_seq=tag)
            tag += 1
        return plog.producer_snapshot()


def test_truncate_to_every_offset_keeps_exactly_the_prefix_and_appends_continue(tmp_path):
    probe, _ = build(tmp_path / "probe")
    starts = batch_starts(probe) + [probe.log_end]
    probe.close()
    assert len(list((tmp_path / "probe").glob("*.log"))) >= 4
    for target in range(0, starts[-1] + 3):
        directory = tmp_path / f"t{target}"
        plog, values = build(directory)
        epochs_before = plog.epochs.entries()
        expected_end = max(s for s in starts if s <= target)
        assert plog.truncate_to(target) == expected_end == plog.log_end
        assert [r.value for r in read_all(plog, max_bytes=200)] == values[:expected_end]
        assert plog.epochs.entries() == [(e, s) for e, s in epochs_before if s < expected_end]
        assert plog.producer_snapshot() == reference_producers(tmp_path / f"ref{target}", expected_end)
        plog.append(make_payload(999, 2), 2, append_time_ms=0)
        plog.close()
        with open_log(directory, **CONFIG) as reopened:
            assert reopened.recovery.truncated_bytes == 0
            assert reopened.log_end == expected_end + 2
            assert [r.value for r in read_all(reopened, max_bytes=200)][:expected_end] == values[:expected_end]
            assert reopened.epochs.entries() == [(e, s) for e, s in epochs_before if s < expected_end]
        if target % 5:
            for path in [*directory.iterdir(), *(tmp_path / f"ref{target}").iterdir()]:
                path.unlink()


def test_truncate_beyond_the_end_is_a_no_op_and_below_the_start_is_refused(tmp_path):
    plog, values = build(tmp_path)
    assert plog.truncate_to(len(values) + 10) == len(values)
    plog.close()
    with open_log(tmp_path, **{**CONFIG, "retention_bytes": 0}) as plog:
        plog.enforce_retention(now_ms=0)
        assert plog.log_start > 0
        with pytest.raises(OffsetOutOfRange):
            plog.truncate_to(plog.log_start - 1)


def test_reset_to_starts_an_empty_log_at_the_leaders_start(tmp_path):
    plog, _ = build(tmp_path)
    plog.reset_to(1234)
    assert (plog.log_start, plog.log_end, plog.epochs.entries(), plog.producer_snapshot()) == (1234, 1234, [], {})
    plog.append(make_payload(1, 1), 1, append_time_ms=0)
    plog.close()
    with open_log(tmp_path, **CONFIG) as reopened:
        assert (reopened.log_start, reopened.log_end) == (1234, 1235)


class Crash(Exception):
    pass


def crash_at(monkeypatch, step):
    """Make the `step`th file-system change (unlink, ftruncate, fsync, replace) raise Crash,
    leaving the disk as it was at that moment."""
    calls = {"n": 0}
    for name in ("unlink", "ftruncate", "fsync", "replace"):
        real = getattr(os, name)

        def faulty(*args, _real=real, **kwargs):
            calls["n"] += 1
            if calls["n"] == step:
                raise Crash()
            return _real(*args, **kwargs)
        monkeypatch.setattr(os, name, faulty)
    return calls


def abandon(plog):
    """A crash: descriptors go, nothing is flushed or closed in order."""
    for segment in plog._segments:
        segment.close_fd()
    plog._closed = True


def test_a_crash_at_any_step_of_a_truncation_leaves_a_log_that_recovers_and_truncates_again(tmp_path,
                                                                                          monkeypatch):
    target = 7
    step = 1
    while True:
        directory = tmp_path / f"crash{step}"
        plog, values = build(directory)
        plog.flush()
        epochs_before = plog.epochs.entries()
        with monkeypatch.context() as patch:
            calls = crash_at(patch, step)
            try:
                end = plog.truncate_to(target)
            except Crash:
                crashed = True
            else:
                crashed = False
        abandon(plog)
        with open_log(directory, **CONFIG) as reopened:
            # Never shorter than asked, always a prefix of what it held, epochs describing only it.
            assert reopened.log_end >= end if not crashed else reopened.log_end >= target
            got = [r.value for r in read_all(reopened, max_bytes=200)]
            assert got == values[:reopened.log_end]
            assert reopened.epochs.entries() == [(e, s) for e, s in epochs_before if s <= reopened.log_end]
            final = reopened.truncate_to(target)
            assert [r.value for r in read_all(reopened, max_bytes=200)] == values[:final]
            assert reopened.epochs.entries() == [(e, s) for e, s in epochs_before if s < final]
        if not crashed:
            break
        step += 1
    assert calls["n"] >= 6 and step >= 6  # the walk went through every unlink, the cut and each fsync


def test_truncate_from_start_drops_epochs_below_the_log_start_and_starts_the_covering_one_there(tmp_path):
    cache = LeaderEpochCache.load(tmp_path)
    cache.assign(1, 0)
    cache.assign(3, 10)
    cache.assign(4, 30)
    assert not cache.truncate_from_start(0)
    assert cache.truncate_from_start(12) and cache.entries() == [(3, 12), (4, 30)]
    assert not cache.truncate_from_start(12)
    assert cache.truncate_from_start(30) and cache.entries() == [(4, 30)]
    assert cache.end_offset_for(3, 50) == (NO_EPOCH, NO_EPOCH)  # nobody can vouch for epoch 3 here now
    assert LeaderEpochCache.load(tmp_path).entries() == [(4, 30)]


def test_retention_trims_the_epoch_cache_to_the_new_log_start_and_the_trim_survives_a_reopen(tmp_path):
    with open_log(tmp_path, **CONFIG, retention_bytes=2400) as plog:
        plog.epochs.assign(0, 0)
        fill(plog, 20)
        second_start = plog.log_end
        plog.epochs.assign(1, second_start)
        fill(plog, 20, first_tag=20)
        assert plog.enforce_retention(now_ms=0) > 0
        assert 0 < plog.log_start < second_start  # within epoch 0: it now starts at the log start
        assert plog.epochs.entries() == [(0, plog.log_start), (1, second_start)]
        plog.config = dataclasses.replace(plog.config, retention_bytes=1200)
        assert plog.enforce_retention(now_ms=0) > 0
        assert plog.log_start > second_start  # past epoch 0's end: it is gone
        assert plog.epochs.entries() == [(1, plog.log_start)]
        start = plog.log_start
    with open_log(tmp_path, **CONFIG) as plog:
        assert plog.log_start == start and plog.epochs.entries() == [(1, start)]
