"""The frame codec: every message round-trips; anything else is a ProtocolError, never a crash."""

import pickle
import types
import zlib
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.batch import (BATCH_HEADER_SIZE, Record, build_batch_header, decode_fetched, encode_records, encode_values,
                            uniform_record_count, validate_by_decoding,
                            iter_stored_batches, parse_batch_header, payload_record_count, validate_payload)
from zbroker.protocol.errors import CorruptBatch, ErrorCode, NotOwner, ProtocolError, StaleLease, ZBrokerError
from zbroker.protocol.partitioner import partition_for_key
from zbroker.client.core import ConsumedRecord
from tests.support.blobs import Blob

settings.register_profile("zbroker", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("zbroker")

_scalar = {
    int: st.integers(min_value=0, max_value=2**40),
    str: st.text(max_size=20),
    bool: st.booleans(),
    float: st.floats(allow_nan=False, allow_infinity=False),
    bytes: st.binary(max_size=20),
    list: st.lists(st.integers(min_value=0, max_value=100), max_size=4),
    dict: st.dictionaries(st.text(max_size=5), st.integers(-2**63, 2**63 - 1), max_size=3),
}


def _strategy(t):
    if isinstance(t, types.UnionType):
        return st.one_of(*[_strategy(a) for a in t.__args__])
    if t is type(None):
        return st.none()
    return _scalar.get(t, st.none())


def _message_strategy(table):
    def for_cls(cls):
        fields = {name: _strategy(ftype) for name, ftype, _req, _d in cls._fields}
        return st.fixed_dictionaries(fields).map(lambda kw: (cls, kw))
    return st.sampled_from(sorted(table.values(), key=lambda c: c.op)).flatmap(for_cls)


@given(_message_strategy(m.REQUESTS), st.integers(min_value=0, max_value=2**64 - 1))
@settings(max_examples=400)
def test_every_request_round_trips(cls_and_fields, corr_id):
    cls, fields = cls_and_fields
    try:
        msg = m.build(cls, fields)
    except ProtocolError:
        assume(False)
    env = codec.decode_request(codec.encode_request(msg, corr_id, [b"payload"]))
    assert env.op == cls.op
    assert env.corr_id == corr_id
    assert env.msg == msg
    assert env.frames == [b"payload"]


@given(_message_strategy(m.REPLIES), st.integers(min_value=0, max_value=2**32))
@settings(max_examples=300)
def test_every_reply_round_trips(cls_and_fields, corr_id):
    cls, fields = cls_and_fields
    try:
        msg = m.build(cls, fields)
    except ProtocolError:
        assume(False)
    is_reply, env = codec.decode_any(codec.encode_reply(msg, corr_id))
    assert is_reply
    assert env.msg == msg and env.corr_id == corr_id and env.ok


def test_error_reply_keeps_code_and_data():
    frames = codec.encode_error("ack", 9, StaleLease("lease expired", stale=[["t", 0, 5, 12, 13]], applied=2))
    env = codec.decode_reply(frames)
    assert not env.ok
    assert isinstance(env.error, StaleLease)
    assert env.error.code is ErrorCode.STALE_LEASE
    assert env.error.data == {"stale": [["t", 0, 5, 12, 13]], "applied": 2}
    assert env.error.retriable is False
    assert NotOwner("x").retriable is True


def test_unknown_error_code_from_a_newer_peer_is_still_an_error():
    header = msgpack.packb({"v": 1, "op": "fetch", "id": 1, "ok": False,
                            "error": {"code": "SOMETHING_NEW", "message": "hm"}})
    env = codec.decode_reply([header])
    assert isinstance(env.error, ZBrokerError)
    assert env.error.data["wire_code"] == "SOMETHING_NEW"


def _produce_frames():
    return codec.encode_request(m.Produce(topic="orders", partition=3, producer_id=77, sequence=4), 12345)


def test_truncated_header_at_every_byte_is_a_protocol_error():
    header = _produce_frames()[0]
    for cut in range(len(header)):
        with pytest.raises(ProtocolError):
            codec.decode_request([header[:cut]])


@given(st.binary(max_size=300))
@settings(max_examples=1000)
def test_garbage_is_only_ever_a_protocol_error(data):
    try:
        codec.decode_request([data])
    except ProtocolError as err:
        assert err.code in (ErrorCode.BAD_REQUEST, ErrorCode.UNKNOWN_OP, ErrorCode.UNSUPPORTED_VERSION,
                            ErrorCode.TOO_LARGE)


@given(st.dictionaries(st.sampled_from(["v", "op", "id", "topic", "partition", "offset", "group", "ranges"]),
                       st.one_of(st.none(), st.integers(-2**63, 2**64 - 1), st.text(max_size=8),
                                 st.lists(st.integers(-2**63, 2**63), max_size=3),
                                 st.binary(max_size=4), st.booleans()), max_size=8))
@settings(max_examples=1000)
def test_wrong_types_are_only_ever_protocol_errors(header):
    try:
        codec.decode_request([msgpack.packb(header, use_bin_type=True)])
    except ProtocolError:
        pass


def test_specific_rejections_name_the_problem():
    with pytest.raises(ProtocolError) as info:
        codec.decode_request([msgpack.packb({"v": 1, "op": "fetch", "id": 3, "topic": "t", "partition": "0",
                                             "offset": 0})])
    assert info.value.data["field"] == "partition" and info.value.corr_id == 3
    with pytest.raises(ProtocolError) as info:
        codec.decode_request([msgpack.packb({"v": 9, "op": "fetch", "id": 4})])
    assert info.value.code is ErrorCode.UNSUPPORTED_VERSION and info.value.data["supported"] == [1]
    with pytest.raises(ProtocolError) as info:
        codec.decode_request([msgpack.packb({"v": 1, "op": "launch_missiles", "id": 5})])
    assert info.value.code is ErrorCode.UNKNOWN_OP and info.value.corr_id == 5
    with pytest.raises(ProtocolError):
        codec.decode_request([msgpack.packb({"v": 1, "op": "ack", "id": 6, "group": "g", "member_id": "m",
                                             "generation": 1, "ranges": [["t", 0, 1, 5, 5]]})])
    with pytest.raises(ProtocolError):
        codec.decode_request([b"\xc1"])  # never-used msgpack byte
    with pytest.raises(ProtocolError):
        codec.decode_request([msgpack.packb({"v": 1, "op": "status", "id": 1}), b"", b"", b"", b""])
    with pytest.raises(ProtocolError):
        codec.decode_request([])


def test_huge_declared_lengths_are_rejected_without_allocating():
    # A bin32 header that claims 4 GiB followed by three bytes.
    frame = b"\x81\xa1v\xc6\xff\xff\xff\xff" + b"abc"
    with pytest.raises(ProtocolError):
        codec.decode_request([frame])
    with pytest.raises(ProtocolError):
        codec.decode_request([b"\xdf\xff\xff\xff\xff"])  # map32 with 4 billion entries


def test_oversize_header_frame_is_too_large():
    big = msgpack.packb({"v": 1, "op": "status", "id": 1, "pad": "x" * (codec.MAX_HEADER_BYTES + 1)})
    with pytest.raises(ProtocolError) as info:
        codec.decode_request([big])
    assert info.value.code is ErrorCode.TOO_LARGE


# -- batches --------------------------------------------------------------------------------------

records_st = st.lists(
    st.tuples(st.integers(min_value=0, max_value=2**50), st.one_of(st.none(), st.binary(max_size=30)),
              st.binary(max_size=200),
              st.one_of(st.none(), st.dictionaries(st.text(max_size=8), st.binary(max_size=8), max_size=3))
              ).map(list),
    min_size=1, max_size=80)


@given(records_st)
def test_payload_count_matches_full_validation(records):
    payload = encode_records(records)
    assert payload_record_count(payload) == len(records) == validate_payload(payload)


@given(records_st, st.integers(min_value=0, max_value=2**40))
def test_stored_batch_round_trip(records, base):
    payload = encode_records(records)
    stored = build_batch_header(payload, base_offset=base, record_count=len(records), append_time_ms=5,
                                producer_id=9, producer_seq=2) + payload
    header = parse_batch_header(stored)
    assert (header.base_offset, header.record_count, header.producer_id, header.producer_seq) == (base, len(records), 9, 2)
    decoded = decode_fetched(stored, "t", 0)
    assert [r.offset for r in decoded] == list(range(base, base + len(records)))
    assert [[r.timestamp_ms, r.key, r.value, r.headers] for r in decoded] == records


@given(records_st, st.integers(min_value=0, max_value=2**40))
def test_decoded_records_equal_constructed_ones_and_survive_pickling(records, base):
    """decode_fetched builds records from the stored tuples directly (no constructor runs):
    they must be the same values, with the same names, as the constructor builds."""
    payload = encode_records(records)
    stored = build_batch_header(payload, base_offset=base, record_count=len(records), append_time_ms=5) + payload
    decoded = decode_fetched(stored, "t", 3, make=ConsumedRecord, extra=(77, 2, "timeout"))
    for i, (record, (ts, key, value, headers)) in enumerate(zip(decoded, records)):
        assert record == ConsumedRecord("t", 3, base + i, ts, key, value, headers, 77, 2, "timeout")
        assert (record.topic, record.partition, record.offset, record.lease_id, record.attempt, record.reason) == (
            "t", 3, base + i, 77, 2, "timeout")
        assert record.lease == ["t", 3, 77, base + i, base + i + 1]
        assert pickle.loads(pickle.dumps(record)) == record
    plain = decode_fetched(stored, "t", 3)
    assert [(r.topic, r.partition, r.offset, r.value) for r in plain] == [
        ("t", 3, base + i, rec[2]) for i, rec in enumerate(records)]
    assert all(type(pickle.loads(pickle.dumps(r))) is Record for r in plain)


def test_fetch_decoding_skips_records_below_the_requested_offset():
    payload = encode_records([[1, None, b"a", None], [1, None, b"b", None], [1, None, b"c", None]])
    stored = build_batch_header(payload, base_offset=10, record_count=3, append_time_ms=1) + payload
    assert [r.value for r in decode_fetched(stored, "t", 0, from_offset=11)] == [b"b", b"c"]
    assert [r.value for r in decode_fetched(stored, "t", 0, from_offset=11, until_offset=12)] == [b"b"]


def test_corrupt_stored_batch_is_detected():
    payload = encode_records([[1, None, b"hello", None]])
    stored = bytearray(build_batch_header(payload, base_offset=0, record_count=1, append_time_ms=1) + payload)
    stored[BATCH_HEADER_SIZE + 3] ^= 0xFF
    with pytest.raises(CorruptBatch):
        list(iter_stored_batches(bytes(stored)))


@pytest.mark.parametrize("payload", [b"", b"\x90", b"\x80", b"\xdc\xff\xff", b"\xc0", b"\xdd\xff\xff\xff\xff\x00"])
def test_bad_payloads_are_refused(payload):
    with pytest.raises(CorruptBatch):
        payload_record_count(payload)


def test_partitioner_is_crc32_and_documented_values_hold():
    assert partition_for_key(b"user-1", 4) == zlib.crc32(b"user-1") % 4
    # Values every client implementation must reproduce (docs/PROTOCOL.md).
    assert [partition_for_key(k, 4) for k in (b"user-1", b"user-2", b"")] == [
        zlib.crc32(b"user-1") % 4, zlib.crc32(b"user-2") % 4, 0]
    with pytest.raises(ValueError):
        partition_for_key(b"x", 0)


def test_error_reply_to_an_unreadable_request_decodes():
    frames = codec.encode_error(None, None, ProtocolError("header is not a valid msgpack map"))
    env = codec.decode_reply(frames)
    assert env.op is None and env.corr_id is None and env.error.code is ErrorCode.BAD_REQUEST


def test_out_of_range_producer_fields_are_refused():
    for fields in ({"producer_id": 1 << 63, "sequence": 0}, {"producer_id": 5, "sequence": -1},
                   {"producer_id": 5, "sequence": 1 << 31}):
        with pytest.raises(ProtocolError):
            m.build(m.Produce, {"topic": "t", "partition": 0, **fields})
    m.build(m.Produce, {"topic": "t", "partition": 0, "producer_id": 0, "sequence": -1})


def test_too_many_frames_error_keeps_the_request_id():
    with pytest.raises(ProtocolError) as info:
        codec.decode_request([msgpack.packb({"v": 1, "op": "status", "id": 41}), b"", b"", b"", b""])
    assert info.value.corr_id == 41


def test_boolean_versions_are_not_versions():
    with pytest.raises(ProtocolError):
        codec.decode_request([msgpack.packb({"v": True, "op": "status", "id": 1})])
    with pytest.raises(ProtocolError):
        m.build(m.Hello, {"versions": [True]})


def test_malformed_stored_records_are_corrupt_batches():
    four_long = [b"abcd", "abcd", {"a": 1, "b": 2, "c": 3, "d": 4}]  # sized like a record, not arrays
    for payload in (msgpack.packb([[1, 2]]), msgpack.packb([5]), *(msgpack.packb([x]) for x in four_long)):
        stored = build_batch_header(payload, base_offset=0, record_count=1, append_time_ms=1) + payload
        with pytest.raises(CorruptBatch):
            decode_fetched(stored, "t", 0)
    payload = msgpack.packb(7)
    stored = build_batch_header(payload, base_offset=0, record_count=1, append_time_ms=1) + payload
    with pytest.raises(CorruptBatch):
        decode_fetched(stored, "t", 0)
    payload = msgpack.packb([[1, None, b"v", None], [2, None, b"w", None, 5]])  # one record too long
    stored = build_batch_header(payload, base_offset=0, record_count=2, append_time_ms=1) + payload
    with pytest.raises(CorruptBatch):
        decode_fetched(stored, "t", 0)


def _declared_type_accepts(value, expected) -> bool:
    """The field type check, read straight off the annotation: what the compiled
    per-field check in protocol.messages must agree with."""
    if isinstance(expected, types.UnionType):
        return any(_declared_type_accepts(value, t) for t in expected.__args__)
    if expected is type(None):
        return value is None
    if expected in (int, float):
        return isinstance(value, (int, float) if expected is float else int) and not isinstance(value, bool)
    return isinstance(value, getattr(expected, "__origin__", None) or expected)


_WIRE_VALUES = [None, True, False, 0, 7, -1, 2**64 - 1, 1.5, 0.0, "", "x", b"", b"x", [], [1, 2], {}, {"k": 1}]


@pytest.mark.parametrize("cls", sorted([c for c in [*m.REQUESTS.values(), *m.REPLIES.values()] if c._fields],
                                       key=lambda c: (c.op, c.__name__)), ids=lambda c: f"{c.op}:{c.__name__}")
def test_the_compiled_field_checks_accept_exactly_what_the_annotations_declare(cls):
    """Every field of every message, against a value of every kind msgpack decodes to."""
    for name, ftype, _required, _default in cls._fields:
        for value in _WIRE_VALUES:
            try:
                m.build(cls, {**_valid_fields(cls), name: value})
                accepted = True
            except ProtocolError as err:
                # check() may refuse the other fields' samples; only this field's type counts.
                accepted = err.data.get("field") != name or "wrong type" not in err.message
            assert accepted == _declared_type_accepts(value, ftype), (cls.op, name, ftype, value)


def _valid_fields(cls) -> dict:
    """Some well-typed value for every field (check() may still refuse them; the test
    above then looks only at whether the one field's type was refused)."""
    sample = {int: 0, str: "t", bool: False, float: 0.0, list: [], dict: {}, type(None): None}
    out = {}
    for name, ftype, _required, _default in cls._fields:
        first = ftype.__args__[0] if isinstance(ftype, types.UnionType) else ftype
        out[name] = sample[getattr(first, "__origin__", None) or first]
    return out


# -- the uniform-batch fast path of validate_payload -------------------------------------

_uniform_batches = st.builds(
    lambda n, size, ts, fill: Blob(encode_values([bytes([fill]) * size] * n, ts)),
    st.integers(1, 40), st.sampled_from([0, 1, 100, 255, 256, 1024, 70_000]),
    st.one_of(st.integers(0, 127), st.integers(0, 2**64 - 1), st.integers(-2**63, -1)), st.integers(0, 255))
_any_batches = st.lists(st.tuples(st.integers(-2**63, 2**64 - 1), st.one_of(st.none(), st.binary(max_size=8)),
                                  st.binary(max_size=40),
                                  st.one_of(st.none(), st.dictionaries(st.text(max_size=3), st.binary(max_size=3),
                                                                       max_size=2))),
                        min_size=1, max_size=20).map(lambda rs: encode_records([list(r) for r in rs]))


@given(st.one_of(_uniform_batches, _any_batches), st.data())
@settings(max_examples=600)
def test_the_byte_level_check_of_a_uniform_batch_agrees_with_decoding_it(payload, data):
    """Whenever the strided byte check answers, decoding the same bytes gives the same
    count; it answers for every batch encode_values makes of equal-sized values; and a
    batch with bytes changed, cut or added is never accepted by it if decoding refuses it."""
    mutated = payload
    how = data.draw(st.sampled_from(["none", "flip", "cut", "add"]))
    if how == "flip":
        i = data.draw(st.integers(0, len(payload) - 1))
        mutated = payload[:i] + bytes([payload[i] ^ data.draw(st.integers(1, 255))]) + payload[i + 1:]
    elif how == "cut":
        mutated = payload[:data.draw(st.integers(0, len(payload) - 1))]
    elif how == "add":
        mutated = payload + data.draw(st.binary(min_size=1, max_size=4))
    fast = uniform_record_count(memoryview(mutated))
    if fast is not None:
        assert validate_by_decoding(mutated) == fast
    else:
        try:
            expected = validate_by_decoding(mutated)
        except CorruptBatch:
            with pytest.raises(CorruptBatch):
                validate_payload(mutated)
        else:
            assert validate_payload(mutated) == expected


@given(_uniform_batches)
def test_encode_values_batches_take_the_byte_level_path(payload):
    assert uniform_record_count(payload) == validate_by_decoding(payload)


@pytest.mark.parametrize("timestamp", [5, -3, 200, 70_000, 2**40, -2**40])
@pytest.mark.parametrize("value_size", [3, 300])
@pytest.mark.parametrize("records", [1, 3])  # one record takes a shorter path of its own
def test_no_single_changed_byte_of_a_uniform_batch_fools_the_byte_level_check(timestamp, value_size, records):
    """Every position of a small uniform batch, set to every other byte value: the byte
    check either gives up or agrees with decoding (which may still accept the change,
    e.g. in a value or a timestamp's digits)."""
    payload = encode_values([b"v" * value_size] * records, timestamp)
    positions = range(len(payload)) if value_size < 10 else [*range(12), *range(len(payload) - 12, len(payload))]
    for i in positions:
        for replacement in range(256):
            if replacement == payload[i]:
                continue
            mutated = payload[:i] + bytes([replacement]) + payload[i + 1:]
            fast = uniform_record_count(mutated)
            if fast is not None:
                assert validate_by_decoding(mutated) == fast, (i, replacement)


def _decoded_by_msgpack_alone(payload: bytes, record_count: int, base: int, lo: int, hi: int) -> list | None:
    """What a consumer must get from a stored payload, from msgpack and the record shape
    rule alone (None: the batch is corrupt): the oracle for decode_fetched's paths.
    msgpack ext types are forbidden anywhere (docs/PROTOCOL.md): a flipped byte can make one."""
    def forbidden(code: int, data: bytes) -> None:
        raise ValueError("ext type")

    try:
        records = msgpack.unpackb(payload, raw=False, use_list=False, ext_hook=forbidden)
    except Exception:
        return None
    if not isinstance(records, tuple) or len(records) != record_count:
        return None
    if not all(isinstance(r, tuple) and len(r) == 4 for r in records):
        return None
    return [ConsumedRecord("t", 3, base + i, *records[i], 77, 2, "new") for i in range(lo, hi)]


@given(st.one_of(_uniform_batches, _any_batches,
                 st.builds(lambda n, size, ts: encode_records([[ts + i % 2, None, b"x" * size, None]
                                                               for i in range(n)]),
                           st.integers(2, 20), st.integers(0, 300), st.integers(0, 2**40))),
       st.integers(0, 2**40), st.data())
@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])
def test_every_decoding_path_gives_the_records_msgpack_gives(payload, base, data):
    """decode_fetched reads a uniform batch with one timestamp off its bytes and decodes
    the rest with msgpack; both must give exactly what msgpack's own decoding gives, for
    any window, and refuse exactly what it refuses (batches changed byte by byte too)."""
    how = data.draw(st.sampled_from(["none", "none", "flip", "cut"]))
    if how == "flip":
        i = data.draw(st.integers(0, len(payload) - 1))
        payload = payload[:i] + bytes([payload[i] ^ data.draw(st.integers(1, 255))]) + payload[i + 1:]
    elif how == "cut":
        payload = payload[:data.draw(st.integers(1, len(payload) - 1))] if len(payload) > 1 else payload
    declared = data.draw(st.sampled_from([payload_record_count_or_one(payload), 1, 2]))
    lo = data.draw(st.integers(0, declared - 1))
    hi = data.draw(st.integers(lo + 1, declared))
    stored = build_batch_header(payload, base_offset=base, record_count=declared, append_time_ms=1) + payload
    expected = _decoded_by_msgpack_alone(payload, declared, base, lo, hi)
    if expected is None:
        with pytest.raises(CorruptBatch):
            decode_fetched(stored, "t", 3, from_offset=base + lo, until_offset=base + hi, make=ConsumedRecord,
                           extra=(77, 2, "new"))
        return
    got = decode_fetched(stored, "t", 3, from_offset=base + lo, until_offset=base + hi, make=ConsumedRecord,
                         extra=(77, 2, "new"))
    assert got == expected
    assert all(type(r) is ConsumedRecord for r in got)


def payload_record_count_or_one(payload: bytes) -> int:
    try:
        return max(1, len(msgpack.unpackb(payload)))
    except Exception:
        return 1


@pytest.mark.parametrize("timestamp", [0, 5, -3, 200, 70_000, 2**40, -2**40, 2**64 - 1])
@pytest.mark.parametrize("value_size", [0, 1, 300, 70_000])
@pytest.mark.parametrize("count, window", [(5, (1, 4)), (1, (0, 1))])  # one record: its own shortcut
def test_a_uniform_batch_with_one_timestamp_is_read_off_its_bytes(timestamp, value_size, count, window,
                                                                  monkeypatch):
    """The byte path really is taken (msgpack is never asked to decode the batch) and
    gives the stored values, with the batch's timestamp on every record."""
    import zbroker.protocol.batch as batch

    values = [bytes([i]) * value_size for i in range(count)]
    payload = encode_values(values, timestamp)
    stored = build_batch_header(payload, base_offset=10, record_count=count, append_time_ms=1) + payload
    monkeypatch.setattr(batch, "_unpacked_records", None)  # calling it would be a TypeError
    records = decode_fetched(stored, "t", 0, from_offset=10 + window[0], until_offset=10 + window[1])
    assert [(r.offset, r.timestamp_ms, r.key, r.value, r.headers) for r in records] == [
        (10 + i, timestamp, None, values[i], None) for i in range(*window)]
    assert decode_fetched(stored, "t", 0, from_offset=10 + count) == []


@pytest.mark.parametrize("msg", [
    m.Join(group="g" * 256, topics=["t"]),
    m.Join(group="a\x00b", topics=["t"]),
    m.ConfigureGroup(group="g" * 256),
    m.ResetGroup(group="", topic="t", to="earliest"),
    m.ConfigureGroup(group="g", dlq="../escape"),
    m.ConfigureGroup(group="g", dlq="d" * 201),
])
def test_group_names_and_dead_letter_topics_the_broker_cannot_store_are_refused_at_the_door(msg):
    # A group name the commit writer refuses would have made it refuse every group's
    # advances (they travel together); a dlq it cannot create left records stuck.
    with pytest.raises(ProtocolError) as caught:
        codec.decode_request(codec.encode_request(msg, 1))
    assert caught.value.code is ErrorCode.BAD_REQUEST


def test_the_longest_group_name_the_writer_stores_is_accepted():
    from zbroker.actors.commit_writer.core import MAX_NAME_CHARS
    env = codec.decode_request(codec.encode_request(m.Join(group="g" * MAX_NAME_CHARS, topics=["t"]), 1))
    assert env.msg.group == "g" * MAX_NAME_CHARS
    assert codec.decode_request(codec.encode_request(m.ConfigureGroup(group="g", dlq=""), 1)).msg.dlq == ""


def test_hello_sharing_no_version_is_unsupported_version_with_the_supported_list():
    with pytest.raises(ProtocolError) as caught:
        codec.decode_request(codec.encode_request(m.Hello(versions=[2, 3]), 1))
    assert caught.value.code is ErrorCode.UNSUPPORTED_VERSION
    assert caught.value.data["supported"] == list(m.SUPPORTED_VERSIONS)
    assert codec.decode_request(codec.encode_request(m.Hello(versions=[1, 2]), 1)).msg.versions == [1, 2]


@pytest.mark.parametrize("msg", [
    m.Nack(group="g", member_id="m", generation=1, ranges=[], delay_ms=m.MAX_LEASE_MS + 1),
    m.Extend(group="g", member_id="m", generation=1, ranges=[], extend_ms=10 ** 15),
    m.ConfigureGroup(group="g", ack_timeout_ms=m.MAX_LEASE_MS + 1),
])
def test_leases_and_nack_delays_longer_than_twelve_hours_are_refused_with_the_limit(msg):
    # A few digits too many would otherwise park a record, and the group's committed
    # offset behind it, for years.
    with pytest.raises(ProtocolError) as caught:
        codec.decode_request(codec.encode_request(msg, 1))
    assert caught.value.code is ErrorCode.BAD_REQUEST
    assert caught.value.data["limit"] == m.MAX_LEASE_MS


def test_a_twelve_hour_lease_is_accepted():
    for msg in (m.Nack(group="g", member_id="m", generation=1, ranges=[], delay_ms=m.MAX_LEASE_MS),
                m.Extend(group="g", member_id="m", generation=1, ranges=[], extend_ms=m.MAX_LEASE_MS),
                m.ConfigureGroup(group="g", ack_timeout_ms=m.MAX_LEASE_MS)):
        assert codec.decode_request(codec.encode_request(msg, 1)).msg == msg


@pytest.mark.parametrize("lease_id", [-1, -(1 << 63)])  # (msgpack cannot carry 2**64 or more)
def test_a_lease_id_outside_uint64_is_a_bad_request_not_a_stale_lease(lease_id):
    # Found by a newcomer's raw-protocol probe: -1 was answered STALE_LEASE, as if it
    # had once been a lease; PROTOCOL.md types lease_id as uint64.
    for msg, key in ((m.Ack(group="g", member_id="m", generation=1, ranges=[["t", 0, lease_id, 0, 1]]), "ranges"),
                     (m.Poll(group="g", member_id="m", generation=1, acks=[["t", 0, lease_id, 0, 1]]), "acks")):
        with pytest.raises(ProtocolError) as caught:
            codec.decode_request(codec.encode_request(msg, 1))
        assert caught.value.code is ErrorCode.BAD_REQUEST
        assert (caught.value.data["field"], caught.value.data["index"]) == (f"{key}.lease_id", 0)


@pytest.mark.parametrize("member_id", ["m" * (m.MAX_MEMBER_ID_CHARS + 1), "m" * 1_000_000, "a\x00b"])
def test_a_member_id_the_coordinator_would_keep_and_show_is_bounded(member_id):
    # A reviewer joined with a 1,000,000-character id: from then on describe_group of the
    # whole group was TOO_LARGE for every client, and each log line of it 1 MB.
    with pytest.raises(ProtocolError) as caught:
        codec.decode_request(codec.encode_request(m.Join(group="g", topics=["t"], member_id=member_id), 1))
    assert caught.value.code is ErrorCode.BAD_REQUEST and caught.value.data["field"] == "member_id"
    longest = "m" * m.MAX_MEMBER_ID_CHARS
    assert codec.decode_request(codec.encode_request(m.Join(group="g", topics=["t"], member_id=longest),
                                                     1)).msg.member_id == longest


def test_one_request_settles_at_most_max_ranges_per_request():
    # 100,000 ranges under distinct leases cost the coordinator 240 ms, every other client waiting.
    ranges = [["t", 0, 10**9 + i, i, i + 1] for i in range(m.MAX_RANGES_PER_REQUEST + 1)]
    for msg in (m.Ack(group="g", member_id="a", generation=1, ranges=ranges),
                m.Poll(group="g", member_id="a", generation=1, acks=ranges)):
        with pytest.raises(ProtocolError) as caught:
            codec.decode_request(codec.encode_request(msg, 1))
        assert caught.value.data["limit"] == m.MAX_RANGES_PER_REQUEST
    ok = m.Ack(group="g", member_id="a", generation=1, ranges=ranges[:-1])
    assert len(codec.decode_request(codec.encode_request(ok, 1)).msg.ranges) == m.MAX_RANGES_PER_REQUEST


# -- PROTOCOL.md s.3/s.7: what a refused header is answered with ------------------------

def _refused(header_bytes: bytes) -> tuple:
    """What the actor's error reply to this frame 0 says: (id, op, code, data)."""
    with pytest.raises(ProtocolError) as caught:
        codec.decode_request([header_bytes])
    back = codec.decode_reply(codec.encode_error(caught.value.op, caught.value.corr_id, caught.value))
    return back.corr_id, back.op, back.error.code, back.error.data


_EXT = msgpack.ExtType(5, b"\x01")


@pytest.mark.parametrize("header", [
    {"v": 1, "op": "status", "id": 41, "x": _EXT},
    {"x": _EXT, "v": 1, "op": "status", "id": 41},  # the ext comes before the id in the map
    {"v": 1, "op": "metadata", "id": 41, "topics": [{"a": _EXT}]},
], ids=["after", "before", "nested"])
def test_a_header_with_an_ext_value_is_refused_under_its_own_id(header):
    # A client that matches replies by id timed out on these: the error went out with id nil.
    corr_id, op, code, data = _refused(msgpack.packb(header))
    assert (corr_id, op, code, data["ext_code"]) == (41, header["op"], ErrorCode.BAD_REQUEST, 5)


def test_an_ext_id_cannot_be_echoed():
    corr_id, op, code, data = _refused(msgpack.packb({"v": 1, "op": "status", "id": _EXT}))
    assert (corr_id, op, code, data["ext_code"]) == (None, "status", ErrorCode.BAD_REQUEST, 5)


@pytest.mark.parametrize("extra", [b"\xc0", b"\x01\x02\x03", msgpack.packb({"v": 1, "op": "status", "id": 9})])
def test_bytes_after_the_header_map_are_refused_under_the_request_id(extra):
    corr_id, op, code, data = _refused(msgpack.packb({"v": 1, "op": "status", "id": 7}) + extra)
    assert (corr_id, op, code, data) == (7, "status", ErrorCode.BAD_REQUEST, {"trailing_bytes": len(extra)})


@pytest.mark.parametrize("op, got", [(None, "nil"), (3, "int"), (b"status", "bin"), (["status"], "array"),
                                     ("missing", None)])
def test_a_missing_or_non_string_op_is_a_bad_request_naming_the_field(op, got):
    header = {"v": 1, "id": 12} if op == "missing" else {"v": 1, "op": op, "id": 12}
    corr_id, reply_op, code, data = _refused(msgpack.packb(header))
    assert (corr_id, reply_op, code) == (12, None, ErrorCode.BAD_REQUEST)
    assert data == ({"field": "op", "expected": "str"} if got is None else {"field": "op", "expected": "str", "got": got})


def test_an_unknown_string_op_is_unknown_op():
    corr_id, op, code, data = _refused(msgpack.packb({"v": 1, "op": "frobnicate", "id": 12}))
    assert (corr_id, op, code, data) == (12, "frobnicate", ErrorCode.UNKNOWN_OP, {"op": "frobnicate"})


@pytest.mark.parametrize("key, value", [("ok", True), ("ok", False), ("error", None)])
def test_a_request_carrying_ok_or_error_is_refused(key, value):
    # On a socket carrying both directions such a request would be read as a reply.
    corr_id, op, code, data = _refused(msgpack.packb({"v": 1, "op": "status", "id": 3, key: value}))
    assert (corr_id, op, code, data) == (3, "status", ErrorCode.BAD_REQUEST, {"field": key})


def test_an_id_of_the_wrong_type_names_the_field_in_wire_words():
    corr_id, _, code, data = _refused(msgpack.packb({"v": 1, "op": "status", "id": "7"}))
    assert (corr_id, code, data) == (None, ErrorCode.BAD_REQUEST, {"field": "id", "expected": "uint64 | nil",
                                                                   "got": "str"})


# -- data.field is always set, data.got / data.expected are wire words -------------------

_ANY_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=False),
                       st.text(max_size=8), st.binary(max_size=8),
                       st.lists(st.one_of(st.integers(-3, 3), st.text(max_size=3),
                                          st.lists(st.integers(-3, 3), max_size=6)), max_size=4),
                       st.dictionaries(st.text(max_size=3), st.integers(-3, 3), max_size=2))
_REQUEST_OPS = sorted(m.REQUESTS)


@given(op=st.sampled_from(_REQUEST_OPS), data=st.data())
def test_every_refused_field_is_named_and_described_in_wire_words(op, data):
    cls = m.REQUESTS[op]
    fields = {name: data.draw(_ANY_VALUE, label=name) for name, *_ in cls._fields
              if data.draw(st.booleans(), label=f"send {name}")}
    try:
        m.build(cls, fields)
    except ProtocolError as err:
        assert err.data.get("field"), (op, fields, err.message, err.data)
        assert err.data["field"].split(".")[0] in {name for name, *_ in cls._fields}, err.data
        if "expected" in err.data:
            words = err.data["expected"].split(" | ")
            assert set(words) <= m.FAMILIES and err.data["got"] in m.FAMILIES, err.data


def _calls_without_field(source: str) -> list[int]:
    import ast

    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ProtocolError"
            and "field" not in {k.arg for k in node.keywords}]


def test_every_protocol_error_of_a_message_names_its_field():
    # The property test above reaches only what random fields reach; this reads them all.
    source = Path(m.__file__).read_text(encoding="utf-8")
    assert _calls_without_field(source) == []
    # ...and finds one like those `hello` and `poll` raised before.
    assert _calls_without_field('raise ProtocolError("\'max_records\' out of range", op="poll")\n') == [1]


def test_wire_words_for_every_declared_type():
    declared = {m._type_name(ftype) for table in (m.REQUESTS, m.REPLIES) for cls in table.values()
                for _, ftype, *_ in cls._fields}
    assert {w for name in declared for w in name.split(" | ")} <= m.FAMILIES
    assert [m.family(v) for v in (None, True, 1, 1.5, "s", b"b", [], {}, msgpack.ExtType(1, b""))] == [
        "nil", "bool", "int", "float", "str", "bin", "array", "map", "ext"]
