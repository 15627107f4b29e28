"""Typed messages of wire protocol v1.

Each request and reply is a small dataclass registered under its ``op`` name.
`protocol.codec` turns frames into these objects and back; nothing else in
the code base packs or unpacks frames. Field types are checked on decode, so
an actor never sees a ``partition`` that is a string or a negative offset
where a count is expected: that becomes a BAD_REQUEST reply instead.

Range lists (acks, deliveries, advances) travel as msgpack arrays rather than
maps because a single frame may carry thousands of them; their element order
is given in each class's docstring and in docs/PROTOCOL.md.
"""

import dataclasses
import re
import types
from typing import Any, ClassVar, get_type_hints

from zbroker.protocol.errors import ProtocolError, UnsupportedVersion

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)

# Topic names become directory names on the partition actors' disks.
MAX_TOPIC_NAME_CHARS = 200
TOPIC_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,%d}$" % (MAX_TOPIC_NAME_CHARS - 1))


def validate_topic_name(name: str, field: str = "topic") -> None:
    if not isinstance(name, str) or not TOPIC_NAME.match(name) or ".." in name:
        raise ProtocolError("topic names are 1-200 characters of A-Z a-z 0-9 . _ - and may not start "
                            "with '.' or '-' or contain '..'", topic=str(name)[:200], field=field)


# Group names are stored with the committed offsets (the commit writer refuses longer
# ones, and one refused row would hold back every group's commits): checked at the door.
MAX_GROUP_NAME_CHARS = 255


def validate_group_name(name: str, op: str) -> None:
    if not name or len(name) > MAX_GROUP_NAME_CHARS or "\x00" in name:
        raise ProtocolError(f"'group' must be 1-{MAX_GROUP_NAME_CHARS} characters without NUL", op=op,
                            field="group", got=name[:MAX_GROUP_NAME_CHARS])


# A member id a client chooses is kept for its session and shown by describe_group
# and in the log: as bounded as a group name. A 1,000,000-character id made the
# whole group's description TOO_LARGE for everyone.
MAX_MEMBER_ID_CHARS = 255


def validate_member_id(member_id: str, op: str) -> None:
    """An empty id asks the coordinator to make one (join)."""
    if len(member_id) > MAX_MEMBER_ID_CHARS or "\x00" in member_id:
        raise ProtocolError(f"'member_id' must be at most {MAX_MEMBER_ID_CHARS} characters without NUL", op=op,
                            field="member_id", got=member_id[:MAX_MEMBER_ID_CHARS], limit=MAX_MEMBER_ID_CHARS)


# Long polls wait at most this long; a client wanting more simply polls again.
MAX_WAIT_MS = 60_000

# Replies one fetch may get after its first (`follow`); a client reserves that many ids.
MAX_FETCH_FOLLOW = 1024

# The longest a lease may run (ack_timeout_ms, extend_ms) or a nacked record wait
# (delay_ms), as SQS caps its visibility timeout: a typo of a few digits must not
# park a record, and the committed offset behind it, for years.
MAX_LEASE_MS = 12 * 60 * 60 * 1000

# A registration names at most this many of the partitions its actor could not
# open (with the count of all of them): a topic of thousands deferred for lack of
# descriptors must not make every once-a-second registration that large.
MAX_NOT_OPEN_LISTED = 100

GROUP_MODES = ("exclusive", "shared", "key_shared")

REQUESTS: dict[str, type["Message"]] = {}
REPLIES: dict[str, type["Message"]] = {}
# Ops for which the sender expects no reply (fire and forget, "tell").
TELLS: set[str] = set()

_MISSING = dataclasses.MISSING


class Message:
    """Base of every typed message. Subclasses are slotted dataclasses."""

    op: ClassVar[str]
    _fields: ClassVar[tuple[tuple[str, Any, bool, Any], ...]]
    _checks: ClassVar[tuple]

    def check(self) -> None:
        """Structural checks beyond field types; raise ProtocolError."""

    def to_fields(self) -> dict[str, Any]:
        field_dict = _FIELD_DICTS.get(self.__class__)
        if field_dict is None:
            field_dict = _FIELD_DICTS[self.__class__] = _compile_to_fields(self.__class__)
        return field_dict(self)


def _compile_fields(cls: type) -> tuple[tuple[str, Any, bool, Any], ...]:
    hints = get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        required = f.default is _MISSING and f.default_factory is _MISSING
        if f.default is not _MISSING:
            default = f.default
        elif f.default_factory is not _MISSING:
            default = f.default_factory
        else:
            default = None
        out.append((f.name, hints[f.name], required, default))
    return tuple(out)


def _accepted(expected: Any) -> tuple[tuple[type, ...] | None, bool]:
    """What `isinstance` must accept for a field declared `expected` (None: anything), and
    whether a bool is refused even so (bool is an int subclass; a flag is no count)."""
    if expected is Any:
        return None, False
    if isinstance(expected, types.UnionType):
        classes: list[type] = []
        for member in expected.__args__:
            accept, _ = _accepted(member)
            if accept is None:
                return None, False
            classes += accept
        numeric = int in classes or float in classes
        return tuple(classes), numeric and bool not in expected.__args__
    if expected is type(None):
        return (type(None),), False
    if expected is int:
        return (int,), True
    if expected is float:
        return (int, float), True
    origin = getattr(expected, "__origin__", None)  # list[int] is checked as a list
    return ((origin if origin is not None else expected),), False


def _compile_checks(fields: tuple[tuple[str, Any, bool, Any], ...]) -> tuple:
    """Per field: (name, classes accepted or None, bool refused, required, default, type).
    Decoding checks every field of every message; one isinstance per field is what
    that costs, instead of walking the annotation each time."""
    return tuple((name, *_accepted(ftype), required, default, ftype)
                 for name, ftype, required, default in fields)


_ABSENT = object()
# Per message class, made at its first use (made for every class at import, they cost
# a process 90 million instructions before it did anything).
_BUILDERS: dict[type, Any] = {}
_FIELD_DICTS: dict[type, Any] = {}


def _compile_builder(cls: type) -> Any:
    """`build`'s happy path for `cls`, as straight-line code: every field read once and
    type-checked in place, the message made with positional arguments. It answers None
    at the first field that is missing or of the wrong type, and `build` then goes the
    generic way, which raises the error it always raised. The generic loop cost 15,600
    instructions for a produce header (callgrind), about 40 % of decoding a
    one-record produce request; bench/PROFILE.md, twentieth pass."""
    names = {"cls": cls, "_ABSENT": _ABSENT, "_bool": bool}
    lines = ["def _build_valid(fields):"]
    args = []
    for i, (name, accept, refuse_bool, required, default, _ftype) in enumerate(cls._checks):
        names[f"A{i}"], names[f"D{i}"] = accept, default
        lines.append(f"    v{i} = fields.get({name!r}, _ABSENT)")
        lines.append(f"    if v{i} is _ABSENT:")
        if required:
            lines.append("        return None")
        else:
            lines.append(f"        v{i} = D{i}()" if callable(default) else f"        v{i} = D{i}")
        if accept is not None:
            bad = f"not isinstance(v{i}, A{i})" + (f" or v{i}.__class__ is _bool" if refuse_bool else "")
            lines.append(f"    elif {bad}:")
            lines.append("        return None")
        args.append(f"v{i}")
    lines.append(f"    msg = cls({', '.join(args)})")
    lines.append("    msg.check()")
    lines.append("    return msg")
    exec("\n".join(lines), names)  # noqa: S102 - source made above from field names only
    return names["_build_valid"]


def _compile_to_fields(cls: type) -> Any:
    """`Message.to_fields` for `cls` as one dict display: the generic comprehension over
    `_fields` cost 5,700 instructions for a produce reply (callgrind), and every reply
    an actor sends is made through it; bench/PROFILE.md, twentieth pass."""
    body = ", ".join(f"{name!r}: self.{name}" for name, _t, _r, _d in cls._fields)
    names: dict[str, Any] = {}
    exec(f"def to_fields(self):\n    return {{{body}}}", names)  # noqa: S102 - field names only
    return names["to_fields"]


def _register(table: dict[str, type], op: str, tell: bool = False):
    def wrap(cls):
        cls = dataclasses.dataclass(slots=True)(cls)
        cls.op = op
        cls._fields = _compile_fields(cls)
        cls._checks = _compile_checks(cls._fields)
        assert all(f.init for f in dataclasses.fields(cls)), "build passes every field to __init__, in order"
        table[op] = cls
        if tell:
            TELLS.add(op)
        return cls
    return wrap


def request(op: str, *, tell: bool = False):
    return _register(REQUESTS, op, tell)


def reply(op: str):
    return _register(REPLIES, op)


def build(cls: type[Message], fields: dict[str, Any]) -> Message:
    """Construct and type-check a message from a decoded field map."""
    if fields.__class__ is dict:
        build_valid = _BUILDERS.get(cls)
        if build_valid is None:
            build_valid = _BUILDERS[cls] = _compile_builder(cls)
        msg = build_valid(fields)
        if msg is not None:
            return msg
    kwargs = {}
    for name, accept, refuse_bool, required, default, ftype in cls._checks:
        if name in fields:
            value = fields[name]
            if accept is not None and (not isinstance(value, accept) or (refuse_bool and value.__class__ is bool)):
                raise ProtocolError(f"field {name!r} of {cls.op!r} has the wrong type",
                                    op=cls.op, field=name, expected=_type_name(ftype),
                                    got=family(value))
            kwargs[name] = value
        elif required:
            raise ProtocolError(f"{cls.op!r} is missing field {name!r}", op=cls.op, field=name)
        else:
            kwargs[name] = default() if callable(default) else default
    msg = cls(**kwargs)
    msg.check()
    return msg


# The words `data.expected` and `data.got` use (PROTOCOL.md s.7): msgpack family names,
# which a client in any language can read, never Python class names.
_FAMILY = {type(None): "nil", bool: "bool", int: "int", float: "float", str: "str", bytes: "bin",
           list: "array", dict: "map"}
FAMILIES = frozenset(_FAMILY.values()) | {"ext", "uint64"}


def family(value: Any) -> str:
    """The msgpack family a decoded value came as ("ext" for one kept as an ext type)."""
    return _FAMILY.get(type(value), "ext")


def _type_name(t: Any) -> str:
    """A field's declared type in the same words: "int", "str | nil", "array", ..."""
    if isinstance(t, types.UnionType):
        return " | ".join(_type_name(member) for member in t.__args__)
    return _FAMILY.get(getattr(t, "__origin__", None) or t, str(t))


# -- helpers for structured fields -------------------------------------------------------

def _nonneg(op: str, **values: int) -> None:
    for name, v in values.items():
        if v < 0:
            raise ProtocolError(f"field {name!r} of {op!r} must be >= 0", op=op, field=name, got=v)


def _at_most_a_lease(op: str, **values: int | None) -> None:
    for name, v in values.items():
        if v is not None and v > MAX_LEASE_MS:
            raise ProtocolError(f"field {name!r} of {op!r} must be at most {MAX_LEASE_MS} (12 hours)", op=op,
                                field=name, got=v, limit=MAX_LEASE_MS)


# Ranges per ack/nack/extend/reject (and poll.acks). The coordinator settles about one
# range per 2-3 us, and every other client's request waits behind it: 100,000 ranges
# under distinct leases held everyone else up by 240 ms; 10,000 is some 25 ms. The
# clients send at most 4,000 per request.
MAX_RANGES_PER_REQUEST = 10_000


def check_lease_ranges(op: str, ranges: list, limit: int = MAX_RANGES_PER_REQUEST, field: str = "ranges") -> None:
    """Each item is [topic:str, partition:int, lease_id:int, start:int, end:int], start < end."""
    if len(ranges) > limit:
        raise ProtocolError(f"{op!r} carries too many ranges", op=op, field=field, limit=limit, got=len(ranges))
    for i, item in enumerate(ranges):
        if not (isinstance(item, list) and len(item) == 5):
            raise ProtocolError("range must be [topic, partition, lease_id, start, end]", op=op, field=field, index=i)
        topic, partition, lease, start, end = item
        if not isinstance(topic, str) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in (partition, lease, start, end)
        ):
            raise ProtocolError("range has wrong element types", op=op, field=field, index=i)
        if partition < 0 or start < 0 or end <= start:
            raise ProtocolError("range must have partition >= 0 and 0 <= start < end", op=op, field=field, index=i)
        if not 0 <= lease < 1 << 64:  # a uint64 (PROTOCOL.md); no lease has any other id
            raise ProtocolError("range's lease_id must be a uint64", op=op, index=i, field=f"{field}.lease_id",
                                got=lease)
        if len(topic.encode()) > MAX_TOPIC_NAME_CHARS:
            # No topic has such a name; and a stale range is echoed back in the reply, whose
            # size the coordinator budgets with topics no longer than this.
            raise ProtocolError("range names no topic: longer than any topic name", op=op, field=field, index=i,
                                limit=MAX_TOPIC_NAME_CHARS)


# ======================================================================================
# Common
# ======================================================================================

@request("hello")
class Hello(Message):
    versions: list
    client: str = ""
    token: str = ""

    def check(self) -> None:
        if not self.versions or not all(isinstance(v, int) and not isinstance(v, bool) for v in self.versions):
            raise ProtocolError("'versions' must be a non-empty list of integers", op="hello", field="versions")
        if not set(self.versions) & set(SUPPORTED_VERSIONS):
            raise UnsupportedVersion("no protocol version in common", op="hello",
                                     supported=list(SUPPORTED_VERSIONS))


@reply("hello")
class HelloReply(Message):
    version: int
    server: str
    actor: str
    limits: dict
    internal_endpoint: str | None = None  # the coordinator's endpoint for the broker's own actors
    # What the answering actor supports beyond the base protocol ("replication", ...); older
    # actors send none, and a client treats a missing feature as absent.
    features: list = dataclasses.field(default_factory=list)


@request("status")
class Status(Message):
    pass


@reply("status")
class StatusReply(Message):
    """under_replicated: [{"topic", "partition", "leader", "leader_epoch", "replicas", "isr", "min_insync",
    "below_min_insync", "offline"}] for replicated partitions short of replicas in sync or of a leader."""
    actors: list
    healthy: bool = True
    under_replicated: list = dataclasses.field(default_factory=list)


# ======================================================================================
# Topics (coordinator)
# ======================================================================================

@request("metadata")
class Metadata(Message):
    topics: list | None = None

    def check(self) -> None:
        if self.topics is not None and not all(isinstance(t, str) for t in self.topics):
            raise ProtocolError("'topics' must be a list of names", op="metadata", field="topics")


@reply("metadata")
class MetadataReply(Message):
    """topics: [{"name", "partitions": [{"partition", "endpoint", "actor_id"}], "config"}]"""
    topics: list


@request("create_topic")
class CreateTopic(Message):
    """replication_factor R > 1 places R replicas on actors with distinct data directories;
    min_insync (default min(2, R)) is how many must hold a record before it is acknowledged."""
    topic: str
    partitions: int = 1
    config: dict | None = None
    replication_factor: int = 1
    min_insync: int | None = None

    def check(self) -> None:
        if not (1 <= self.partitions <= 10_000):
            raise ProtocolError("'partitions' must be between 1 and 10000", op="create_topic",
                                field="partitions", got=self.partitions)
        if self.replication_factor < 1 or (self.min_insync is not None
                                           and not 1 <= self.min_insync <= self.replication_factor):
            raise ProtocolError("'replication_factor' must be >= 1 and 'min_insync' between 1 and it",
                                op="create_topic", field="min_insync", got=self.min_insync,
                                replication_factor=self.replication_factor)


@reply("create_topic")
class CreateTopicReply(Message):
    topic: str
    partitions: int
    created: bool = True


@request("list_topics")
class ListTopics(Message):
    pass


@reply("list_topics")
class ListTopicsReply(Message):
    topics: list


@request("describe_topic")
class DescribeTopic(Message):
    topic: str


@reply("describe_topic")
class DescribeTopicReply(Message):
    """partitions: [{"partition", "log_start", "log_end", "bytes", "actor_id", "endpoint", "leader",
    "leader_epoch", "replicas", "isr", "high_watermark", "replica_log_ends", "min_insync"}]"""
    topic: str
    partitions: list
    config: dict


# ======================================================================================
# Partition data plane (partition-log actors)
# ======================================================================================

@request("produce")
class Produce(Message):
    """Frame 1 is the batch payload (see protocol.batch). coordinator_epoch: set by a
    coordinator appending a dead letter (its lease epoch); 0 from clients. A partition
    actor refuses one below the highest coordinator epoch it has obeyed (STALE_EPOCH)."""
    topic: str
    partition: int
    producer_id: int = 0
    sequence: int = -1
    coordinator_epoch: int = 0

    def to_fields(self) -> dict[str, Any]:
        # Absent unless set: a client's produce header stays the bytes it was before the
        # field existed (the Node.js client and PROTOCOL.md's worked example send none).
        fields = Message.to_fields(self)  # (slotted dataclass: no zero-argument super)
        if not self.coordinator_epoch:
            del fields["coordinator_epoch"]
        return fields

    def check(self) -> None:
        if self.partition < 0 or self.producer_id < 0:  # tested first: _nonneg's call is 4,000 instructions
            _nonneg("produce", partition=self.partition, producer_id=self.producer_id)
        if self.producer_id >= 1 << 63:
            raise ProtocolError("'producer_id' must be below 2**63", op="produce", field="producer_id")
        if self.producer_id and not 0 <= self.sequence < 1 << 31:
            raise ProtocolError("an idempotent producer's 'sequence' must be in [0, 2**31)", op="produce",
                                field="sequence", got=self.sequence)
        if not -1 <= self.sequence < 1 << 31:
            raise ProtocolError("'sequence' must be in [-1, 2**31)", op="produce", field="sequence")
        if self.partition >= 1 << 31:
            raise ProtocolError("'partition' out of range", op="produce", field="partition")


@reply("produce")
class ProduceReply(Message):
    base_offset: int
    count: int
    duplicate: bool = False


@request("fetch")
class Fetch(Message):
    topic: str
    partition: int
    offset: int
    max_bytes: int = 1 << 20
    max_wait_ms: int = 0
    follow: int = 0  # further replies, pushed as records are appended (PROTOCOL.md, `fetch`)

    def check(self) -> None:
        _nonneg("fetch", partition=self.partition, offset=self.offset, max_bytes=self.max_bytes,
                max_wait_ms=self.max_wait_ms, follow=self.follow)
        if self.max_wait_ms > MAX_WAIT_MS:
            raise ProtocolError(f"'max_wait_ms' must be at most {MAX_WAIT_MS}", op="fetch", field="max_wait_ms")
        if self.follow > MAX_FETCH_FOLLOW:
            raise ProtocolError(f"'follow' must be at most {MAX_FETCH_FOLLOW}", op="fetch", field="follow",
                                got=self.follow, limit=MAX_FETCH_FOLLOW)


# -- many partitions of one actor in one request (hello feature "multi_partition") ---------
# A topic of 1,024 partitions spread its records one or two per partition per produce and
# per fetch: one message, one reply and one wake-up per partition (issue #29). These carry
# the partitions one actor owns in one message each way, as Kafka's produce and fetch do
# per broker; the per-partition work inside stays what `produce` and `fetch` do.
# A part takes at most 258 bytes of header (a 200-byte topic, five uint64s): 2,048 of them
# stay within half the 1 MiB header limit, and so does a reply with an error per part.
MAX_PARTS_PER_REQUEST = 2048


def _check_parts(op: str, parts: list, width: int, shape: str) -> None:
    if not parts or len(parts) > MAX_PARTS_PER_REQUEST:
        raise ProtocolError(f"{op!r} carries 1 to {MAX_PARTS_PER_REQUEST} parts", op=op, field="parts",
                            limit=MAX_PARTS_PER_REQUEST, got=len(parts))
    for i, part in enumerate(parts):
        if not (type(part) is list and len(part) == width and type(part[0]) is str
                and all(type(x) is int for x in part[1:])):
            raise ProtocolError(f"parts items must be {shape}", op=op, field="parts", index=i)
        if not 0 <= part[1] < 1 << 31:
            raise ProtocolError("'partition' out of range", op=op, field="parts.partition", index=i, got=part[1])
        if len(part[0].encode()) > MAX_TOPIC_NAME_CHARS:
            raise ProtocolError("part names no topic: longer than any topic name", op=op, field="parts.topic",
                                index=i, limit=MAX_TOPIC_NAME_CHARS)


@request("produce_many")
class ProduceMany(Message):
    """parts: [[topic, partition, producer_id, sequence, length], ...]; frame 1 holds the
    parts' batch payloads back to back, `length` bytes each, in the order of `parts`."""
    parts: list

    def check(self) -> None:
        _check_parts(self.op, self.parts, 5, "[topic, partition, producer_id, sequence, length]")
        for i, (_topic, _partition, producer_id, sequence, length) in enumerate(self.parts):
            if not 0 <= producer_id < 1 << 63:
                raise ProtocolError("'producer_id' must be in [0, 2**63)", op=self.op, field="parts.producer_id",
                                    index=i, got=producer_id)
            if not (0 if producer_id else -1) <= sequence < 1 << 31:
                raise ProtocolError("'sequence' must be in [0, 2**31) for an idempotent producer, else -1",
                                    op=self.op, field="parts.sequence", index=i, got=sequence)
            if length < 1:
                raise ProtocolError("a part's payload is at least one byte", op=self.op, field="parts.length",
                                    index=i, got=length)


def split_payloads(parts: list, frame: Any) -> list:
    """The parts' payloads: zero-copy slices of frame 1 of a `produce_many`, in order."""
    view = memoryview(frame)
    total = sum(part[4] for part in parts)
    if total != len(view):
        raise ProtocolError("the parts' lengths do not add up to frame 1", op="produce_many", field="parts.length",
                            expected=total, got=len(view))
    out, at = [], 0
    for part in parts:
        out.append(view[at:at + part[4]])
        at += part[4]
    return out


@reply("produce_many")
class ProduceManyReply(Message):
    """results: [[base_offset, count, duplicate, error], ...] in the order of the request's
    parts; error is nil, or an error map (PROTOCOL.md s.3) with the other three 0, 0, false."""
    results: list

    def check(self) -> None:
        for i, r in enumerate(self.results):
            if not (type(r) is list and len(r) == 4 and _is_int(r[0]) and _is_int(r[1]) and type(r[2]) is bool
                    and (r[3] is None or type(r[3]) is dict)):
                raise ProtocolError("results items must be [base_offset, count, duplicate, error]", op=self.op,
                                    field="results", index=i)


@request("fetch_many")
class FetchMany(Message):
    """parts: [[topic, partition, offset, max_bytes], ...]. Never waits: it is answered at once."""
    parts: list
    max_bytes: int = 1 << 20  # bounds frame 1 of the reply, all parts together

    def check(self) -> None:
        _check_parts(self.op, self.parts, 4, "[topic, partition, offset, max_bytes]")
        for i, part in enumerate(self.parts):
            if part[2] < 0 or part[3] < 0:
                raise ProtocolError("'offset' and 'max_bytes' must be >= 0", op=self.op, field="parts", index=i)
        _nonneg(self.op, max_bytes=self.max_bytes)


@reply("fetch_many")
class FetchManyReply(Message):
    """parts: [[log_start, log_end, length, error], ...] in the order of the request's parts;
    frame 1 holds each part's stored batches, `length` bytes, back to back."""
    parts: list

    def check(self) -> None:
        for i, r in enumerate(self.parts):
            if not (type(r) is list and len(r) == 4 and all(_is_int(x) and x >= 0 for x in r[:3])
                    and (r[3] is None or type(r[3]) is dict)):
                raise ProtocolError("parts items must be [log_start, log_end, length, error]", op=self.op,
                                    field="parts", index=i)


def split_fetched(reply: FetchManyReply, frame: Any) -> list:
    """Each part's stored batches (a memoryview slice of frame 1; None for a part that
    failed), in the order of the parts."""
    view = memoryview(frame if frame is not None else b"")
    total = sum(r[2] for r in reply.parts)
    if total != len(view):
        raise ProtocolError("the parts' lengths do not add up to frame 1", op="fetch_many", field="parts",
                            expected=total, got=len(view))
    out, at = [], 0
    for r in reply.parts:
        out.append(None if r[3] is not None else view[at:at + r[2]])
        at += r[2]
    return out


@request("offset_for_time")
class OffsetForTime(Message):
    """The first offset of the first batch appended at or after `time_ms` (wall-clock ms)."""
    topic: str
    partition: int
    time_ms: int

    def check(self) -> None:
        _nonneg("offset_for_time", partition=self.partition, time_ms=self.time_ms)


@reply("offset_for_time")
class OffsetForTimeReply(Message):
    """offset: log_end when nothing was appended at or after the time."""
    offset: int
    log_start: int
    log_end: int


@reply("fetch")
class FetchReply(Message):
    """Frame 1 holds zero or more stored batches back to back."""
    log_start: int
    log_end: int
    more: bool = False  # a followed fetch stays open: another reply will come


# ======================================================================================
# Consumer groups (coordinator)
# ======================================================================================

@request("join")
class Join(Message):
    group: str
    topics: list
    member_id: str = ""
    session_timeout_ms: int = 10_000

    def check(self) -> None:
        validate_group_name(self.group, "join")
        validate_member_id(self.member_id, "join")
        if not self.topics or not all(isinstance(t, str) and t for t in self.topics):
            raise ProtocolError("'topics' must be a non-empty list of names", op="join", field="topics")
        if not (100 <= self.session_timeout_ms <= 3_600_000):
            raise ProtocolError("'session_timeout_ms' must be between 100 and 3600000", op="join",
                                field="session_timeout_ms", got=self.session_timeout_ms)


@reply("join")
class JoinReply(Message):
    """assignment: [[topic, partition], ...] (every subscribed partition in shared mode)."""
    member_id: str
    generation: int
    mode: str
    assignment: list
    ack_timeout_ms: int


@request("heartbeat")
class Heartbeat(Message):
    group: str
    member_id: str
    generation: int


@reply("heartbeat")
class HeartbeatReply(Message):
    generation: int
    assignment: list


@request("leave")
class Leave(Message):
    group: str
    member_id: str
    generation: int


@reply("leave")
class LeaveReply(Message):
    pass


@request("poll")
class Poll(Message):
    group: str
    member_id: str
    generation: int
    max_records: int = 1000
    max_wait_ms: int = 0
    # Exclusive groups: when nothing can be leased now, lease up to this many of
    # the next records ahead of the log end instead (reason "ahead", PROTOCOL.md).
    ahead: int = 0
    # Acks riding on the poll ([[topic, partition, lease_id, start, end], ...]), applied
    # before anything is leased: a consumer that polls as often as it acks sends one
    # message instead of two. The reply's `acked` and `stale` report them.
    acks: list = dataclasses.field(default_factory=list)

    def check(self) -> None:
        check_lease_ranges("poll", self.acks, field="acks")
        if not (1 <= self.max_records <= 1_000_000):
            raise ProtocolError("'max_records' must be between 1 and 1000000", op="poll", field="max_records",
                                got=self.max_records, limit=1_000_000)
        _nonneg("poll", max_wait_ms=self.max_wait_ms, ahead=self.ahead)
        if self.ahead > 1_000_000:
            raise ProtocolError("'ahead' must be at most 1000000", op="poll", field="ahead")
        if self.max_wait_ms > MAX_WAIT_MS:
            raise ProtocolError(f"'max_wait_ms' must be at most {MAX_WAIT_MS}", op="poll", field="max_wait_ms")


@reply("poll")
class PollReply(Message):
    """deliveries: [[topic, partition, lease_id, start, end, attempt, reason], ...]

    Each item leases offsets [start, end) of one partition. ``attempt`` counts
    deliveries including this one; ``reason`` is "new", "timeout", "nack",
    "rebalance", "restart", "nack:<text>" or "ahead" (offsets that may not
    exist yet, leased as they appear: see `Poll.ahead`). The records themselves are
    fetched from the partition actor named in `metadata`.

    ``acked``, ``stale`` and ``stale_omitted`` report the poll's ``acks`` like an ack
    reply would (``applied``, and the ``STALE_LEASE`` error's ``stale`` and
    ``stale_omitted``): stale ranges do not fail the poll.
    """
    generation: int
    deliveries: list
    ack_timeout_ms: int
    acked: int = 0
    stale: list = dataclasses.field(default_factory=list)
    stale_omitted: int = 0


@request("ack")
class Ack(Message):
    """ranges: [[topic, partition, lease_id, start, end], ...]"""
    group: str
    member_id: str
    generation: int
    ranges: list

    def check(self) -> None:
        check_lease_ranges("ack", self.ranges)


@request("nack")
class Nack(Message):
    group: str
    member_id: str
    generation: int
    ranges: list
    delay_ms: int = 0
    reason: str = ""

    def check(self) -> None:
        check_lease_ranges("nack", self.ranges)
        _nonneg("nack", delay_ms=self.delay_ms)
        _at_most_a_lease("nack", delay_ms=self.delay_ms)


@request("extend")
class Extend(Message):
    group: str
    member_id: str
    generation: int
    ranges: list
    extend_ms: int = 0

    def check(self) -> None:
        check_lease_ranges("extend", self.ranges)
        _nonneg("extend", extend_ms=self.extend_ms)
        _at_most_a_lease("extend", extend_ms=self.extend_ms)


@request("reject")
class Reject(Message):
    group: str
    member_id: str
    generation: int
    ranges: list
    reason: str = ""

    def check(self) -> None:
        check_lease_ranges("reject", self.ranges)


@reply("ack")
class AckReply(Message):
    applied: int


@reply("nack")
class NackReply(Message):
    applied: int


@reply("extend")
class ExtendReply(Message):
    applied: int
    deadline_in_ms: int = 0


@reply("reject")
class RejectReply(Message):
    applied: int


@request("list_groups")
class ListGroups(Message):
    pass


@reply("list_groups")
class ListGroupsReply(Message):
    groups: list


@request("describe_group")
class DescribeGroup(Message):
    group: str


@reply("describe_group")
class DescribeGroupReply(Message):
    group: dict


@request("configure_group")
class ConfigureGroup(Message):
    group: str
    mode: str | None = None
    ack_timeout_ms: int | None = None
    max_deliveries: int | None = None
    max_in_flight: int | None = None
    dlq: str | None = None
    start: str | None = None
    quarantine_after: int | None = None  # key_shared, exclusive: failures in a row that park a key; 0 turns it off
    max_keys: int | None = None          # key_shared: keys in flight or held back per partition

    def check(self) -> None:
        validate_group_name(self.group, "configure_group")
        if self.dlq:  # empty or absent: "<topic>.dlq"
            validate_topic_name(self.dlq, "dlq")
        if self.mode is not None and self.mode not in GROUP_MODES:
            raise ProtocolError("'mode' must be 'exclusive', 'shared' or 'key_shared'", op="configure_group",
                                field="mode", got=self.mode[:64])
        if self.start is not None and self.start not in ("earliest", "latest"):
            raise ProtocolError("'start' must be 'earliest' or 'latest'", op="configure_group", field="start",
                                got=self.start[:64])
        for name in ("ack_timeout_ms", "max_deliveries", "max_in_flight", "max_keys"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ProtocolError(f"{name!r} must be >= 1", op="configure_group", field=name, got=v)
        if self.quarantine_after is not None and self.quarantine_after < 0:
            raise ProtocolError("'quarantine_after' must be >= 0", op="configure_group", field="quarantine_after",
                                got=self.quarantine_after)
        _at_most_a_lease("configure_group", ack_timeout_ms=self.ack_timeout_ms)


@reply("configure_group")
class ConfigureGroupReply(Message):
    config: dict


@request("list_quarantine")
class ListQuarantine(Message):
    group: str

    def check(self) -> None:
        validate_group_name(self.group, "list_quarantine")


@reply("list_quarantine")
class ListQuarantineReply(Message):
    """keys: [{topic, partition, key_hash, first_offset, held, age_ms, reason, failures}, ...]"""
    keys: list


@request("release_key")
class ReleaseKey(Message):
    """Release a quarantined key, named by its bytes (`key`, a str is taken as UTF-8) or
    its hash (`key_hash`), in every partition of the group (or only `topic`)."""
    group: str
    key: str | bytes | None = None
    key_hash: int | None = None
    topic: str | None = None
    to_dlq: bool = False

    def check(self) -> None:
        validate_group_name(self.group, "release_key")
        if (self.key is None) == (self.key_hash is None):
            raise ProtocolError("give exactly one of 'key' and 'key_hash'", op="release_key", field="key")


@reply("release_key")
class ReleaseKeyReply(Message):
    """released: [{topic, partition, key_hash, records}, ...] (records: sent to the DLQ, or 0)"""
    released: list


@request("reset_group")
class ResetGroup(Message):
    """`to`, or `to_time_ms` (each partition to the first offset appended at or after
    that wall-clock time; an admin addition, PROTOCOL.md s.8.5): exactly one of them."""
    group: str
    topic: str
    to: str | int | None = None
    to_time_ms: int | None = None

    def check(self) -> None:
        validate_group_name(self.group, "reset_group")
        if (self.to is None) == (self.to_time_ms is None):
            raise ProtocolError("give exactly one of 'to' and 'to_time_ms'", op="reset_group", field="to")
        if self.to_time_ms is not None and self.to_time_ms < 0:
            raise ProtocolError("'to_time_ms' must be >= 0", op="reset_group", field="to_time_ms",
                                got=self.to_time_ms)
        if isinstance(self.to, str) and self.to not in ("earliest", "latest"):
            raise ProtocolError("'to' must be 'earliest', 'latest' or an offset", op="reset_group", field="to",
                                got=self.to[:64])
        if isinstance(self.to, int) and self.to < 0:
            raise ProtocolError("'to' offset must be >= 0", op="reset_group", field="to", got=self.to)


@reply("reset_group")
class ResetGroupReply(Message):
    """partitions: [[partition, new_committed_offset], ...]"""
    partitions: list
    reset_epoch: int


# ======================================================================================
# Admin operations (coordinator; PROTOCOL.md s.8.5). An older coordinator answers each
# UNKNOWN_OP, so a client can tell "not supported" from a refusal.
# ======================================================================================

@request("alter_topic")
class AlterTopic(Message):
    """Grow a topic's partition count and/or change its retention; nil leaves a setting as is."""
    topic: str
    partitions: int | None = None
    retention_ms: int | None = None
    retention_bytes: int | None = None

    def check(self) -> None:
        validate_topic_name(self.topic)
        if self.partitions is not None and not (1 <= self.partitions <= 10_000):
            raise ProtocolError("'partitions' must be between 1 and 10000", op="alter_topic",
                                field="partitions", got=self.partitions)
        for name in ("retention_ms", "retention_bytes"):
            v = getattr(self, name)
            if v is not None and v < -1:
                raise ProtocolError(f"{name!r} must be -1 (unlimited) or >= 0", op="alter_topic", field=name,
                                    got=v)


@reply("alter_topic")
class AlterTopicReply(Message):
    topic: str
    partitions: int
    config: dict


@request("delete_group")
class DeleteGroup(Message):
    group: str

    def check(self) -> None:
        validate_group_name(self.group, "delete_group")


@reply("delete_group")
class DeleteGroupReply(Message):
    """partitions: [[topic, partition], ...] whose stored offsets were removed."""
    group: str
    partitions: list


@request("delete_topic")
class DeleteTopic(Message):
    topic: str

    def check(self) -> None:
        validate_topic_name(self.topic)


@reply("delete_topic")
class DeleteTopicReply(Message):
    """partitions: how many it had; groups: the groups whose offsets on it were removed;
    pending: [[partition, actor_id], ...] whose files that actor has not confirmed deleted
    yet (it is down): they go when it comes back, and the name is free for a new topic then."""
    topic: str
    partitions: int
    groups: list
    pending: list = dataclasses.field(default_factory=list)


# ======================================================================================
# Internal: partition actors <-> coordinator
# ======================================================================================

@request("delete_partitions")
class DeletePartitions(Message):
    """Coordinator -> partition actor: close these partitions if open and delete their
    files ([[topic, partition], ...]); refused below the highest coordinator epoch seen."""
    partitions: list
    coordinator_epoch: int = 0

    def check(self) -> None:
        if not all(isinstance(x, list) and len(x) == 2 and isinstance(x[1], int) for x in self.partitions):
            raise ProtocolError("'partitions' must be [[topic, partition], ...]", op=self.op, field="partitions")
        for topic, _partition in self.partitions:
            validate_topic_name(topic)


@reply("delete_partitions")
class DeletePartitionsReply(Message):
    """deleted: [[topic, partition], ...] gone from this actor's disk (absent counts);
    failed: [[topic, partition, reason], ...] to be asked again."""
    deleted: list
    failed: list = dataclasses.field(default_factory=list)


@request("register")
class Register(Message):
    """A partition actor announces itself. partitions: [[topic, partition, log_start, log_end, bytes]];
    not_open: [[topic, partition, reason]], the first MAX_NOT_OPEN_LISTED of the not_open_count
    partitions assigned to it that it has not opened (no descriptors left, locked, ...)."""
    actor_id: str
    endpoint: str
    storage_id: str
    pid: int
    partitions: list
    not_open: list = dataclasses.field(default_factory=list)
    not_open_count: int = 0
    # Replica placement prefers distinct racks (zbroker partition --rack).
    rack: str | None = None
    # [[topic, partition, leader_epoch, log_end, high_watermark]] for every replica it holds.
    replica_states: list = dataclasses.field(default_factory=list)

    def check(self) -> None:
        check_replica_states(self.op, self.replica_states)
        if len(self.not_open) > MAX_NOT_OPEN_LISTED:
            raise ProtocolError("register lists too many partitions not open", op=self.op, field="not_open",
                                limit=MAX_NOT_OPEN_LISTED, got=len(self.not_open))
        for i, item in enumerate(self.not_open):
            if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                    and isinstance(item[1], int) and not isinstance(item[1], bool) and isinstance(item[2], str)):
                raise ProtocolError("not_open items must be [topic, partition, reason]", op=self.op,
                                    field="not_open", index=i)
        _nonneg(self.op, not_open_count=self.not_open_count)


def check_assignment(op: str, assignment: list, field: str = "assignment") -> None:
    for i, item in enumerate(assignment):
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                and isinstance(item[1], int) and not isinstance(item[1], bool) and 0 <= item[1] < 1 << 31
                and (item[2] is None or isinstance(item[2], dict))):
            raise ProtocolError("assignment items must be [topic, partition, config]", op=op, field=field,
                                index=i)
        validate_topic_name(item[0], field)


@reply("register")
class RegisterReply(Message):
    """assignment: [[topic, partition, config], ...] the actor should own; replicas and
    coordinator_epoch as in `Assign`."""
    assignment: list
    replicas: list = dataclasses.field(default_factory=list)
    coordinator_epoch: int = 0

    def check(self) -> None:
        check_assignment("register", self.assignment)
        check_replicas("register", self.replicas)


REPLICA_STATE_KEYS = {"leader_epoch": int, "leader": (str, type(None)), "leader_endpoint": (str, type(None)),
                      "replicas": list, "isr": list, "min_insync": int, "replica_endpoints": dict}


def check_replicas(op: str, replicas: list) -> None:
    """Each item is [topic, partition, state], state a map with REPLICA_STATE_KEYS."""
    for i, item in enumerate(replicas):
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and _is_int(item[1])
                and isinstance(item[2], dict)):
            raise ProtocolError("replicas items must be [topic, partition, state]", op=op, index=i, field="replicas")
        state = item[2]
        for key, kind in REPLICA_STATE_KEYS.items():
            value = state.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ProtocolError(f"replica state field {key!r} is missing or has the wrong type", op=op,
                                    index=i, field=key)
        if state["leader_epoch"] < 0 or state["min_insync"] < 1 or not all(
                isinstance(r, str) for r in state["replicas"] + state["isr"]):
            raise ProtocolError("replica state needs leader_epoch >= 0, min_insync >= 1 and actor ids",
                                op=op, index=i, field="replicas")
        hw = state.get("high_watermark")  # optional: the last HW a leader published
        if hw is not None and not (_is_int(hw) and hw >= 0):
            raise ProtocolError("replica state field 'high_watermark' must be an integer >= 0", op=op, index=i,
                                field="high_watermark")


@request("report", tell=True)
class Report(Message):
    """Log-end report. partitions: [[topic, partition, log_start, log_end, bytes], ...];
    replica_states as in `Register`."""
    actor_id: str
    partitions: list
    replica_states: list = dataclasses.field(default_factory=list)

    def check(self) -> None:
        check_replica_states(self.op, self.replica_states)


def check_replica_states(op: str, states: list) -> None:
    for i, item in enumerate(states):
        # The sixth item, keeping_up (int, or None from a follower), is optional: an older
        # actor sends five.
        if not (isinstance(item, list) and len(item) in (5, 6) and isinstance(item[0], str)
                and all(_is_int(x) for x in item[1:5])
                and (len(item) == 5 or item[5] is None or _is_int(item[5]))):
            raise ProtocolError("replica_states items must be [topic, partition, leader_epoch, log_end, "
                                "high_watermark, keeping_up]", op=op, index=i, field="replica_states")


# ======================================================================================
# Internal: replication (follower -> leader, leader -> coordinator)
# ======================================================================================

@request("replica_fetch")
class ReplicaFetch(Message):
    """Follower -> leader: the stored batches from fetch_offset, which is also the
    follower's log end. last_fetched_epoch: the epoch of the follower's record at
    fetch_offset - 1 (-1 for none), so the leader can tell it where they diverge."""
    topic: str
    partition: int
    replica_id: str
    leader_epoch: int
    fetch_offset: int
    last_fetched_epoch: int
    max_bytes: int = 1 << 20
    max_wait_ms: int = 0
    # A fetch waiting at the log end may be held for min_bytes, at most linger_ms after the
    # first byte it lacks (docs/PROTOCOL.md); the defaults answer at the first byte.
    min_bytes: int = 1
    linger_ms: int = 0

    def check(self) -> None:
        _nonneg(self.op, partition=self.partition, leader_epoch=self.leader_epoch,
                fetch_offset=self.fetch_offset, max_bytes=self.max_bytes, max_wait_ms=self.max_wait_ms,
                min_bytes=self.min_bytes, linger_ms=self.linger_ms)
        for field in ("max_wait_ms", "linger_ms"):
            if getattr(self, field) > MAX_WAIT_MS:
                raise ProtocolError(f"{field!r} must be at most {MAX_WAIT_MS}", op=self.op, field=field)


@reply("replica_fetch")
class ReplicaFetchReply(Message):
    """Payload frames: stored batches from fetch_offset (none when diverging). epochs:
    [[epoch, start_offset]] describing the returned range. diverging: {"epoch",
    "end_offset"} when the follower's log parts from the leader's below fetch_offset."""
    topic: str
    partition: int
    leader_epoch: int
    high_watermark: int
    log_start: int
    log_end: int
    epochs: list = dataclasses.field(default_factory=list)
    diverging: dict | None = None

    def check(self) -> None:
        for i, entry in enumerate(self.epochs):
            if not (isinstance(entry, list) and len(entry) == 2 and all(_is_int(x) and x >= 0 for x in entry)):
                raise ProtocolError("epochs items must be [epoch, start_offset]", op=self.op, index=i, field="epochs")
        if self.diverging is not None and not (_is_int(self.diverging.get("epoch"))
                                               and _is_int(self.diverging.get("end_offset"))):
            raise ProtocolError("diverging must be {epoch, end_offset}", op=self.op, field="diverging")


@request("alter_isr")
class AlterIsr(Message):
    """Partition leader -> coordinator: the ISR it proposes (shrink or expand)."""
    topic: str
    partition: int
    leader_epoch: int
    isr: list

    def check(self) -> None:
        _check_actor_ids(self.op, self.isr)


@reply("alter_isr")
class AlterIsrReply(Message):
    """The ISR the controller has recorded; the leader adopts it."""
    topic: str
    partition: int
    leader_epoch: int
    isr: list

    def check(self) -> None:
        _check_actor_ids(self.op, self.isr)


def _check_actor_ids(op: str, ids: list) -> None:
    if not ids or not all(isinstance(x, str) for x in ids):
        raise ProtocolError("'isr' must be a non-empty list of actor ids", op=op, field="isr")


@request("deregister", tell=True)
class Deregister(Message):
    """A partition actor stopping on purpose, its logs closed: its partitions may move now,
    not once its registrations lapse. Ignored unless `pid` is the registered one."""
    actor_id: str
    pid: int


@request("assign")
class Assign(Message):
    """Coordinator -> partition actor: the full set it should own. [[topic, partition, config]]

    replicas: [[topic, partition, state]] for the replicated ones among them (see
    `check_replicas`); coordinator_epoch: the sender's lease epoch (0 from a coordinator
    that predates replication), the actor refuses one below the highest it has seen."""
    assignment: list
    coordinator_epoch: int = 0
    replicas: list = dataclasses.field(default_factory=list)

    def check(self) -> None:
        check_assignment("assign", self.assignment)
        check_replicas("assign", self.replicas)


@reply("assign")
class AssignReply(Message):
    partitions: list


@request("reassign_partition")
class ReassignPartition(Message):
    """Admin: move a replicated partition to `replicas` (actor ids) online."""
    topic: str
    partition: int
    replicas: list

    def check(self) -> None:
        if not self.replicas or not all(isinstance(r, str) and r for r in self.replicas):
            raise ProtocolError("'replicas' must be a non-empty list of actor ids", op=self.op, field="replicas")


@reply("reassign_partition")
class ReassignPartitionReply(Message):
    """replicas: the set now (target + replicas leaving while the move runs); done once it is target."""
    topic: str
    partition: int
    replicas: list
    target: list
    done: bool = False


# ======================================================================================
# Internal: coordinator <-> commit writer
# ======================================================================================

@request("writer_status", tell=True)
class WriterStatus(Message):
    """Writer -> coordinator, every second: health and counters."""
    pid: int
    healthy: bool
    metrics: dict


@request("advance")
class Advance(Message):
    """Coordinator -> writer.

    advances: [[group, topic, partition, committed_offset, holes, generation, reset_epoch], ...]
    where holes is [[start, end], ...], acked ranges above committed_offset. A row may
    carry an eighth element, quarantine: [[key_hash, failures, reason], ...], the keys
    parked there (none when absent; the writer checks its elements).
    """
    advances: list

    def check(self) -> None:
        # Exact types, as msgpack decodes them (so a bool, an int subclass, is no integer here):
        # this runs for every advance, 100,000 and more a second, and a generator per row showed.
        for i, a in enumerate(self.advances):
            if not (type(a) is list and (len(a) == 7 or len(a) == 8 and type(a[7]) is list) and type(a[0]) is str and type(a[1]) is str
                    and type(a[2]) is int and type(a[3]) is int and type(a[5]) is int and type(a[6]) is int
                    and type(a[4]) is list):
                raise ProtocolError("advance must be [group, topic, partition, committed, holes, "
                                    "generation, reset_epoch]", op="advance", field="advances", index=i)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# What one advance row can take on the wire besides its names: the array and string
# headers, four integers of up to 9 bytes, the holes array header; each hole is at
# most 19 bytes ([start, end] as two uint64).
_ADVANCE_ROW_FIXED_BYTES = 64
_ADVANCE_HOLE_BYTES = 19


def split_advances(rows: list, max_bytes: int) -> list[list]:
    """The rows in consecutive groups, each of whose `Advance` header stays under `max_bytes`.

    A header over the limit is not even read by the receiver (TOO_LARGE with no id
    to match), so the sender splits. The sizes are upper bounds; a row larger than
    `max_bytes` on its own still travels alone.
    """
    groups: list[list] = []
    current: list = []
    used = 0
    for row in rows:
        size = (_ADVANCE_ROW_FIXED_BYTES + len(row[0].encode()) + len(row[1].encode())
                + _ADVANCE_HOLE_BYTES * len(row[4]))
        if len(row) > 7:  # parked keys: two integers and a reason each
            size += sum(_ADVANCE_HOLE_BYTES + 5 + len(q[2].encode()) for q in row[7])
        if current and used + size > max_bytes:
            groups.append(current)
            current, used = [], 0
        current.append(row)
        used += size
    if current:
        groups.append(current)
    return groups


@reply("advance")
class AdvanceReply(Message):
    """durable: [[group, topic, partition, committed_offset, reset_epoch], ...] now on disk."""
    durable: list

    def check(self) -> None:
        for i, d in enumerate(self.durable):
            if not (isinstance(d, list) and len(d) == 5 and isinstance(d[0], str) and isinstance(d[1], str)
                    and all(_is_int(x) for x in d[2:])):
                raise ProtocolError("durable items must be [group, topic, partition, committed, reset_epoch]",
                                    op="advance", field="durable", index=i)


@request("load_offsets")
class LoadOffsets(Message):
    """One page of stored offsets, ordered by (group, topic, partition), after the key ``after``."""
    after: list | None = None
    limit: int = 2000

    def check(self) -> None:
        if self.after is not None and not (len(self.after) == 3 and isinstance(self.after[0], str)
                                           and isinstance(self.after[1], str) and isinstance(self.after[2], int)):
            raise ProtocolError("'after' must be [group, topic, partition]", op="load_offsets", field="after")
        if not 1 <= self.limit <= 10_000:
            raise ProtocolError("'limit' must be between 1 and 10000", op="load_offsets", field="limit",
                                got=self.limit)


@reply("load_offsets")
class LoadOffsetsReply(Message):
    """rows: [[group, topic, partition, committed_offset, holes, generation, reset_epoch], ...],
    a row with parked keys carrying them as an eighth element (as in `Advance`).

    ``more`` is true when further rows follow: ask again with ``after`` = the last row's key.
    """
    rows: list
    more: bool = False

    def check(self) -> None:
        for i, r in enumerate(self.rows):
            if not (isinstance(r, list) and (len(r) == 7 or len(r) == 8 and isinstance(r[7], list))
                    and isinstance(r[0], str) and isinstance(r[1], str)
                    and all(_is_int(x) for x in (r[2], r[3], r[5], r[6])) and isinstance(r[4], list)
                    and all(isinstance(h, list) and len(h) == 2 and all(_is_int(x) for x in h) for h in r[4])):
                raise ProtocolError("rows must be [group, topic, partition, committed, holes, generation, "
                                    "reset_epoch]", op="load_offsets", field="rows", index=i)


# -- coordinator <-> commit writer: cluster metadata and the coordinator lease (issues 25, 26)
# The writer is each node's only gateway to the store; the shapes of the lists are those of
# storage/offsets/metadata.py (to_wire/from_wire), which checks them element by element.

@request("coordinator_lease")
class CoordinatorLease(Message):
    """Coordinator -> writer: take or renew the coordinator lease (by the database's clock).

    The writer adopts the answer's epoch for its fenced flushes when ``held``.
    """
    node_id: str
    endpoint: str
    lease_ms: int


@reply("coordinator_lease")
class CoordinatorLeaseReply(Message):
    """The lease row as the database saw it: holder, epoch, whether the asker holds it, and
    how long the holder's lease still runs by the database clock."""
    holder: str | None
    holder_endpoint: str | None
    epoch: int
    held: bool
    remaining_ms: int


@request("load_metadata")
class LoadMetadata(Message):
    """Coordinator -> writer: every topic and partition state in the store."""


@reply("load_metadata")
class LoadMetadataReply(Message):
    """topics: [[name, partitions, config, replication_factor, min_insync, incarnation], ...]
    partitions: [[topic, partition, replicas, leader, leader_epoch, isr], ...]"""
    topics: list
    partitions: list
    group_configs: list = dataclasses.field(default_factory=list)  # [[group, config map], ...]


@request("write_metadata")
class WriteMetadata(Message):
    """Coordinator -> writer: one atomic change set, applied only while `coordinator_epoch` is
    the lease's and every partition's stored leader epoch is the expected one.

    create_topics, update_topics: topic lists as in LoadMetadataReply; delete_topics:
    [[name, incarnation], ...]; partitions: [[topic, partition, replicas, leader,
    leader_epoch, isr, expected_leader_epoch | nil], ...] (nil: a new partition).
    """
    coordinator_epoch: int
    create_topics: list = dataclasses.field(default_factory=list)
    update_topics: list = dataclasses.field(default_factory=list)
    delete_topics: list = dataclasses.field(default_factory=list)
    partitions: list = dataclasses.field(default_factory=list)
    group_configs: list = dataclasses.field(default_factory=list)  # [[group, config map | nil], ...]

    def check(self) -> None:
        for i, d in enumerate(self.delete_topics):
            if not (isinstance(d, list) and len(d) == 2 and isinstance(d[0], str) and _is_int(d[1])):
                raise ProtocolError("delete_topics items must be [name, incarnation]", op=self.op,
                                    field="delete_topics", index=i)


@reply("write_metadata")
class WriteMetadataReply(Message):
    """applied: false when a condition failed; then nothing was written."""
    applied: bool
