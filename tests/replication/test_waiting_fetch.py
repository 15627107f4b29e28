"""When the leader answers a follower's fetch held at its log end (`Replica.answer_at`), on a
hand-driven clock: at once when min_bytes are there or none are expected soon, at the latest
one linger after the first byte the follower lacks, always by the end of its long poll, and
never before that end when nothing was appended; under random appends and questions."""

from hypothesis import given, settings
from hypothesis import strategies as st

from zbroker.actors.partition_log.replica import (APPEND_RATE_WINDOW_MS, FETCH_LINGER_MS, FETCH_MIN_BYTES, Replica,
                                                  ReplicaState)
from zbroker.protocol import messages as m
from tests.replication.model import MemoryLog

NAMES = ("a", "b", "c")
BENCH_BATCH = 53_003  # one 500-record batch of 100 B values, as stored


def leader(now=0):
    state = ReplicaState(1, "a", "a", NAMES, NAMES, 2, {n: n for n in NAMES})
    return Replica("t", 0, "a", MemoryLog(), state, now)


def fetch(min_bytes=FETCH_MIN_BYTES, linger_ms=FETCH_LINGER_MS, max_wait_ms=500):
    return m.ReplicaFetch("t", 0, "b", 1, 0, -1, 1 << 20, max_wait_ms, min_bytes, linger_ms)


def test_a_trickle_of_small_produces_is_answered_at_once():
    replica = leader()
    for now in range(0, 50):  # 200 B a millisecond: the latency benchmark's 2,000 records/s
        waiting = replica.wait_at_end("f", fetch(), now)
        replica.appended(200, now)
        assert replica.answer_at(waiting, now) <= now


def test_a_stream_of_batches_waits_for_the_next_one_and_no_longer():
    replica = leader()
    for now in range(0, 10, 2):
        replica.appended(2 * BENCH_BATCH, now)  # the stream so far: a pair every 2 ms
    waiting = replica.wait_at_end("f", fetch(), 10)
    replica.appended(BENCH_BATCH, 10)
    assert replica.answer_at(waiting, 10) == 10 + FETCH_LINGER_MS  # more is coming: wait
    replica.appended(BENCH_BATCH, 11)
    assert replica.answer_at(waiting, 11) <= 11  # min_bytes are there


def test_defaults_of_an_older_follower_answer_at_the_first_byte():
    replica = leader()
    old = m.ReplicaFetch("t", 0, "b", 1, 0, -1, 1 << 20, 500)  # no min_bytes, no linger_ms
    waiting = replica.wait_at_end("f", old, 0)
    assert replica.answer_at(waiting, 3) == 500  # nothing appended: the long poll's end
    replica.appended(1, 4)
    assert replica.answer_at(waiting, 4) <= 4


step = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 3 * FETCH_MIN_BYTES // 2), st.integers(0, 3)),
    st.tuples(st.just("wait"), st.integers(1, 3 * FETCH_MIN_BYTES // 2), st.integers(0, 2 * APPEND_RATE_WINDOW_MS),
              st.integers(1, 40)),
    st.tuples(st.just("tick"), st.integers(0, 8)))


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(step, max_size=60))
def test_a_held_fetch_is_answered_in_time_and_only_then(steps):
    replica = leader()
    now, total = 0, 0
    appends: list[tuple[int, int]] = []  # (time, bytes appended so far), as the model knows it
    held: list = []
    for kind, *args in steps:
        if kind == "append":
            now += args[1]
            total += args[0]
            replica.appended(args[0], now)
            appends.append((now, total))
        elif kind == "wait":
            held.append(replica.wait_at_end(len(held), fetch(args[0], args[1], args[2]), now))
        else:
            now += args[0]
        # The owner asks after every append and whenever a held fetch's time has come.
        for waiting in list(held):
            at = replica.answer_at(waiting, now)
            lacking = total - waiting.from_bytes
            first = next((t for t, so_far in appends if so_far > waiting.from_bytes), None)
            if now >= waiting.until_ms or lacking >= waiting.msg.min_bytes:
                assert at <= now
            if lacking <= 0:
                assert at == (now if now >= waiting.until_ms else waiting.until_ms)  # nothing to send early
            else:
                latest = min(waiting.until_ms, first + min(waiting.msg.linger_ms, APPEND_RATE_WINDOW_MS))
                assert at <= max(latest, now)  # never past one linger after its first byte
                assert at <= waiting.due_ms or waiting.due_ms <= now  # an append never puts it off
            waiting.due_ms = at
            if at <= now:
                held.remove(waiting)
