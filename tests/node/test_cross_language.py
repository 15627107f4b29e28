"""The Node.js client against the Python protocol code, without a broker.

Pure checks run `clients/node/selfcheck.js` on JSON input: the key partitioner
and CRC agree; frames the Node client builds decode (byte for byte) with
`protocol.codec` and `protocol.batch`; stored batches and replies built by the
Python code decode in Node; the hex example in docs/PROTOCOL.md is what both
codecs produce; and every op, field and error code of `protocol/` is in the
document.

Socket checks run the Node client against `FakeBroker` below: one ROUTER playing
the coordinator and one playing a partition actor, which decode every request
with `protocol.codec` (so a frame the Node client gets wrong fails the test) and
answer with the behaviour docs/PROTOCOL.md describes, plus injected faults
(a lost produce reply, a fenced poll, an expired lease). It stands in until the
real broker runs; tests/node/test_node_client.py is the real thing.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
import uuid
from pathlib import Path

import msgpack
import pytest
import zmq

from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.batch import build_batch_header, decode_fetched, encode_records, iter_stored_batches, validate_payload
from zbroker.protocol.errors import (RETRIABLE, CorruptBatch, DuplicateSequence, ErrorCode, Fenced, OffsetOutOfRange,
                             ProtocolError, StaleLease, TopicExists, UnknownMember, UnknownOp, UnknownTopic,
                             ZBrokerError)
from zbroker.protocol.partitioner import partition_for_key

pytestmark = [pytest.mark.node, pytest.mark.processes]  # each test runs node

REPO = Path(__file__).resolve().parents[2]
PROTOCOL_MD = REPO / "docs" / "PROTOCOL.md"


def selfcheck(run_node, command: str, payload: object | None = None, *args: str, timeout: float = 60) -> dict:
    proc = run_node("selfcheck.js", command, *args, input=payload, timeout=timeout)
    assert proc.returncode == 0, f"selfcheck {command} failed:\n{proc.stderr}"
    return json.loads(proc.stdout, object_hook=_bigint)


def _bigint(obj: dict):
    """selfcheck.js writes a BigInt as {"$bigint": "<decimal>"}."""
    return int(obj["$bigint"]) if set(obj) == {"$bigint"} else obj


# ---------------------------------------------------------------------------------------
# Pure checks
# ---------------------------------------------------------------------------------------

def test_partitioner_is_identical(run_node):
    rng = random.Random(7)
    keys = [b"", b"user-1", b"user-2", "ключ-ü".encode(), bytes(range(256))]
    keys += [rng.randbytes(rng.randrange(1, 40)) for _ in range(300)]
    counts = [1, 2, 3, 4, 7, 16, 1000, 10_000]
    out = selfcheck(run_node, "partition", {"keys": [k.hex() for k in keys], "partitions": counts})
    expected = [[partition_for_key(k, n) for n in counts] for k in keys]
    assert out["results"] == expected
    # The worked example of PROTOCOL.md section 12.
    assert partition_for_key(b"user-1", 4) == 0 and partition_for_key(b"user-2", 4) == 2


def test_crc32_is_identical(run_node):
    import zlib
    data = [b"123456789", b"", b"\x00" * 1000, bytes(range(256)) * 3]
    out = selfcheck(run_node, "crc", {"data": [d.hex() for d in data]})
    assert out["crc"] == [zlib.crc32(d) for d in data]
    assert out["crc"][0] == 0xCBF43926


SAMPLE_RECORDS = [
    [1_767_225_600_000, b"user-1", b"hello", {"trace": b"abc"}],
    [0, None, b"", None],
    [2**53 - 1, b"\x00\xff", b"v" * 70_000, {"h\u00e9ader": b"", "n": b"\x01\x02"}],
    [-1, b"k", b"negative timestamps are still ints", {}],
    [1_700_000_000_123, None, bytes(range(256)), {"a": b"1", "b": b"2", "c": b"3"}],
]


def _records_json(records):
    return [{"timestampMs": ts, "key": None if k is None else k.hex(), "value": v.hex(),
             "headers": None if h is None else {name: val.hex() for name, val in h.items()}}
            for ts, k, v, h in records]


@pytest.mark.parametrize("producer_id,sequence", [(0, -1), (1, 0), (2**63 - 1, 2**31 - 1), (3413179181191910423, 17)])
def test_node_produce_frames_decode_in_python(run_node, producer_id, sequence):
    out = selfcheck(run_node, "produce-frames", {
        "topic": "orders", "partition": 3, "producerId": str(producer_id), "sequence": sequence, "id": 99,
        "records": _records_json(SAMPLE_RECORDS)})
    frames = [bytes.fromhex(f) for f in out["frames"]]
    env = codec.decode_request(frames)
    assert env.op == "produce" and env.corr_id == 99
    assert (env.msg.topic, env.msg.partition, env.msg.producer_id, env.msg.sequence) == (
        "orders", 3, producer_id, sequence)
    assert validate_payload(frames[1]) == len(SAMPLE_RECORDS)
    assert msgpack.unpackb(frames[1], raw=False) == SAMPLE_RECORDS
    # Not only equivalent: the same bytes the Python codec writes.
    python = codec.encode_request(m.Produce(topic="orders", partition=3, producer_id=producer_id,
                                            sequence=sequence), 99, [encode_records(SAMPLE_RECORDS)])
    assert frames == python


def _stored_blob(batches: list[tuple[int, list, int, int]]) -> bytes:
    blob = b""
    for base, records, pid, seq in batches:
        payload = encode_records(records)
        blob += build_batch_header(payload, base_offset=base, record_count=len(records),
                                   append_time_ms=1_767_225_600_123, producer_id=pid, producer_seq=seq) + payload
    return blob


def _python_records(blob: bytes, start: int, until: int | None):
    return [{"offset": r.offset, "timestampMs": r.timestamp_ms, "key": None if r.key is None else r.key.hex(),
             "value": r.value.hex(),
             "headers": None if r.headers is None else {k: v.hex() for k, v in r.headers.items()}}
            for r in decode_fetched(blob, "t", 0, from_offset=start, until_offset=until)]


BATCHES = [
    (40, SAMPLE_RECORDS[:3], 3413179181191910423, 0),
    (43, SAMPLE_RECORDS[3:], 0, -1),
    (45, SAMPLE_RECORDS, 2**63 - 1, 2**31 - 1),
    (2**40, SAMPLE_RECORDS[:1], 5, 1),
]


@pytest.mark.parametrize("start,until", [(0, None), (40, None), (41, None), (44, 47), (46, 2**40), (2**40, None),
                                         (2**40 + 1, None)])
def test_node_decodes_python_stored_batches(run_node, start, until):
    blob = _stored_blob(BATCHES)
    out = selfcheck(run_node, "decode-batches", {"blob": blob.hex(), "fromOffset": start, "untilOffset": until})
    assert "error" not in out, out
    assert out["records"] == _python_records(blob, start, until)
    headers = [h for h, _payload in iter_stored_batches(blob)]
    assert [(b["baseOffset"], b["recordCount"], int(b["producerId"]), b["producerSeq"], b["crc"])
            for b in out["batches"]] == [(h.base_offset, h.record_count, h.producer_id, h.producer_seq, h.crc)
                                         for h in headers]
    assert out["nextOffset"] == headers[-1].next_offset


def test_node_decodes_empty_fetch_frame(run_node):
    out = selfcheck(run_node, "decode-batches", {"blob": "", "fromOffset": 12})
    assert out == {"records": [], "batches": [], "nextOffset": 12}


@pytest.mark.parametrize("damage", ["payload_bit", "header_bit", "magic", "truncated", "short_header"])
def test_node_rejects_damaged_batches_like_python(run_node, damage):
    blob = bytearray(_stored_blob(BATCHES[:2]))
    if damage == "payload_bit":
        blob[60] ^= 0x01
    elif damage == "header_bit":
        blob[25] ^= 0x80  # append_time_ms is covered by the CRC
    elif damage == "magic":
        blob[0:4] = b"ZBB2"
    elif damage == "truncated":
        blob = blob[:-1]
    elif damage == "short_header":
        blob = blob + b"ZBB1" + b"\x00" * 10
    with pytest.raises(CorruptBatch):
        list(iter_stored_batches(bytes(blob)))
    out = selfcheck(run_node, "decode-batches", {"blob": bytes(blob).hex()})
    assert out["error"]["code"] == "CORRUPT_BATCH", out


# Header names are application data: "__proto__" is as good as any (the broker accepts it).
PROTO_RECORDS = [
    [1, b"k", b"v", {"__proto__": b"x", "constructor": b"y", "toString": b"", "a": b"1"}],
    [2, None, b"w", {"__proto__": b""}],
]


def test_node_decodes_a_header_named_proto(run_node):
    blob = _stored_blob([(7, PROTO_RECORDS, 0, -1)])
    out = selfcheck(run_node, "decode-each", {"blobs": [blob.hex()]})
    assert out["results"] == [{"records": _python_records(blob, 0, None), "nullPrototypeHeaders": True}]


@pytest.mark.parametrize("headers_as_map", [False, True])
def test_node_encodes_a_header_named_proto(run_node, headers_as_map):
    out = selfcheck(run_node, "produce-frames", {
        "topic": "t", "partition": 0, "producerId": "0", "sequence": -1, "id": 1,
        "records": _records_json(PROTO_RECORDS), "headersAsMap": headers_as_map})
    payload = bytes.fromhex(out["frames"][1])
    assert msgpack.unpackb(payload, raw=False) == PROTO_RECORDS
    assert payload == encode_records(PROTO_RECORDS)


def _record(ts: bytes = b"\x01", key: bytes = b"\xc0", value: bytes = b"\xc4\x01v", headers: bytes = b"\xc0",
            head: bytes = b"\x94") -> bytes:
    """One record's bytes, written by hand: any msgpack width, or anything else."""
    return head + ts + key + value + headers


# Payloads (of one record unless they say otherwise) that msgpack decodes to a valid batch,
# in the widths a packer may choose besides the shortest.
VALID_PAYLOADS = {
    "array16 payload": b"\xdc\x00\x01" + _record(),
    "array32 payload": b"\xdd\x00\x00\x00\x01" + _record(),
    "array16 record": b"\x91" + _record(head=b"\xdc\x00\x04"),
    "array32 record": b"\x91" + _record(head=b"\xdd\x00\x00\x00\x04"),
    "timestamps of every width": b"\xdc\x00\x0b" + b"".join(_record(ts=ts) for ts in (
        b"\x7f", b"\xe0", b"\xff", b"\xcc\xff", b"\xcd\x01\x00", b"\xce\xff\xff\xff\xff",
        b"\xcf" + (2**63 + 5).to_bytes(8, "big"), b"\xd0\x80", b"\xd1\x80\x00", b"\xd2\x80\x00\x00\x00",
        b"\xd3" + (-2**63).to_bytes(8, "big", signed=True))),
    "bin16 and bin32": b"\x91" + _record(key=b"\xc5\x00\x03abc", value=b"\xc6\x00\x00\x00\x02ab"),
    "empty value": b"\x91" + _record(value=b"\xc4\x00"),
    "large value": b"\x91" + _record(value=b"\xc5\x01\x00" + bytes(range(256))),
    "empty headers": b"\x91" + _record(headers=b"\x80"),
    "map16 and name widths": b"\x91" + _record(headers=b"\xde\x00\x03" + b"\xd9\x01a\xc4\x01A"
                                               + b"\xda\x00\x02bb\xc4\x00" + b"\xdb\x00\x00\x00\x01c\xc4\x01C"),
    "map32": b"\x91" + _record(headers=b"\xdf\x00\x00\x00\x01\xa1a\xc4\x01A"),
    "unicode names": b"\x91" + _record(headers=b"\x82" + msgpack.packb("h\u00e9") + b"\xc4\x00"
                                       + msgpack.packb("\u043a\u043b\u044e\u0447") + b"\xc4\x01x"),
    "repeated name, last wins": b"\x91" + _record(headers=b"\x82\xa1a\xc4\x011\xa1a\xc4\x012"),
    "proto name": b"\x91" + _record(headers=b"\x81\xa9__proto__\xc4\x01p"),
}

# Payloads the partition actor refuses (validate_payload): a reader must refuse them too.
INVALID_PAYLOADS = {
    "not an array": b"\x81\xa1a\xc0",
    "trailing byte": b"\x91" + _record() + b"\xc0",
    "record not an array": b"\x91\xc0",
    "3-array record": b"\x91\x93\x01\xc0\xc4\x01v",
    "5-array record": b"\x91" + _record(head=b"\x95") + b"\xc0",
    "float timestamp": b"\x91" + _record(ts=b"\xcb" + bytes(8)),
    "bool timestamp": b"\x91" + _record(ts=b"\xc3"),
    "nil timestamp": b"\x91" + _record(ts=b"\xc0"),
    "str key": b"\x91" + _record(key=b"\xa1k"),
    "str value": b"\x91" + _record(value=b"\xa1v"),
    "nil value": b"\x91" + _record(value=b"\xc0"),
    "headers an array": b"\x91" + _record(headers=b"\x90"),
    "header value str": b"\x91" + _record(headers=b"\x81\xa1a\xa1b"),
    "header value nil": b"\x91" + _record(headers=b"\x81\xa1a\xc0"),
    "header name bin": b"\x91" + _record(headers=b"\x81\xc4\x01a\xc4\x01b"),
    "header name int": b"\x91" + _record(headers=b"\x81\x01\xc4\x01b"),
    "header name not UTF-8": b"\x91" + _record(headers=b"\x81\xa1\xff\xc4\x01b"),
    "ext timestamp": b"\x91" + _record(ts=b"\xd4\x01\x00"),
    "ext header value": b"\x91" + _record(headers=b"\x81\xa1a\xd4\x01\x00"),
}


def _one_batch(payload: bytes, count: int) -> bytes:
    return build_batch_header(payload, base_offset=0, record_count=count, append_time_ms=1) + payload


def test_node_payload_reader_agrees_with_python(run_node):
    """The hand-written payload reader: what msgpack decodes to a valid batch decodes alike,
    and what the partition actor would refuse (every prefix of a valid payload too) is
    CORRUPT_BATCH, never a JavaScript error."""
    valid = {name: _one_batch(p, validate_payload(p)) for name, p in VALID_PAYLOADS.items()}
    for payload in INVALID_PAYLOADS.values():
        with pytest.raises(CorruptBatch):
            validate_payload(payload)
    full = encode_records(SAMPLE_RECORDS + PROTO_RECORDS)
    count = len(SAMPLE_RECORDS + PROTO_RECORDS)
    invalid = {name: _one_batch(p, 1) for name, p in INVALID_PAYLOADS.items()}
    invalid["more records than the header says"] = _one_batch(full, count - 1)
    invalid["fewer records than the header says"] = _one_batch(full, count + 1)
    invalid.update({f"cut at {n}": _one_batch(full[:n], count) for n in range(0, len(full), 97)})
    invalid.update({f"cut at {n}": _one_batch(full[:n], count) for n in range(len(full) - 64, len(full))})
    blobs = {**valid, **invalid}
    out = selfcheck(run_node, "decode-each", {"blobs": [b.hex() for b in blobs.values()]})
    results = dict(zip(blobs, out["results"]))
    for name, blob in valid.items():
        assert results[name] == {"records": _python_records(blob, 0, None), "nullPrototypeHeaders": True}, name
    for name in invalid:
        assert results[name].get("error", {}).get("code") == "CORRUPT_BATCH", (name, results[name])


def test_node_refuses_offsets_it_cannot_represent(run_node):
    """Offsets are JS numbers: up to 2^53 - 1 they are exact; a batch reaching past that is a
    local TOO_LARGE, never silently rounded offsets."""
    records = SAMPLE_RECORDS[:2]
    fits = _stored_blob([(2**53 - 3, records, 0, -1)])
    out = selfcheck(run_node, "decode-batches", {"blob": fits.hex()})
    assert [r["offset"] for r in out["records"]] == [2**53 - 3, 2**53 - 2] and out["nextOffset"] == 2**53 - 1
    beyond = _stored_blob([(0, records, 0, -1), (2**53 - 2, records, 0, -1)])
    err = selfcheck(run_node, "decode-batches", {"blob": beyond.hex()})["error"]
    assert (err["code"], err["local"], err["retriable"]) == ("TOO_LARGE", True, False), err
    assert err["data"]["limit"] == 2**53 - 1 and err["data"]["got"] == 2**53 and err["data"]["base_offset"] == 2**53 - 2


def _reply_cases() -> list[tuple[str, list]]:
    cases = [
        ("produce", codec.encode_reply(m.ProduceReply(base_offset=2**40, count=3, duplicate=True), 5)),
        # Lease ids are clock-derived and above 2^53: they must survive a JS client exactly.
        ("poll", codec.encode_reply(m.PollReply(generation=4, deliveries=[
            ["t", 1, 2**45 + 3, 10, 20, 2, "nack:slow"], ["t", 0, (1_767_225_600_000 << 20) + 1, 0, 5, 1, "new"],
            ["t", 0, 2**64 - 1, 2**53 + 1, 2**53 + 2, 1, "new"]], ack_timeout_ms=30_000), 6)),
        ("hello", codec.encode_reply(m.HelloReply(version=1, server="zbroker", actor="partition-log:a1",
                                                  limits={"max_batch_bytes": 8 << 20}), 7)),
        ("stale", codec.encode_error("ack", 8, StaleLease("lease expired", stale=[["t", 0, 5, 12, 13]], applied=2))),
        ("fenced", codec.encode_error("poll", 9, Fenced("generation 3 < 4", generation=4))),
        ("unknown_code", [msgpack.packb({"v": 1, "op": "fetch", "id": 10, "ok": False, "error": {
            "code": "SOMETHING_NEW", "message": "from the future", "retriable": True, "data": {}}})]),
    ]
    try:
        codec.decode_request([msgpack.packb({"v": 2, "op": "hello", "id": 11, "versions": [2]})])
    except ProtocolError as err:
        cases.append(("unsupported", codec.encode_error(err.op, err.corr_id, err)))
    return cases


def test_node_decodes_python_replies(run_node):
    for name, frames in _reply_cases():
        out = selfcheck(run_node, "decode-reply", {"frames": [f.hex() for f in frames]})
        header = msgpack.unpackb(frames[0], raw=False)
        if header["ok"]:
            assert out["header"] == header, name
            continue
        err = out["error"]
        wire = header["error"]
        assert err["code"] == wire["code"] and err["data"] == wire["data"], name
        assert err["retriable"] == wire["retriable"], name
        if name == "unsupported":
            assert err["code"] == "UNSUPPORTED_VERSION" and err["data"] == {"supported": [1]}
            assert out["header"]["id"] == 11 and out["header"]["op"] == "hello"


def _doc_hex(marker: str) -> bytes:
    text = PROTOCOL_MD.read_text()
    match = re.search(rf"<!-- hex:{marker} -->\s*```text\n(.*?)```", text, re.S)
    assert match, f"PROTOCOL.md has no hex block {marker}"
    return bytes.fromhex(match.group(1))


def test_protocol_md_worked_example_is_what_the_codecs_produce(run_node):
    payload = encode_records([[1_767_225_600_000, b"user-1", b"hello", {"trace": b"abc"}]])
    pid = 3413179181191910423
    partition = partition_for_key(b"user-1", 4)
    frames = codec.encode_request(m.Produce(topic="orders", partition=partition, producer_id=pid, sequence=0),
                                  7, [payload])
    assert _doc_hex("produce-frame0") == frames[0]
    assert _doc_hex("produce-frame1") == frames[1] == payload
    assert _doc_hex("produce-reply") == codec.encode_reply(m.ProduceReply(base_offset=42, count=1), 7)[0]
    header = build_batch_header(payload, base_offset=42, record_count=1, append_time_ms=1_767_225_600_123,
                                producer_id=pid, producer_seq=0)
    assert _doc_hex("stored-header") == header
    node = selfcheck(run_node, "doc-example")
    assert node["partition"] == partition == 0
    assert [bytes.fromhex(f) for f in node["frames"]] == frames


def test_protocol_md_covers_every_op_field_and_error_code(run_node):
    doc = PROTOCOL_MD.read_text()
    for table in (m.REQUESTS, m.REPLIES):
        for op, cls in table.items():
            assert f"`{op}`" in doc, f"op {op} is not documented"
            for name, *_rest in cls._fields:
                assert f"`{name}" in doc, f"field {name} of {op} is not documented"
    for op in m.TELLS:
        assert re.search(rf"`{op}` \(tell\)", doc), f"tell {op} is not marked"
    rows = dict(re.findall(r"^\| `([A-Z_]+)` \| (yes|no) \|", doc, re.M))
    assert set(rows) == {c.value for c in ErrorCode}
    for code in ErrorCode:
        assert rows[code.value] == ("yes" if RETRIABLE[code] else "no"), code
    node = selfcheck(run_node, "retriable")
    assert node == {c.value: RETRIABLE[c] for c in ErrorCode}


# ---------------------------------------------------------------------------------------
# A fake broker speaking protocol v1 through protocol.codec
# ---------------------------------------------------------------------------------------

class FakeBroker:
    """A coordinator ROUTER and one partition-actor ROUTER served by one thread.

    Faults, each used once when enabled: ``drop_produce_reply`` appends the next
    produce but sends no reply; ``fence_first_poll`` answers the first poll after the
    first join with FENCED (and bumps the generation); ``expire_first_lease`` lets
    the first lease expire at once, so its ack is STALE_LEASE and it is redelivered;
    ``drop_acking_poll_reply`` applies the acks of the next poll carrying some but
    sends no reply. ``fail_once`` maps an op to an error code its next request is
    answered with, before anything is applied (as the coordinator answers UNAVAILABLE
    while it reloads offsets).
    """

    ACK_TIMEOUT_MS = 30_000
    MAX_FETCH_BYTES = 8 * 1024

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.coord = self._router()
        self.part = self._router()
        self.url = self.coord.getsockopt_string(zmq.LAST_ENDPOINT)
        self.part_url = self.part.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topics: dict[str, int] = {}
        self.logs: dict[tuple[str, int], list[tuple[int, int, bytes]]] = {}
        self.producers: dict[tuple[str, int, int], dict[int, tuple[int, int]]] = {}
        self.parked: list[tuple[float, bytes, object, m.Fetch]] = []
        self.groups: dict[str, dict] = {}
        # Like the coordinator: clock-derived lease ids, far above 2^53.
        self.next_lease = (int(time.time() * 1000) << 20) + 1
        self.faults = {"drop_produce_reply": False, "fence_first_poll": False, "expire_first_lease": False,
                       "drop_acking_poll_reply": False}
        self.fail_once: dict[str, str] = {}  # op -> error code for its next request
        self.ranges_per_request: dict[str, list[int]] = {}  # "ack" or "poll" -> ranges (acks) per request
        self.seen: dict[str, int] = {}  # op or error code -> count
        self.rejected: list[str] = []   # requests protocol.codec refused
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fake-broker", daemon=True)
        self._error: BaseException | None = None

    def _router(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind("tcp://127.0.0.1:*")
        return sock

    def __enter__(self) -> "FakeBroker":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        self.coord.close(linger=0)
        self.part.close(linger=0)
        self.ctx.term()
        if self._error is not None:
            raise self._error

    def count(self, key: str) -> None:
        self.seen[key] = self.seen.get(key, 0) + 1

    # -- loop ---------------------------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.coord, zmq.POLLIN)
        poller.register(self.part, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(20))
                for sock in (self.coord, self.part):
                    if sock in ready:
                        identity, *frames = sock.recv_multipart()
                        self._on_request(sock, identity, frames)
                now = time.monotonic()
                for entry in [p for p in self.parked if p[0] <= now]:
                    self.parked.remove(entry)
                    self._reply_fetch(entry[1], entry[2], entry[3])
        except BaseException as exc:  # surfaced by __exit__
            self._error = exc

    def _on_request(self, sock: zmq.Socket, identity: bytes, frames: list) -> None:
        try:
            env = codec.decode_request(frames)
        except ProtocolError as err:
            self.rejected.append(f"{err.code.value}: {err.message}")
            sock.send_multipart([identity, *codec.encode_error(err.op, err.corr_id, err)])
            return
        self.count(env.op)
        handler = getattr(self, f"{'c' if sock is self.coord else 'p'}_{env.op}", None)
        try:
            if env.op in self.fail_once:
                raise ZBrokerError("injected", code=ErrorCode(self.fail_once.pop(env.op)))
            if handler is None:
                raise UnknownOp(f"op {env.op!r} is not served here", op=env.op)
            result = handler(identity, env)
        except ZBrokerError as err:
            self.count(err.code.value)
            sock.send_multipart([identity, *codec.encode_error(env.op, env.corr_id, err)])
            return
        if result is not None:
            msg, extra = result if isinstance(result, tuple) else (result, [])
            sock.send_multipart([identity, *codec.encode_reply(msg, env.corr_id, extra)])

    # -- common and topics (coordinator) ------------------------------------------------

    def _hello(self, env, actor: str, limits: dict):
        shared = [v for v in env.msg.versions if v in m.SUPPORTED_VERSIONS]
        if not shared:
            raise ProtocolError("no shared version", code=ErrorCode.UNSUPPORTED_VERSION,
                                supported=list(m.SUPPORTED_VERSIONS))
        return m.HelloReply(version=max(shared), server="zbroker-fake", actor=actor, limits=limits)

    def c_hello(self, identity, env):
        return self._hello(env, "group-coordinator", {"max_header_bytes": codec.MAX_HEADER_BYTES})

    def p_hello(self, identity, env):
        return self._hello(env, "partition-log:fake", {"max_header_bytes": codec.MAX_HEADER_BYTES,
                                                       "max_batch_bytes": 1 << 20,
                                                       "max_fetch_bytes": self.MAX_FETCH_BYTES})

    def c_create_topic(self, identity, env):
        msg = env.msg
        if msg.topic in self.topics:
            raise TopicExists("exists", topic=msg.topic, partitions=self.topics[msg.topic])
        self.topics[msg.topic] = msg.partitions
        for p in range(msg.partitions):
            self.logs[(msg.topic, p)] = []
        return m.CreateTopicReply(topic=msg.topic, partitions=msg.partitions)

    def _topic(self, name: str) -> int:
        if name not in self.topics:
            raise UnknownTopic(f"unknown topic {name!r}", topic=name)
        return self.topics[name]

    def c_metadata(self, identity, env):
        names = sorted(self.topics) if env.msg.topics is None else env.msg.topics
        return m.MetadataReply(topics=[{
            "name": t, "config": {},
            "partitions": [{"partition": p, "endpoint": self.part_url, "actor_id": "fake"}
                           for p in range(self._topic(t))]} for t in names])

    def log_end(self, topic: str, partition: int) -> int:
        batches = self.logs[(topic, partition)]
        return batches[-1][0] + batches[-1][1] if batches else 0

    def c_describe_topic(self, identity, env):
        n = self._topic(env.msg.topic)
        return m.DescribeTopicReply(topic=env.msg.topic, config={}, partitions=[
            {"partition": p, "log_start": 0, "log_end": self.log_end(env.msg.topic, p), "bytes": 0,
             "actor_id": "fake", "endpoint": self.part_url} for p in range(n)])

    # -- data plane (partition actor) ---------------------------------------------------

    def p_produce(self, identity, env):
        msg = env.msg
        key = (msg.topic, msg.partition)
        if key not in self.logs:
            raise UnknownTopic("no such partition", topic=msg.topic, partition=msg.partition)
        if len(env.frames) != 1:
            raise ProtocolError("produce carries exactly one payload frame", frames=len(env.frames))
        payload = env.frames[0]
        count = validate_payload(payload)  # strict: every record's shape
        if msg.producer_id:
            seen = self.producers.setdefault((msg.topic, msg.partition, msg.producer_id), {})
            if msg.sequence in seen:
                self.count("duplicate")
                base, n = seen[msg.sequence]
                return m.ProduceReply(base_offset=base, count=n, duplicate=True)
            if seen and msg.sequence < min(seen):
                raise DuplicateSequence("below every remembered batch", producer_id=msg.producer_id,
                                        sequence=msg.sequence, last_sequence=max(seen),
                                        oldest_remembered_sequence=min(seen))
        base = self.log_end(*key)
        header = build_batch_header(payload, base_offset=base, record_count=count,
                                    append_time_ms=int(time.time() * 1000), producer_id=msg.producer_id,
                                    producer_seq=msg.sequence)
        self.logs[key].append((base, count, header + payload))
        if msg.producer_id:
            seen[msg.sequence] = (base, count)
        if self.faults["drop_produce_reply"]:
            self.faults["drop_produce_reply"] = False
            self.count("dropped_reply")
        else:
            reply = codec.encode_reply(m.ProduceReply(base_offset=base, count=count), env.corr_id)
            self.part.send_multipart([identity, *reply])
        # Like the partition actor: the produce reply goes out before the fetches it wakes.
        for entry in [p for p in self.parked if (p[3].topic, p[3].partition) == key]:
            self.parked.remove(entry)
            self._reply_fetch(entry[1], entry[2], entry[3])
        return None

    def p_fetch(self, identity, env):
        msg = env.msg
        if (msg.topic, msg.partition) not in self.logs:
            raise UnknownTopic("no such partition", topic=msg.topic, partition=msg.partition)
        end = self.log_end(msg.topic, msg.partition)
        if msg.offset > end:
            raise OffsetOutOfRange("offset is outside the log", log_start=0, log_end=end)
        if msg.offset == end and msg.max_wait_ms > 0:
            self.count("parked")
            self.parked.append((time.monotonic() + msg.max_wait_ms / 1000, identity, env.corr_id, msg))
            return None
        return self._fetch_reply(msg)

    def _fetch_reply(self, msg: m.Fetch):
        budget = min(max(msg.max_bytes, 1), self.MAX_FETCH_BYTES)
        out = b""
        for base, count, blob in self.logs[(msg.topic, msg.partition)]:
            if base + count <= msg.offset:
                continue
            if out and len(out) + len(blob) > budget:
                break
            out += blob
        end = self.log_end(msg.topic, msg.partition)
        return m.FetchReply(log_start=0, log_end=end), [out]

    def _reply_fetch(self, identity, corr_id, msg):
        reply, frames = self._fetch_reply(msg)
        self.part.send_multipart([identity, *codec.encode_reply(reply, corr_id, frames)])

    # -- groups (coordinator) -----------------------------------------------------------

    def _group(self, name: str) -> dict:
        return self.groups.setdefault(name, {
            "generation": 0, "members": {}, "topics": set(), "next_new": {}, "acked": {}, "leases": {},
            "settled": {}, "ready": [], "fenced": False, "expired_one": False})

    def _member(self, env) -> dict:
        """The coordinator's order: a wrong generation is FENCED, then an unknown member."""
        g = self._group(env.msg.group)
        if env.msg.generation != g["generation"]:
            raise Fenced("stale generation", group=env.msg.group, generation=g["generation"],
                         member_id=env.msg.member_id, member_known=env.msg.member_id in g["members"])
        if env.msg.member_id not in g["members"]:
            raise UnknownMember("unknown member", group=env.msg.group, member_id=env.msg.member_id)
        return g

    def _assignment(self, g: dict) -> list:
        return [[t, p] for t in sorted(g["topics"]) for p in range(self.topics.get(t, 0))]

    def c_join(self, identity, env):
        g = self._group(env.msg.group)
        member = env.msg.member_id
        if member not in g["members"]:  # new (an unknown id is taken as given), else a re-sync
            member = member or uuid.uuid4().hex
            g["generation"] += 1
        g["members"][member] = True
        g["topics"].update(env.msg.topics)
        return m.JoinReply(member_id=member, generation=g["generation"], mode="shared",
                           assignment=self._assignment(g), ack_timeout_ms=self.ACK_TIMEOUT_MS)

    def c_heartbeat(self, identity, env):
        g = self._member(env)
        return m.HeartbeatReply(generation=g["generation"], assignment=self._assignment(g))

    def c_leave(self, identity, env):
        g = self._group(env.msg.group)  # accepted in any generation, for unknown members too
        g["members"].pop(env.msg.member_id, None)
        for lease_id, lease in list(g["leases"].items()):
            if lease["member"] == env.msg.member_id:
                del g["leases"][lease_id]
                g["ready"].append((lease["topic"], lease["partition"], lease["start"], lease["end"],
                                   lease["attempt"], "rebalance"))
        return m.LeaveReply()

    def c_poll(self, identity, env):
        g = self._member(env)
        if self.faults["fence_first_poll"] and not g["fenced"]:
            g["fenced"] = True
            g["generation"] += 1
            raise Fenced("rebalanced", generation=g["generation"])
        acked, stale = 0, []
        if env.msg.acks:
            self.ranges_per_request.setdefault("poll", []).append(len(env.msg.acks))
            acked, stale = self._apply_acks(g, env.msg.member_id, env.msg.acks)
        budget = env.msg.max_records
        deliveries = []
        while g["ready"] and budget > 0:
            topic, partition, start, end, attempt, reason = g["ready"].pop(0)
            deliveries.append(self._lease(g, env.msg.member_id, topic, partition, start, end, attempt + 1, reason))
            budget -= end - start
        for topic, partition in self._assignment(g):
            nxt = g["next_new"].get((topic, partition), 0)
            end = min(self.log_end(topic, partition), nxt + budget)
            if end > nxt:
                deliveries.append(self._lease(g, env.msg.member_id, topic, partition, nxt, end, 1, "new"))
                g["next_new"][(topic, partition)] = end
                budget -= end - nxt
        if env.msg.acks and self.faults["drop_acking_poll_reply"]:
            self.faults["drop_acking_poll_reply"] = False
            self.count("dropped_poll_reply")
            return None
        return m.PollReply(generation=g["generation"], deliveries=deliveries, ack_timeout_ms=self.ACK_TIMEOUT_MS,
                           acked=acked, stale=stale)

    def _lease(self, g, member, topic, partition, start, end, attempt, reason) -> list:
        lease_id = self.next_lease
        self.next_lease += 1
        lease = {"member": member, "topic": topic, "partition": partition, "start": start, "end": end,
                 "attempt": attempt}
        if self.faults["expire_first_lease"] and not g["expired_one"]:
            g["expired_one"] = True  # expires at once: redelivered, and its ack is stale
            g["ready"].append((topic, partition, start, end, attempt, "timeout"))
        else:
            g["leases"][lease_id] = lease
        return [topic, partition, lease_id, start, end, attempt, reason]

    def _apply_acks(self, g: dict, member: str, ranges: list) -> tuple[int, list]:
        """Like the coordinator: acking again under the same lease is counted again, also
        once the lease is settled; a range of a lease this member does not hold is stale."""
        applied, stale, touched = 0, [], set()
        for topic, partition, lease_id, start, end in ranges:
            lease = g["leases"].get(lease_id) or g["settled"].get(lease_id)
            if (lease is None or lease["member"] != member or (lease["topic"], lease["partition"])
                    != (topic, partition) or start < lease["start"] or end > lease["end"]):
                stale.append([topic, partition, lease_id, start, end])
                continue
            g["acked"].setdefault((topic, partition), set()).update(range(start, end))
            applied += end - start
            touched.add(lease_id)
        for lease_id in touched & g["leases"].keys():  # settled once every offset is acked
            lease = g["leases"][lease_id]
            if g["acked"][(lease["topic"], lease["partition"])].issuperset(range(lease["start"], lease["end"])):
                g["settled"][lease_id] = g["leases"].pop(lease_id)
        return applied, stale

    def c_ack(self, identity, env):
        g = self._member(env)
        self.ranges_per_request.setdefault("ack", []).append(len(env.msg.ranges))
        applied, stale = self._apply_acks(g, env.msg.member_id, env.msg.ranges)
        if stale:
            raise StaleLease("lease expired or revoked", group=env.msg.group, member_id=env.msg.member_id,
                             stale=stale, applied=applied)
        return m.AckReply(applied=applied)

    def _committed(self, g, topic, partition) -> int:
        acked = g["acked"].get((topic, partition), set())
        offset = 0
        while offset in acked:
            offset += 1
        return offset

    def c_describe_group(self, identity, env):
        if env.msg.group not in self.groups:
            raise ZBrokerError("no such group", code=ErrorCode.UNKNOWN_GROUP, group=env.msg.group)
        g = self.groups[env.msg.group]
        return m.DescribeGroupReply(group={
            "group": env.msg.group, "mode": "shared", "generation": g["generation"], "config": {},
            "members": [{"member_id": mid, "assignment": self._assignment(g)} for mid in g["members"]],
            "partitions": [{"topic": t, "partition": p, "committed": self._committed(g, t, p),
                            "log_end": self.log_end(t, p)} for t, p in self._assignment(g)]})


@pytest.fixture
def fake_broker():
    with FakeBroker() as broker:
        yield broker


def test_node_client_socket_behaviour_against_fake_broker(run_node, fake_broker):
    fake_broker.faults["drop_produce_reply"] = False
    out = selfcheck(run_node, "scenarios", None, fake_broker.url, timeout=60)
    assert "failure" not in out, out["failure"]
    assert out["hello"]["actor"] == "group-coordinator" and out["hello"]["version"] == 1
    # Version negotiation: the v2 header is refused with the supported list, id echoed.
    assert out["v2"]["error"]["code"] == "UNSUPPORTED_VERSION"
    assert out["v2"]["error"]["data"] == {"supported": [1]} and out["v2"]["error"]["local"] is False
    # Out-of-order replies on one DEALER are matched by id.
    assert fake_broker.seen.get("parked") == 1
    assert out["outOfOrder"]["order"] == ["produce", "fetch"]
    assert [bytes.fromhex(r["value"]) for r in out["outOfOrder"]["fetched"]] == [b"v0"]
    # The deliberately malformed request came back as BAD_REQUEST with the field named.
    assert out["badRequest"]["error"]["code"] == "BAD_REQUEST"
    assert out["badRequest"]["error"]["data"]["field"] == "offset"
    # Nothing else the Node client sent was refused by protocol.codec.
    assert fake_broker.rejected == ["UNSUPPORTED_VERSION: protocol version 2 is not supported",
                                    "BAD_REQUEST: field 'offset' of 'fetch' has the wrong type"]


def test_node_idempotent_retry_against_fake_broker(run_node, fake_broker):
    # The scenario's second produce ("v1") loses its reply once: the client must time out,
    # resend the same sequence, and get duplicate: true with the original offsets.
    original = fake_broker.p_produce
    calls = {"n": 0}

    def produce(identity, env):
        calls["n"] += 1
        if calls["n"] == 2:
            fake_broker.faults["drop_produce_reply"] = True
        return original(identity, env)

    fake_broker.p_produce = produce
    out = selfcheck(run_node, "scenarios", None, fake_broker.url, timeout=60)
    assert "failure" not in out, out["failure"]
    retry = out["retry"]
    assert fake_broker.seen.get("dropped_reply") == 1 and fake_broker.seen.get("duplicate") == 1
    assert retry["retried"]["duplicate"] is True and retry["retried"]["baseOffset"] == 1
    assert retry["after"] == {"topic": "sc", "partition": 0, "baseOffset": 2, "count": 1, "duplicate": False}
    assert (retry["seqBefore"], retry["seqAfter"], retry["sameProducer"]) == (1, 3, True)
    assert 0 < int(retry["producerId"]) < 2**63
    # Exactly one copy of each record in the log.
    assert [bytes.fromhex(r["value"]) for r in out["log"]] == [b"v0", b"v1", b"v2"]
    assert [r["offset"] for r in out["log"]] == [0, 1, 2]


def test_e2e_script_against_fake_broker_with_faults(run_node, fake_broker):
    fake_broker.faults.update(fence_first_poll=True, expire_first_lease=True)
    proc = run_node("e2e.js", fake_broker.url, "e2e-fake", timeout=120)
    assert proc.returncode == 0, f"e2e.js failed:\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["produced"] == summary["fetched"] == summary["consumed"] == 500
    assert sum(summary["committed"].values()) == 500 and set(summary["committed"]) == {"0", "1"}
    assert fake_broker.rejected == []
    # The fault paths were taken: re-join after FENCED, STALE_LEASE on the expired lease.
    assert fake_broker.seen.get("FENCED") == 1 and fake_broker.seen.get("STALE_LEASE") == 1
    assert fake_broker.seen["join"] == 2


def test_node_consumer_retries_retriable_coordinator_errors(run_node, fake_broker):
    """UNAVAILABLE / SHUTTING_DOWN / TIMEOUT on join, poll and ack are retried with backoff
    (PROTOCOL.md s.7, 8.4); a heartbeat only reports it."""
    fake_broker.fail_once.update(join="UNAVAILABLE", poll="SHUTTING_DOWN", ack="UNAVAILABLE", heartbeat="UNAVAILABLE")
    fake_broker.faults["drop_acking_poll_reply"] = True
    out = selfcheck(run_node, "group-retry", None, fake_broker.url, timeout=60)
    assert "failure" not in out, out["failure"]
    assert fake_broker.fail_once == {}, "an injected error was never met"
    assert fake_broker.seen["UNAVAILABLE"] == 3 and fake_broker.seen["SHUTTING_DOWN"] == 1
    assert fake_broker.seen["join"] == 2  # the refused join, then one member: no rebalance
    assert out["firstPoll"] == [["a", "b", "c"]] and (out["ack"]["applied"], out["ack"]["stale"]) == (3, [])
    assert out["heartbeat"]["error"]["code"] == "UNAVAILABLE" and fake_broker.seen["heartbeat"] == 1
    # The poll whose reply was lost timed out and went again with the same acks.
    assert out["secondPoll"] == [["d", "e"]]
    assert fake_broker.seen["dropped_poll_reply"] == 1 and fake_broker.ranges_per_request["poll"] == [1, 1]
    assert out["pollAcks"] == {"applied": 2, "stale": [], "staleOmitted": 0}
    assert fake_broker.rejected == []


def test_node_consumer_splits_ranges_and_refuses_oversized_headers(run_node, fake_broker):
    """At most RANGES_PER_REQUEST ranges per request (the Python client's limit), results
    summed; a header over 1 MiB is refused locally, as the actor's reply to it has no id."""
    from zbroker.client.core import RANGES_PER_REQUEST as MOST
    out = selfcheck(run_node, "range-limits", None, fake_broker.url, timeout=120)
    assert "failure" not in out, out["failure"]
    # 9001 ranges as ack(), then 9002 on a poll: MOST ride on it, the rest go ahead as acks.
    assert fake_broker.ranges_per_request == {"ack": [MOST, MOST, 9001 - 2 * MOST, MOST, 9002 - 2 * MOST],
                                              "poll": [MOST]}
    assert out["ack"] == {"applied": 9000, "stale": [["rl", 0, 1, 0, 1]], "staleOmitted": 0}
    assert out["pollAcks"]["applied"] == 9000
    assert sorted(out["pollAcks"]["stale"]) == [["rl", 0, 1, 1, 2], ["rl", 0, 1, 2, 3]]
    err = out["oversized"]["error"]
    assert (err["code"], err["local"], err["retriable"]) == ("TOO_LARGE", True, False), err
    assert err["data"]["limit"] == codec.MAX_HEADER_BYTES < err["data"]["got"]
    assert fake_broker.rejected == []  # nothing over the limit was sent


def test_node_produce_keyed_sends_keyless_records_round_robin(run_node, fake_broker):
    """Key-less records may go anywhere (PROTOCOL.md s.12): produceKeyed sends them as
    produce() does, to the next partition of the rotation."""
    out = selfcheck(run_node, "keyless", None, fake_broker.url, timeout=60)
    assert "failure" not in out, out["failure"]
    expected: list[list] = [[], [], []]
    for key, value in [("user-1", "a"), (None, "b"), (None, "c"), (None, "d"), ("user-2", "e")]:
        expected[0 if key is None else partition_for_key(key.encode(), 3)].append([key, value])
    expected[1].append([None, "f"])  # the next produceKeyed: the next partition
    expected[2].append([None, "g"])  # produce() continues the same rotation
    assert out["logs"] == expected
    assert sorted(r["partition"] for r in out["first"]) == sorted(
        {0, partition_for_key(b"user-1", 3), partition_for_key(b"user-2", 3)})  # one batch per partition
