"""Fuzz frames: valid templates, and structured, byte-level and multi-frame mutations of them.

Theory of operation
-------------------
Every fuzz message starts from a *template*: a valid request header (a dict,
built from the typed messages in `protocol.messages`, so it is exactly what
`protocol.codec.encode_request` packs) plus its payload frames. A template
names real things where that reaches deeper code: an existing topic, a member
that really joined, lease ids it really holds. `FrameMutator.next()` then
picks one recipe:

* valid: the template as it is (the actor's real handlers run under load);
* structured: one to three header edits, such as a field's type swapped, a
  field deleted, an out-of-range or boundary integer, a huge string, nested
  junk, an unknown or borrowed op, a wrong ``v`` or ``id``, forged lease ids
  and generations inside ack/nack/extend/reject ranges, an ``ok`` key that
  makes a request look like a reply;
* bytes: the packed header truncated, bit-flipped, spliced with another one,
  or given msgpack bin/str/array/map headers that declare 2^32 - 1 bytes or
  items, or ext types;
* frames: 1 to 7 frames (header plus up to six payloads), payloads empty,
  random, valid batches, corrupt batches or big, up to just over the
  partition actor's ``max_batch_bytes``.

`random.Random` drives the live fuzzers (they need 100,000 frames per actor
in seconds, far faster than Hypothesis draws); the Hypothesis strategies at
the end cover the same mutation space for the in-process decoder fuzz and
seed the live runs with a Hypothesis-built corpus.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable, Iterable

import msgpack
from hypothesis import strategies as st

from zbroker.actors.group_coordinator.topics import validate_topic_name
from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.batch import encode_records
from zbroker.protocol.errors import ProtocolError

U64 = 1 << 64
BOUNDARY_INTS = [0, 1, -1, 127, 128, 255, 256, 65535, 65536, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32,
                 (1 << 53) + 1, (1 << 63) - 1, 1 << 63, U64 - 1, -(1 << 31), -(1 << 63)]
# msgpack headers that declare far more bytes or items than follow.
HUGE_DECLARATIONS = [
    b"\xc6\xff\xff\xff\xff",  # bin 32
    b"\xdb\xff\xff\xff\xff",  # str 32
    b"\xdd\xff\xff\xff\xff",  # array 32
    b"\xdf\xff\xff\xff\xff",  # map 32
    b"\xc5\xff\xff",          # bin 16
    b"\xda\xff\xff",          # str 16
    b"\xdc\xff\xff",          # array 16
    b"\xde\xff\xff",          # map 16
    b"\xc9\xff\xff\xff\xff\x01",  # ext 32
]
EXT_VALUES = [b"\xd4\x01\x00", b"\xc7\x03\x05abc", b"\xd8\x7f" + b"\x00" * 16, b"\xc1"]
NESTING = 3
MAX_RANGES = 20_000
MAX_JUNK_STRING = 4096

_pack = msgpack.Packer(use_bin_type=True).pack


def pack(value: Any) -> bytes:
    return _pack(value)


def _bounded(value: int, fallback: int) -> int:
    """msgpack packs integers in [-2^63, 2^64) only."""
    return value if -(1 << 63) <= value < U64 else fallback


@dataclasses.dataclass(frozen=True, slots=True)
class Template:
    header: dict
    payloads: tuple = ()


def template(msg: m.Message, corr_id: int | None = 1, payloads: Iterable[bytes] = ()) -> Template:
    """The header `codec.encode_request` would send for `msg`, as a dict."""
    header = msgpack.unpackb(codec.encode_request(msg, corr_id)[0], raw=False)
    return Template(header, tuple(payloads))


def small_batch(n: int = 2, value: bytes = b"fuzz") -> bytes:
    return encode_records([[1_767_225_600_000, None, value, None] for _ in range(n)])


# -- templates per actor ---------------------------------------------------------------------

@dataclasses.dataclass
class CoordinatorContext:
    """Real names the coordinator knows, so mutations reach its group logic."""
    topic: str
    group: str
    member_id: str = "m-unknown"
    generation: int = 0
    leases: list = dataclasses.field(default_factory=list)  # [[topic, partition, lease_id, start, end]]


def coordinator_templates(ctx: CoordinatorContext) -> list[Template]:
    """Client ops, plus internal ops as a client (or a forged identity) could send them.

    Deliberately absent, with the reason:
    * ``create_topic`` with a new valid name: creating a topic is real state (files on
      a partition actor for each partition), not input to survive; the template names
      an existing topic (TOPIC_EXISTS) and mutations make the name invalid or keep it.
    * ``register``/``report`` for the broker's real actor or storage: without
      ``--curve`` they are trusted by design and would move partitions.
    """
    group, member, gen, topic = ctx.group, ctx.member_id, ctx.generation, ctx.topic
    leases = ctx.leases or [[topic, 0, (1 << 60) + 7, 0, 1]]
    ranges = [list(lease) for lease in leases[:4]]
    return [
        template(m.Hello(versions=[1], client="fuzz")),
        template(m.Status()),
        template(m.Metadata(topics=[topic])),
        template(m.Metadata(topics=None)),
        template(m.ListTopics()),
        template(m.DescribeTopic(topic=topic)),
        template(m.CreateTopic(topic=topic, partitions=1)),
        template(m.Join(group=group, topics=[topic], member_id=member, session_timeout_ms=60_000)),
        template(m.Heartbeat(group=group, member_id=member, generation=gen)),
        template(m.Poll(group=group, member_id=member, generation=gen, max_records=10)),
        template(m.Poll(group=group, member_id=member, generation=gen, max_records=5, max_wait_ms=20)),
        template(m.Ack(group=group, member_id=member, generation=gen, ranges=ranges)),
        template(m.Nack(group=group, member_id=member, generation=gen, ranges=ranges, delay_ms=5, reason="fz")),
        template(m.Extend(group=group, member_id=member, generation=gen, ranges=ranges, extend_ms=1000)),
        template(m.Reject(group=group, member_id=member, generation=gen, ranges=ranges, reason="fz")),
        template(m.ListGroups()),
        template(m.DescribeGroup(group=group)),
        template(m.ConfigureGroup(group=group, max_in_flight=50, ack_timeout_ms=2000)),
        template(m.ResetGroup(group=group, topic=topic, to="latest")),
        template(m.Leave(group=group, member_id="m-not-a-member", generation=gen)),
        template(m.Register(actor_id="fz-actor", endpoint="tcp://127.0.0.1:9", storage_id="fz-storage", pid=1,
                            partitions=[[topic, 0, 0, 1, 10]])),
        template(m.Report(actor_id="fz-actor", partitions=[[topic, 0, 0, 1, 10]])),
        template(m.WriterStatus(pid=1, healthy=True, metrics={"fz": 1})),
    ]


def coordinator_guard(existing_topic: str) -> Callable[[dict], dict]:
    """Keep mutated create_topic requests from creating topics.

    A mutated name is often valid (an op name, or "fz" with a flipped bit) and its
    partition count may be a boundary value such as 256: every such topic would open
    that many logs on the partition actor, and be placed on whatever fake actor a
    forged ``register`` announced. That measures topic creation, not frame handling.
    So a valid name becomes the existing topic with 0 partitions (BAD_REQUEST even if
    a later byte flip changes the name); TOPIC_EXISTS is reached by the unmutated template.
    Likewise a mutated op that became ``delete_topic`` names a topic that never existed
    (UNKNOWN_TOPIC): deleting the run's own topics would measure nothing but its end.
    """
    def guard(header: dict) -> dict:
        if header.get("op") == "delete_topic" and isinstance(header.get("topic"), str):
            header["topic"] = f"{existing_topic}-never-created"
        if header.get("op") == "create_topic" and isinstance(header.get("topic"), str):
            try:
                validate_topic_name(header["topic"])
            except ProtocolError:
                return header
            header["topic"], header["partitions"] = existing_topic, 0
        return header
    return guard


def coordinator_reply_templates(forged_ids: Callable[[], int]) -> list[Template]:
    """Replies as a forged ``partition:``/``writer`` peer would send them (``ok`` set)."""
    out = []
    for op, fields in [("advance", {"durable": [["g", "t", 0, 1, 0]]}), ("load_offsets", {"rows": []}),
                       ("assign", {"partitions": []}), ("fetch", {"log_start": 0, "log_end": 0}),
                       ("produce", {"base_offset": 0, "count": 1, "duplicate": False})]:
        header = {"v": 1, "op": op, "id": forged_ids(), "ok": True, **fields}
        out.append(Template(header, (b"",) if op == "fetch" else ()))
    out.append(Template({"v": 1, "op": "advance", "id": forged_ids(), "ok": False,
                         "error": {"code": "UNAVAILABLE", "message": "fz", "retriable": True, "data": {}}}))
    return out


def partition_templates(topic: str, log_end: int) -> list[Template]:
    """Data-plane ops. ``assign`` is absent: see tests/fuzz/test_known_bugs.py."""
    return [
        template(m.Hello(versions=[1, 2], client="fuzz")),
        template(m.Status()),
        template(m.Produce(topic=topic, partition=0), payloads=[small_batch()]),
        template(m.Produce(topic=topic, partition=0, producer_id=(1 << 62) + 5, sequence=3),
                 payloads=[small_batch(1)]),
        template(m.Fetch(topic=topic, partition=0, offset=0, max_bytes=4096)),
        template(m.Fetch(topic=topic, partition=0, offset=log_end, max_wait_ms=10)),
        template(m.Fetch(topic=topic, partition=0, offset=max(0, log_end - 1), max_bytes=1)),
    ]


def writer_templates() -> list[Template]:
    """What the coordinator sends the commit writer. Keys come from a small pool."""
    advances = [["fz-group", "fz-topic", p, 10 + p, [[12 + p, 14 + p]], 3, 0] for p in range(3)]
    return [
        template(m.Advance(advances=advances)),
        template(m.Advance(advances=advances[:1])),
        template(m.Advance(advances=[])),
        template(m.LoadOffsets()),
        template(m.Status()),
        Template({"v": 1, "op": "writer_status", "id": None, "ok": True, "durable": []}),
    ]


# -- the mutator -------------------------------------------------------------------------------

class FrameMutator:
    """Seeded generator of fuzz messages (lists of frames) from templates."""

    def __init__(self, rng: random.Random, templates: list[Template], *, ops: Iterable[str] = (),
                 big_payload_bytes: int = 0, big_every: int = 0, huge_header_every: int = 0,
                 keep_ids: Callable[[], int] | None = None, guard: Callable[[dict], dict] | None = None,
                 corpus: list[list[bytes]] | None = None) -> None:
        self.rng = rng
        self.templates = templates
        self.ops = sorted(set(ops) or (set(m.REQUESTS) | {"fz_op", ""}))
        self.big_every = big_every
        self.huge_header_every = huge_header_every
        self.keep_ids = keep_ids  # forged reply ids must stay out of reach of real requests
        self.guard = guard  # rewrites the few headers that would create real state (see coordinator_guard)
        self.corpus = corpus or []
        self.count = 0
        self._big = bytes(big_payload_bytes) if big_payload_bytes else b""
        self._huge_header = pack({"v": 1, "op": "status", "id": 1, "pad": "x" * (codec.MAX_HEADER_BYTES + 1)})
        self._long_strings = ["é" * 5000, "x" * 65_536, "\u0000" * 300, "\U0001f600" * 1000]

    # Weights of the recipes: valid, structured, bytes, frames, corpus.
    RECIPES = (0.10, 0.45, 0.25, 0.10, 0.10)

    def next(self) -> list[bytes]:
        self.count += 1
        rng = self.rng
        if self.big_every and self.count % self.big_every == 0:
            return self._big_message()
        if self.huge_header_every and self.count % self.huge_header_every == 0:
            return [self._huge_header]
        tpl = rng.choice(self.templates)
        r = rng.random()
        valid, structured, byte_level, frames, _corpus = self.RECIPES
        if r < valid:
            return [pack(dict(tpl.header)), *tpl.payloads]
        r -= valid
        if r < structured:
            return [pack(self._fix_id(self.mutate_header(tpl.header))), *self._maybe_payloads(tpl)]
        r -= structured
        if r < byte_level:
            header = dict(tpl.header) if rng.random() < 0.5 else self.mutate_header(tpl.header)
            return [self.mutate_bytes(pack(self._fix_id(header))), *self._maybe_payloads(tpl)]
        r -= byte_level
        if r < frames or not self.corpus:
            return self._multi_frame(tpl)
        return list(rng.choice(self.corpus))

    # -- structured ------------------------------------------------------------------------

    def mutate_header(self, header: dict) -> dict:
        rng = self.rng
        out = dict(header)
        for _ in range(rng.randint(1, 3)):
            keys = list(out)
            kind = rng.randrange(11)
            if kind == 0 and keys:  # swap a field's type
                out[rng.choice(keys)] = self.junk()
            elif kind == 1 and keys:  # delete a field (v, op and id included)
                del out[rng.choice(keys)]
            elif kind == 2 and keys:  # boundary integer
                out[rng.choice(keys)] = rng.choice(BOUNDARY_INTS)
            elif kind == 3 and keys:  # huge string
                out[rng.choice(keys)] = rng.choice(self._long_strings)
            elif kind == 4:  # unknown or borrowed op
                out["op"] = rng.choice(self.ops) if rng.random() < 0.7 else self.junk_string()
            elif kind == 5:  # wrong version
                out["v"] = rng.choice([0, 2, -1, 255, "1", None, True, 1.0, [1], U64 - 1])
            elif kind == 6:  # wrong correlation id
                out["id"] = rng.choice([-1, U64 - 1, "7", 1.5, True, None, [1], {"a": 1}])
            elif kind == 7 and "ranges" in out:  # forged lease ids, bad ranges
                out["ranges"] = self.mutate_ranges(out["ranges"])
            elif kind == 8 and "generation" in out:  # wrong generation
                gen = out["generation"]
                out["generation"] = (_bounded(gen + rng.choice([-2, -1, 1, 2, 1000]), gen)
                                     if isinstance(gen, int) else rng.choice(BOUNDARY_INTS))
            elif kind == 9:  # extra keys, "ok" among them: a request that looks like a reply
                out[rng.choice(["ok", "error", "zz", "frames", ""])] = self.junk()
            else:  # nested junk in place of a list/map field, or a brand-new key
                key = rng.choice(keys) if keys and rng.random() < 0.7 else self.junk_string()
                out[key] = self.nested_junk(rng.randint(1, 40))
        return out

    def mutate_ranges(self, ranges: Any) -> Any:
        rng = self.rng
        if not isinstance(ranges, list) or not ranges:
            return [[self.junk_string(), 0, rng.getrandbits(64), 0, 1]]
        choice = rng.randrange(8)
        ranges = [list(r) if isinstance(r, list) else r for r in ranges]
        item = rng.choice(ranges)
        if not isinstance(item, list) or len(item) != 5:
            return ranges
        if choice == 0:
            item[2] = rng.getrandbits(64)  # forged lease id
        elif choice == 1 and isinstance(item[2], int):
            item[2] = _bounded(item[2] + rng.choice([-1, 1]), item[2])  # a neighbour's lease id
        elif choice == 2:
            item[3], item[4] = item[4], item[3]  # start >= end
        elif choice == 3:
            item[rng.randrange(5)] = rng.choice(BOUNDARY_INTS)
        elif choice == 4:
            item[rng.randrange(5)] = self.junk()
        elif choice == 5:
            item.append(self.junk()) if rng.random() < 0.5 else item.pop()
        elif choice == 6 and isinstance(item[3], int):
            item[4] = _bounded(item[3] + rng.randint(1, 1 << 40), item[4])  # beyond the lease
        elif choice == 7:  # many ranges (the limit is 10,000: past it, BAD_REQUEST)
            ranges = ranges * max(1, min(rng.randint(2, 5000), MAX_RANGES // len(ranges)))
        return ranges

    # -- bytes -----------------------------------------------------------------------------

    def mutate_bytes(self, data: bytes) -> bytes:
        rng = self.rng
        buf = bytearray(data)
        kind = rng.randrange(6)
        if kind == 0 and buf:  # truncate
            return bytes(buf[:rng.randrange(len(buf))])
        if kind == 1 and buf:  # flip bits and bytes
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(len(buf))
                buf[i] = buf[i] ^ (1 << rng.randrange(8)) if rng.random() < 0.5 else rng.randrange(256)
            return bytes(buf)
        if kind == 2:  # splice with another template
            other = pack(rng.choice(self.templates).header)
            return bytes(buf[:rng.randrange(len(buf) + 1)]) + other[rng.randrange(len(other) + 1):]
        if kind == 3:  # a header declaring 2^32 - 1 bytes or items
            at = 0 if rng.random() < 0.3 else rng.randrange(len(buf) + 1)
            return bytes(buf[:at]) + rng.choice(HUGE_DECLARATIONS) + bytes(buf[at:])
        if kind == 4:  # ext types, or the reserved byte 0xc1
            at = rng.randrange(len(buf) + 1)
            return bytes(buf[:at]) + rng.choice(EXT_VALUES) + bytes(buf[at:])
        return rng.randbytes(rng.randrange(64))

    # -- frames ----------------------------------------------------------------------------

    def _maybe_payloads(self, tpl: Template) -> list[bytes]:
        if not tpl.payloads or self.rng.random() < 0.8:
            return list(tpl.payloads)
        return [self.payload()]

    def _multi_frame(self, tpl: Template) -> list[bytes]:
        rng = self.rng
        if rng.random() < 0.1:
            return [b""]
        header = pack(self._fix_id(dict(tpl.header)))
        if rng.random() < 0.3:
            header = self.mutate_bytes(header)
        return [header, *[self.payload() for _ in range(rng.randint(0, 6))]]

    def payload(self) -> bytes:
        rng = self.rng
        kind = rng.randrange(6)
        if kind == 0:
            return b""
        if kind == 1:
            return rng.randbytes(rng.randrange(256))
        if kind == 2:
            return small_batch(rng.randint(1, 5))
        if kind == 3:
            return self.mutate_bytes(small_batch(rng.randint(1, 3)))
        if kind == 4:
            return rng.choice([b"\xdd\xff\xff\xff\xff", b"\xdc\x00\x00", b"\x90", b"\x9f" + b"\x00" * 3])
        return pack(self.nested_junk(rng.randint(1, 20)))

    def _big_message(self) -> list[bytes]:
        """A produce whose payload is around max_batch_bytes (one byte over, or well under)."""
        tpl = next((t for t in self.templates if t.header.get("op") == "produce"), self.templates[0])
        size = len(self._big) if self.rng.random() < 0.7 else len(self._big) // 2
        payload = b"\x91" + self._big[1:size]  # declares one record: passes the cheap count check
        return [pack(tpl.header), payload]

    def _fix_id(self, header: dict) -> dict:
        if self.keep_ids is not None and "ok" in header:
            header["id"] = self.keep_ids()
        return self.guard(header) if self.guard is not None else header

    # -- values ----------------------------------------------------------------------------

    def junk(self) -> Any:
        rng = self.rng
        kind = rng.randrange(10)
        if kind == 0:
            return None
        if kind == 1:
            return rng.random() < 0.5
        if kind == 2:
            return rng.choice(BOUNDARY_INTS)
        if kind == 3:
            return rng.choice([0.0, -1.5, 1e308, float("nan"), float("inf")])
        if kind == 4:
            return self.junk_string()
        if kind == 5:
            return rng.randbytes(rng.randrange(32))
        if kind == 6:
            return [self.junk_scalar() for _ in range(rng.randrange(6))]
        if kind == 7:
            return {self.junk_string(): self.junk_scalar() for _ in range(rng.randrange(4))}
        if kind == 8:
            return {rng.randrange(10): 1}  # a non-str map key
        return self.nested_junk(rng.randint(1, NESTING))

    def junk_scalar(self) -> Any:
        return self.rng.choice([None, True, 0, -1, U64 - 1, 1.5, "", "t", b"\x00", "x" * 40])

    def junk_string(self) -> str:
        rng = self.rng
        kind = rng.randrange(5)
        if kind == 0:
            return ""
        if kind == 1:
            return "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(1, 24)))
        if kind == 2:
            return "../" * rng.randint(1, 8) + "fz"
        if kind == 3:
            return "x" * rng.randrange(MAX_JUNK_STRING)
        return rng.choice(self.ops)

    def nested_junk(self, depth: int) -> Any:
        value: Any = self.junk_scalar()
        for _ in range(depth):
            value = [value] if self.rng.random() < 0.6 else {"k": value}
        return value


# -- Hypothesis strategies: the same space, for the in-process fuzz and the live corpus -------

scalar = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 63), max_value=U64 - 1),
                   st.sampled_from(BOUNDARY_INTS), st.floats(allow_nan=True), st.text(max_size=40),
                   st.binary(max_size=40))
json_like = st.recursive(scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)), max_leaves=20)


@st.composite
def mutated_headers(draw: st.DrawFn, templates: list[Template]) -> dict:
    """A template header with 1-3 typed edits: Hypothesis' view of `FrameMutator.mutate_header`."""
    header = dict(draw(st.sampled_from(templates)).header)
    for _ in range(draw(st.integers(1, 3))):
        keys = sorted(header)
        edit = draw(st.sampled_from(["swap", "delete", "boundary", "op", "v", "id", "ranges", "generation",
                                     "extra"]))
        if edit in ("swap", "delete", "boundary") and not keys:
            continue
        if edit == "swap":
            header[draw(st.sampled_from(keys))] = draw(json_like)
        elif edit == "delete":
            del header[draw(st.sampled_from(keys))]
        elif edit == "boundary":
            header[draw(st.sampled_from(keys))] = draw(st.sampled_from(BOUNDARY_INTS))
        elif edit == "op":
            header["op"] = draw(st.one_of(st.sampled_from(sorted(m.REQUESTS) + sorted(m.REPLIES)),
                                          st.text(max_size=80), json_like))
        elif edit == "v":
            header["v"] = draw(st.one_of(st.integers(-3, 5), json_like))
        elif edit == "id":
            header["id"] = draw(st.one_of(st.integers(-(1 << 63), U64 - 1), json_like))
        elif edit == "ranges" and isinstance(header.get("ranges"), list):
            header["ranges"] = draw(st.lists(st.one_of(
                st.tuples(st.text(max_size=8), st.integers(-2, 3), st.integers(0, U64 - 1),
                          st.integers(-2, 1 << 40), st.integers(-2, 1 << 40)).map(list),
                json_like), max_size=8))
        elif edit == "generation" and "generation" in header:
            header["generation"] = draw(st.one_of(st.integers(-(1 << 63), (1 << 63) - 1), json_like))
        else:
            header[draw(st.one_of(st.sampled_from(["ok", "error", "zz"]), st.text(max_size=8)))] = draw(json_like)
    return header


@st.composite
def byte_mutated(draw: st.DrawFn, data: bytes) -> bytes:
    """Truncation, splices, flips and huge declarations at Hypothesis-chosen points."""
    at = draw(st.integers(0, len(data)))
    edit = draw(st.sampled_from(["truncate", "insert", "flip", "huge", "raw"]))
    if edit == "truncate":
        return data[:at]
    if edit == "insert":
        return data[:at] + draw(st.binary(max_size=16)) + data[at:]
    if edit == "flip" and data:
        i = min(at, len(data) - 1)
        return data[:i] + bytes([draw(st.integers(0, 255))]) + data[i + 1:]
    if edit == "huge":
        return data[:at] + draw(st.sampled_from(HUGE_DECLARATIONS + EXT_VALUES)) + data[at:]
    return draw(st.binary(max_size=200))


@st.composite
def fuzz_messages(draw: st.DrawFn, templates: list[Template]) -> list[bytes]:
    """A whole message: a mutated header, maybe byte-mutated, with 0-6 payload frames."""
    header = pack(draw(mutated_headers(templates)))
    if draw(st.booleans()):
        header = draw(byte_mutated(header))
    payloads = draw(st.lists(st.one_of(st.binary(max_size=64), st.just(small_batch()),
                                       st.sampled_from([b"\xdd\xff\xff\xff\xff", b"\x90", b""])), max_size=6))
    return [header, *payloads]
