"""The client's I/O-free pieces: batching, sequences, ack ranges and the deduper."""

import pytest
import msgpack
from hypothesis import given
from hypothesis import strategies as st

from zbroker.protocol.batch import encode_columns, encode_records, encode_values, validate_payload
from zbroker.protocol.partitioner import partition_for_key
from zbroker.client.core import (AckAccumulator, BatchAccumulator, Deduper, DeliveryHandle, checked_partition,
                                 checked_record, checked_topics,
                                 checked_timestamp, group_by_lease)
from zbroker.client import sync
from tests.support.blobs import Blob
from zbroker.client.core import ConsumedRecord


def test_batches_close_at_size_and_carry_consecutive_sequences():
    acc = BatchAccumulator(batch_size=3, batch_bytes=1 << 20, producer_id=42)
    closed = [acc.add("t", 0, [1, None, b"v%d" % i, None], 10, 0.0)[1] for i in range(7)]
    batches = [b for b in closed if b is not None]
    assert [b.count for b in batches] == [3, 3]
    assert [b.sequence for b in batches] == [0, 1]
    assert acc.buffered_records() == 1
    rest = acc.drain()
    assert [b.sequence for b in rest] == [2]
    assert msgpack.unpackb(rest[0].payload)[0][2] == b"v6"


def test_sequences_are_per_partition():
    acc = BatchAccumulator(batch_size=1, batch_bytes=1 << 20, producer_id=1)
    seqs = [(b.partition, b.sequence) for b in (acc.add("t", p, [0, None, b"x", None], 1, 0.0)[1]
                                                 for p in (0, 1, 0, 1, 0))]
    assert seqs == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]


def test_batches_close_by_bytes_and_by_linger():
    acc = BatchAccumulator(batch_size=1000, batch_bytes=100, producer_id=1)
    assert acc.add("t", 0, [0, None, b"x" * 40, None], 40, 0.0)[1] is None
    assert acc.add("t", 0, [0, None, b"x" * 60, None], 60, 0.0)[1].count == 2  # exactly batch_bytes
    assert acc.add("t", 0, [0, None, b"a" * 60, None], 60, 0.0)[1] is None
    # A record that would take the batch past batch_bytes starts the next batch: a record
    # too large for the broker then fails alone, not with its neighbours.
    first = acc.add("t", 0, [0, None, b"b" * 500, None], 500, 0.0)[1]
    assert first.count == 1 and msgpack.unpackb(first.payload)[0][2] == b"a" * 60
    assert acc.add("t", 0, [0, None, b"c", None], 1, 0.0)[1].count == 1  # the oversized one, alone
    assert acc.buffered_records() == 1
    acc.drain()
    acc.add("t", 1, [0, None, b"y", None], 1, 10.0)
    assert acc.due(10.004, 0.005) == []
    assert [b.partition for b in acc.due(10.006, 0.005)] == [1]


def test_keyed_records_follow_the_documented_hash_and_keyless_rotate_per_batch():
    acc = BatchAccumulator(batch_size=2, batch_bytes=1 << 20, producer_id=1)
    assert acc.choose_partition("t", 8, b"user-1") == partition_for_key(b"user-1", 8)
    seen = []
    for _ in range(8):
        p = acc.choose_partition("t", 4, None)
        seen.append(p)
        acc.add("t", p, [0, None, b"x", None], 1, 0.0)[1]
    # Two records per batch stay on one partition, then the next partition.
    assert seen[0] == seen[1] and seen[2] == seen[3] and seen[0] != seen[2]
    assert sorted(set(seen)) == [0, 1, 2, 3]


@given(st.lists(st.one_of(st.binary(max_size=300), st.sampled_from([b"", b"x" * 255, b"y" * 256, b"z" * 70000]))
                .map(Blob), max_size=40),
       st.one_of(st.integers(min_value=0, max_value=2**63 - 1), st.integers(min_value=-(2**63), max_value=-1)))
def test_value_fast_path_packs_exactly_what_the_general_encoder_packs(values, ts):
    values = [bytes(v) for v in values]  # plain bytes, as send() hands them on (Blob is for the repr)
    assert encode_values(values, ts) == encode_records([[ts, None, v, None] for v in values])
    same = [values[0]] * len(values) if values else []  # equal lengths: the bytes.join path
    assert encode_values(same, ts) == encode_records([[ts, None, v, None] for v in same])
    assert validate_payload(encode_values(same or [b"v"], ts)) == (len(same) or 1)


_records = st.lists(st.tuples(
    st.sampled_from([1_767_225_600_000, 1_767_225_600_001, 1_767_225_600_002, 0, 2**63 - 1]),
    st.one_of(st.none(), st.binary(max_size=20)),
    st.one_of(st.binary(max_size=300), st.sampled_from([b"x" * 100, b"y" * 256])),
    st.one_of(st.none(), st.dictionaries(st.text(max_size=5), st.binary(max_size=10), min_size=1, max_size=3)),
), min_size=1, max_size=60)


@given(_records)
def test_a_batch_kept_as_columns_packs_exactly_what_the_general_encoder_packs(records):
    acc = BatchAccumulator(batch_size=1000, batch_bytes=1 << 30, producer_id=1)
    for stamp, key, value, headers in records:
        acc.add("t", 0, [stamp, key, value, headers], 1, 0.0)
    batch, = acc.drain()
    assert batch.payload == encode_records([list(r) for r in records])
    assert validate_payload(batch.payload) == len(records)


def test_columns_of_equal_values_pack_as_runs_per_timestamp():
    values = [b"v" * 100] * 6
    payload = encode_columns(values, [(0, 5), (2, 6), (5, 9)], None)
    assert payload == encode_records([[5, None, v, None] for v in values[:2]] + [[6, None, v, None] for v in values[2:5]]
                                     + [[9, None, values[5], None]])


def test_the_keyless_fast_path_follows_the_sticky_partition_and_its_open_batch():
    acc = BatchAccumulator(batch_size=2, batch_bytes=1 << 20, producer_id=1)
    assert acc.keyless_open == {}
    first = acc.choose_partition("t", 3, None)
    acc.add("t", first, [0, None, b"a", None], 1, 0.0)
    assert acc.keyless_open["t"].values == [b"a"]
    nxt = (first + 1) % 3
    acc.add("t", nxt, [0, b"k", b"keyed", None], 1, 0.0)  # a keyed record opened the next partition's batch
    assert acc.keyless_open["t"].outcome.partition == first
    acc.add("t", first, [0, None, b"b", None], 1, 0.0)  # fills the batch: sticky moves on, to an open batch
    assert acc.choose_partition("t", 3, None) == nxt
    assert acc.keyless_open["t"].outcome.partition == nxt and acc.keyless_open["t"].values == [b"keyed"]
    acc.drain()
    assert acc.keyless_open == {}
    acc.choose_partition("t", 5, None)  # the partition count changed: a new sticky partition, nothing open
    assert acc.keyless_open == {}


def test_add_keyless_appends_to_the_sticky_partitions_open_batch_only():
    acc = BatchAccumulator(batch_size=3, batch_bytes=1 << 20, producer_id=1)
    assert acc.add_keyless("t", b"a", 5) is None  # nothing open yet: the caller takes the general path
    partition = acc.choose_partition("t", 2, None)
    acc.add("t", partition, [5, None, b"a", None], 17, 0.0)
    handle, closed = acc.add_keyless("t", b"b", 6)
    assert closed is None and (handle.topic, handle.partition) == ("t", partition)
    handle, closed = acc.add_keyless("t", b"c", 6)  # the third record fills the batch
    assert closed.count == 3 and closed.partition == partition
    assert closed.payload == encode_records([[5, None, b"a", None], [6, None, b"b", None], [6, None, b"c", None]])
    assert acc.add_keyless("t", b"d", 7) is None  # the sticky partition moved on; nothing open there
    small = BatchAccumulator(batch_size=100, batch_bytes=100, producer_id=1)
    small.add("t", small.choose_partition("t", 1, None), [5, None, b"a" * 30, None], 46, 0.0)
    assert small.add_keyless("t", b"b" * 60, 5) is None  # 46 + 76 > 100: `add` starts the next batch
    assert small.add_keyless("t", b"b" * 30, 5)[1] is None and small.buffered_records() == 2


def test_a_record_of_the_wrong_type_is_refused_when_sent():
    assert checked_record(bytearray(b"v"), memoryview(b"k"), {"h": bytearray(b"1")}) == (b"v", b"k", {"h": b"1"})
    assert checked_record(b"v", None, {}) == (b"v", None, None)
    with pytest.raises(TypeError, match="value must be bytes, not str"):
        checked_record("text", None, None)
    with pytest.raises(TypeError, match="value must be bytes, not NoneType"):
        checked_record(None, None, None)
    with pytest.raises(TypeError, match="key must be bytes or None, not int"):
        checked_record(b"v", 7, None)
    with pytest.raises(TypeError, match="headers must be a dict of str to bytes, not str to str"):
        checked_record(b"v", None, {"h": "1"})
    with pytest.raises(TypeError, match="headers must be a dict"):
        checked_record(b"v", None, [("h", b"1")])
    assert checked_timestamp(-(1 << 63)) == -(1 << 63) and checked_timestamp((1 << 64) - 1) == (1 << 64) - 1
    with pytest.raises(TypeError, match="timestamp_ms must be an int, not float"):
        checked_timestamp(5.0)
    with pytest.raises(TypeError, match="not bool"):
        checked_timestamp(True)
    with pytest.raises(ValueError, match="fit in 64 bits"):
        checked_timestamp(1 << 64)


def test_value_fast_path_splits_by_count_and_by_bytes_with_consecutive_sequences():
    acc = BatchAccumulator(batch_size=4, batch_bytes=1000, producer_id=1)
    batches = acc.add_many_values("t", 0, [b"a" * 10] * 10, 5)
    assert [b.count for b in batches] == [4, 4, 2] and [b.sequence for b in batches] == [0, 1, 2]
    big = acc.add_many_values("t", 0, [b"b" * 400] * 4, 5)  # 4 x 400 bytes > 1000: two per batch
    assert [b.count for b in big] == [2, 2] and [b.sequence for b in big] == [3, 4]
    assert [r[2] for b in batches for r in msgpack.unpackb(b.payload)] == [b"a" * 10] * 10
    huge = acc.add_many_values("t", 1, [b"c" * 5000], 5)  # one record alone may exceed: the actor decides
    assert [b.count for b in huge] == [1]



def test_values_sent_in_bulk_after_a_send_follow_the_batch_that_send_holds_open():
    # send() then send_many() to one partition: the open batch was numbered after the bulk
    # batches, so the partition stored "first" last.
    acc = BatchAccumulator(batch_size=100, batch_bytes=1 << 20, producer_id=1)
    handle, held = acc.add("t", 0, [0, None, b"first", None], 5, 0.0)
    other, _ = acc.add("t", 1, [0, None, b"elsewhere", None], 9, 0.0)
    assert held is None
    batches = acc.add_many_values("t", 0, [b"second", b"third"], 5)
    assert [b.sequence for b in batches] == [0, 1]
    assert [r[2] for b in batches for r in msgpack.unpackb(b.payload)] == [b"first", b"second", b"third"]
    batches[0].acknowledged(7)
    assert handle.offset == 7
    assert [b.partition for b in acc.drain()] == [1]  # another partition's open batch stays open until then

def test_handles_read_their_batch_outcome():
    acc = BatchAccumulator(batch_size=2, batch_bytes=1 << 20, producer_id=1)
    h1, none_yet = acc.add("t", 0, [0, None, b"a", None], 1, 0.0)
    h2, batch = acc.add("t", 0, [0, None, b"b", None], 1, 0.0)
    h3, _ = acc.add("t", 0, [0, None, b"c", None], 1, 0.0)  # the next batch
    assert none_yet is None and not (h1.done or h2.done)
    batch.acknowledged(40)
    assert (h1.offset, h2.offset, h1.error) == (40, 41, None) and h1.done and h2.done
    assert h3.offset is None and not h3.done
    failed, = acc.drain()
    failed.failed(RuntimeError("gone"))
    assert h3.done and h3.offset is None and str(h3.error) == "gone"
    assert isinstance(h1, DeliveryHandle)


def test_ack_accumulator_merges_consecutive_offsets_of_one_lease():
    acc = AckAccumulator()
    for off in [10, 11, 12, 14, 15]:
        acc.add("t", 0, 7, off)
    acc.add("t", 1, 7, 16)
    acc.add("t", 0, 8, 16)
    assert acc.count == 7
    assert acc.take() == [["t", 0, 7, 10, 13], ["t", 0, 7, 14, 16], ["t", 1, 7, 16, 17], ["t", 0, 8, 16, 17]]
    assert not acc and acc.count == 0


@given(st.lists(st.integers(min_value=0, max_value=200), unique=True, max_size=100))
def test_ack_ranges_cover_exactly_the_acked_offsets(offsets):
    acc = AckAccumulator()
    for off in offsets:
        acc.add("t", 0, 1, off)
    covered = [o for _t, _p, _l, start, end in acc.take() for o in range(start, end)]
    assert sorted(covered) == sorted(offsets)


def test_group_by_lease_sorts_records():
    recs = [ConsumedRecord("t", 0, o, 0, None, b"", None, 5, 1, "new") for o in (3, 1, 2)]
    assert group_by_lease(recs) == [["t", 0, 5, 1, 4]]


def test_deduper_forgets_after_ttl_and_is_bounded():
    d = Deduper(ttl_s=10, max_entries=3)
    assert d.first_time("a", 0) is True
    assert d.first_time("a", 5) is False
    assert d.first_time("a", 10.5) is True  # expired, seen again
    for i in range(10):
        d.first_time(i, 11)
    assert len(d) == 3


@pytest.mark.parametrize("seconds, expected", [(0.0, 0), (-0.5, 0), (0.0001, 1), (0.0007, 1), (0.001, 1),
                                               (0.0047, 5), (1.0, 1000)])
def test_poll_timeouts_round_up_so_a_short_wait_sleeps_instead_of_spinning(seconds, expected):
    # A wait of 0.7 ms truncated to poll(0) returned at once, and the callers that loop
    # until their deadline busy-waited for the rest of the millisecond.
    assert sync.poll_timeout_ms(seconds) == expected


def test_metadata_endpoints_of_an_assignment_skip_what_is_not_known():
    from zbroker.client.core import MetadataCache

    cache = MetadataCache()
    cache.update([{"name": "t", "partitions": [{"partition": 0, "endpoint": "tcp://a"},
                                               {"partition": 1, "endpoint": "tcp://b"},
                                               {"partition": 2, "endpoint": "tcp://a"},
                                               {"partition": 3}]}])  # no live owner
    assert cache.endpoints([["t", 0], ["t", 2], ["t", 1]]) == ["tcp://a", "tcp://b"]
    assert cache.endpoints([["t", 3], ["t", 9], ["other", 0]]) == []


def test_a_partition_whose_sequences_run_out_moves_to_a_new_producer_id():
    # Sequences are signed 32-bit on the wire: batch 2**31 of one (producer_id, partition)
    # would be refused with BAD_REQUEST, failing every record in it and after it.
    from zbroker.protocol import messages as m
    from zbroker.client.core import MAX_SEQUENCE
    acc = BatchAccumulator(batch_size=1, batch_bytes=1 << 20, producer_id=17)
    acc._sequences[("t", 0)] = MAX_SEQUENCE
    last = acc.add("t", 0, [0, None, b"a", None], 1, 0.0)[1]
    rolled = acc.add("t", 0, [0, None, b"b", None], 1, 0.0)[1]
    after = acc.add("t", 0, [0, None, b"c", None], 1, 0.0)[1]
    other = acc.add("t", 1, [0, None, b"d", None], 1, 0.0)[1]
    assert (last.producer_id, last.sequence) == (17, MAX_SEQUENCE)  # a retry of it keeps both
    assert rolled.producer_id not in (0, 17) and rolled.sequence == 0
    assert (after.producer_id, after.sequence) == (rolled.producer_id, 1)
    assert (other.producer_id, other.sequence) == (17, 0)  # other partitions keep theirs
    for b in (last, rolled, after):
        m.build(m.Produce, {"topic": "t", "partition": 0, "producer_id": b.producer_id, "sequence": b.sequence})


def test_the_size_estimate_counts_keys_and_headers():
    # Counting only values, 1,000 records with 16 KiB keys made a 16 MB payload that the
    # broker refuses whole (TOO_LARGE) although each record would fit alone.
    from zbroker.client.core import record_size_estimate
    key, headers = b"k" * 16384, {"trace": b"t" * 1000}
    assert record_size_estimate(b"v", key, headers) >= 16384 + 1000 + 1
    assert record_size_estimate(b"v", None, None) == record_size_estimate(b"v", None, {})
    acc = BatchAccumulator(batch_size=1000, batch_bytes=1 << 20, producer_id=1)
    closed = [b for _h, b in (acc.add("t", 0, [0, key, b"v", headers], record_size_estimate(b"v", key, headers),
                                      0.0) for _ in range(1000)) if b is not None]
    assert closed and all(len(b.payload) <= (1 << 20) + 20000 for b in closed)


@pytest.mark.parametrize("partition, error", [("0", TypeError), (1.0, TypeError), (True, TypeError),
                                              (-1, ValueError)])
def test_a_partition_of_the_wrong_type_or_sign_is_refused_by_the_send(partition, error):
    producer = sync.Producer("tcp://127.0.0.1:1", linger_ms=0)
    try:
        with pytest.raises(error, match="partition"):
            producer.send("t", b"v", partition=partition)
        with pytest.raises(error, match="partition"):
            producer.send_many("t", [b"v"], partition=partition)
        assert producer.conn.sockets == {} and producer.in_flight_records == 0
    finally:
        producer.conn.close()


def test_consumers_refuse_a_lone_topic_name_before_opening_anything():
    from zbroker.client.aio import AsyncConsumer

    for make in (sync.Consumer, AsyncConsumer):
        with pytest.raises(TypeError, match=r"did you mean topics=\['orders'\]"):
            make("tcp://127.0.0.1:1", group="g", topics="orders")
        with pytest.raises(TypeError, match="must be a str, not int"):
            make("tcp://127.0.0.1:1", group="g", topics=[7])
    assert checked_topics(("a", "b")) == ["a", "b"]
