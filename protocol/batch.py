"""Record batches: the client payload and the stored (and fetched) batch layout.

Theory of operation
-------------------
A producer sends one *payload* per produce request: a msgpack array of
records, each record itself an array ``[timestamp_ms, key, value, headers]``
(``key`` bin or nil, ``value`` bin, ``headers`` map str->bin or nil).

The partition log never re-encodes that payload. It checks the records'
shapes with C-level passes (`validate_payload`), assigns the base offset, and
writes ``BATCH_HEADER + payload`` to the segment file as it arrived. A fetch reply
carries those stored bytes verbatim, so the on-disk layout below *is* part of
the wire protocol (docs/PROTOCOL.md, "Stored batch").

Stored batch, all integers big-endian::

    0   4  magic            b"ZBB1"
    4   4  crc32            zlib/IEEE CRC-32 of bytes 8 .. end of payload
    8   4  payload_length   bytes of payload that follow the header
    12  8  base_offset      offset of the first record (u64)
    20  4  record_count     records in the payload (u32, >= 1)
    24  8  append_time_ms   broker wall clock when appended (i64)
    32  8  producer_id      idempotent producer id, 0 when none (i64)
    40  4  producer_seq     producer's batch sequence, -1 when none (i32)
    44     payload          msgpack array of records
"""

from __future__ import annotations

import struct
import zlib
from itertools import count, repeat
from operator import add, itemgetter
from typing import Any, Callable, Iterator, NamedTuple

import msgpack

from zbroker.protocol.errors import CorruptBatch

BATCH_MAGIC = b"ZBB1"
BATCH_HEADER = struct.Struct(">4sIIQIqqi")
BATCH_HEADER_SIZE = BATCH_HEADER.size  # 44
# The part of the header covered by the CRC starts after the crc field.
_CRC_START = 8


class BatchHeader(NamedTuple):
    crc: int
    payload_length: int
    base_offset: int
    record_count: int
    append_time_ms: int
    producer_id: int
    producer_seq: int

    @property
    def total_size(self) -> int:
        return BATCH_HEADER_SIZE + self.payload_length

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.record_count


class Record(tuple):
    """One record as a consumer sees it: an immutable tuple with named fields.

    A tuple subclass because a consumer builds hundreds of thousands per
    second: `decode_fetched` creates each with one ``tuple.__new__`` from the
    stored ``(timestamp_ms, key, value, headers)`` tuple plus two items. The
    layout is ``(timestamp_ms, key, value, headers, offset, source)``: what
    every record of a fetched batch shares (``(topic, partition)``, and the
    lease in `ConsumedRecord`) is one ``source`` tuple, not copied per record.
    Six slots instead of ten make each record cheaper to build and cheaper for
    the garbage collector to walk while it is alive (bench/PROFILE.md).
    Use the names; the positions are an implementation detail.
    """

    __slots__ = ()
    # The attribute names, in the constructor's order (not the tuple's positions).
    _fields = ("topic", "partition", "offset", "timestamp_ms", "key", "value", "headers")

    def __new__(cls, topic: str, partition: int, offset: int, timestamp_ms: int, key: bytes | None,
                value: bytes, headers: dict[str, bytes] | None, *extra: Any) -> "Record":
        return tuple.__new__(cls, (timestamp_ms, key, value, headers, offset, (topic, partition, *extra)))

    def __getnewargs__(self) -> tuple:  # pickling (multiprocessing queues) goes through __new__
        return (self[5][0], self[5][1], self[4], *self[:4], *self[5][2:])

    timestamp_ms = property(itemgetter(0))
    key = property(itemgetter(1))
    value = property(itemgetter(2))
    headers = property(itemgetter(3))
    offset = property(itemgetter(4))

    @property
    def topic(self) -> str:
        return self[5][0]

    @property
    def partition(self) -> int:
        return self[5][1]

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.topic}/{self.partition}@{self.offset}, key={self.key!r:.40}, "
                f"value={self.value!r:.40}, headers={self.headers!r:.80})")


# -- client side: building a payload -------------------------------------------------

_packer_default = msgpack.Packer(use_bin_type=True)


def encode_records(records: list[list]) -> bytes:
    """Pack ``[[timestamp_ms, key, value, headers], ...]`` into a batch payload."""
    return _packer_default.pack(records)


def encode_values(values: list[bytes], timestamp_ms: int) -> bytes:
    """Fast path for key-less, header-less records that share one timestamp.

    The bytes are exactly what `encode_records` makes of ``[[timestamp_ms, None, v,
    None], ...]``. When every value has the same length (the usual bulk send), each
    record is the same prefix, the value and a nil, so the payload is one
    ``bytes.join`` in C instead of a list per record and a packer walk: about a
    fifth of the client's cost per record at 100 bytes (bench/PROFILE.md).
    """
    if not values or set(map(type, values)) != {bytes} or len(set(map(len, values))) != 1:
        return _packer_default.pack([[timestamp_ms, None, v, None] for v in values])
    return _packer_default.pack_array_header(len(values)) + _uniform_values_body(values, timestamp_ms)


def _uniform_values_body(values: list[bytes], timestamp_ms: int) -> bytes:
    """The records ``[timestamp_ms, None, v, None]`` of equal-length ``bytes`` values,
    packed one after another (no array header)."""
    first = values[0]
    packed_first = _packer_default.pack(first)  # bin header + value
    # fixarray(4), timestamp, nil key, bin header of this length; then value, nil headers.
    prefix = b"\x94" + _packer_default.pack(timestamp_ms) + b"\xc0" + packed_first[:len(packed_first) - len(first)]
    return prefix + (b"\xc0" + prefix).join(values) + b"\xc0"


def encode_columns(values: list[bytes], stamps: list[tuple[int, int]],
                   extras: dict[int, tuple[bytes | None, dict | None]] | None) -> bytes:
    """Pack records kept as columns (the producer's open batch) into a batch payload.

    ``values`` in order; ``stamps`` the runs of equal timestamps, ``(first index,
    timestamp_ms)`` each, the first at index 0; ``extras`` ``{index: (key, headers)}``
    for the records that have either. The bytes are exactly what `encode_records`
    makes of the same records. Records sent within one millisecond share a run, so
    a batch of key-less records is a few `bytes.join` calls in C, not a list per
    record and a packer walk (bench/PROFILE.md, tenth pass).
    """
    ends = [start for start, _ in stamps[1:]]
    ends.append(len(values))
    if extras:
        records = []
        for (start, stamp), end in zip(stamps, ends):
            for index in range(start, end):
                key, headers = extras.get(index, (None, None))
                records.append([stamp, key, values[index], headers])
        return _packer_default.pack(records)
    parts = [_packer_default.pack_array_header(len(values))]
    for (start, stamp), end in zip(stamps, ends):
        run = values[start:end]
        if len(set(map(len, run))) == 1:
            parts.append(_uniform_values_body(run, stamp))
        else:
            parts.extend(_packer_default.pack([stamp, None, v, None]) for v in run)
    return b"".join(parts)


# -- broker side: validating a payload without decoding its records ------------------


def payload_record_count(payload: bytes | memoryview) -> int:
    """Read the record count from the payload's msgpack array header.

    This is all the partition log learns about a payload before storing it.
    A payload that does not start with an array header is rejected; the
    records themselves are checked by `validate_payload` where wanted.
    """
    n = len(payload)
    if n == 0:
        raise CorruptBatch("empty batch payload")
    first = payload[0]
    if 0x90 <= first <= 0x9F:
        count = first & 0x0F
    elif first == 0xDC and n >= 3:
        count = int.from_bytes(payload[1:3], "big")
    elif first == 0xDD and n >= 5:
        count = int.from_bytes(payload[1:5], "big")
    else:
        raise CorruptBatch("batch payload is not a msgpack array of records", first_byte=first)
    if count == 0:
        raise CorruptBatch("batch payload holds no records")
    # Each record is at least a 1-byte fixarray header plus 4 one-byte fields.
    if count * 5 > n:
        raise CorruptBatch("batch payload declares more records than it can hold",
                           declared=count, payload_bytes=n)
    return count


_NONE = type(None)
_ts, _key, _value, _headers = itemgetter(0), itemgetter(1), itemgetter(2), itemgetter(3)


# Fixed-width msgpack integers (type byte -> bytes after it) and bin headers (type byte
# -> length bytes), the encodings a uniform batch may use.
_FIXED_INT_WIDTH = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}
_BIN_LENGTH_BYTES = {0xC4: 1, 0xC5: 2, 0xC6: 4}
_FIXINTS = bytes(range(0x80)) + bytes(range(0xE0, 0x100))


class UniformLayout(NamedTuple):
    """Where the parts of every record sit in a uniform batch (see `uniform_layout`)."""

    count: int  # records
    start: int  # where the first record starts (after the array header)
    stride: int  # bytes per record
    key_at: int  # offset of the nil key in a record; the timestamp is bytes 1 .. key_at
    value_start: int  # offset of the value's first byte in a record
    value_length: int


def uniform_record_count(payload: bytes | memoryview) -> int | None:
    """The record count of a payload whose records are all laid out like its first,
    ``[timestamp, nil, bin of one length, nil]`` with one integer width, checked on
    the bytes; None when it is anything else (`validate_payload` then decodes it).

    This is what `encode_values` sends for a bulk of equal-sized values. If every
    record starts with the same bytes at the same stride, has its nils and its bin
    header where the first one has them, and the records fill the payload exactly,
    then msgpack decodes it to exactly that many well-formed records: the bytes in
    between are a fixed-width integer's and the values' own, any of which is valid.
    Each check is one strided slice compared in C, a few microseconds per batch
    where decoding the records costs about 0.5 µs each.
    """
    layout = uniform_layout(payload)
    return None if layout is None else layout.count


def uniform_layout(payload: bytes | memoryview) -> UniformLayout | None:
    """`uniform_record_count`'s check, returning where each record's parts are."""
    view = memoryview(payload).cast("B")  # strided slices of a view copy nothing
    n = len(view)
    if n < 6:
        return None
    first = view[0]
    if 0x90 <= first <= 0x9F:
        count, start = first & 0x0F, 1
    elif first == 0xDC:
        count, start = int.from_bytes(view[1:3], "big"), 3
    elif first == 0xDD:
        count, start = int.from_bytes(view[1:5], "big"), 5
    else:
        return None
    if count == 0 or n < start + 6 or view[start] != 0x94:
        return None
    ts_type = view[start + 1]
    if ts_type <= 0x7F or ts_type >= 0xE0:
        key_at = 2  # a fixint: the type byte is the value
    elif ts_type in _FIXED_INT_WIDTH:
        key_at = 2 + _FIXED_INT_WIDTH[ts_type]
    else:
        return None
    value_at = key_at + 1
    length_bytes = _BIN_LENGTH_BYTES.get(view[start + value_at]) if n > start + value_at else None
    if length_bytes is None or n < start + value_at + 1 + length_bytes:
        return None
    header_end = value_at + 1 + length_bytes
    value_len = int.from_bytes(view[start + value_at + 1:start + header_end], "big")
    stride = header_end + value_len + 1  # the nil headers close each record
    if n - start != count * stride:
        return None
    body = view[start:]
    if count == 1:
        # The one record is its own pattern: only its two nils are left to check. The
        # strided comparisons below cost 13,000 of the 29,000 instructions of checking
        # a one-record batch (callgrind; bench/PROFILE.md, twentieth pass), which is
        # what a producer that does not batch sends with every request.
        if body[key_at] != 0xC0 or body[stride - 1] != 0xC0:
            return None
        return UniformLayout(1, start, stride, key_at, header_end, value_len)
    nil = b"\xc0" * count
    if body[0::stride] != b"\x94" * count or body[key_at::stride] != nil or body[stride - 1::stride] != nil:
        return None
    timestamps = body[1::stride]
    if key_at == 2:
        if timestamps.tobytes().translate(None, _FIXINTS):  # a byte left is no fixint
            return None
    elif timestamps != bytes((ts_type,)) * count:
        return None
    for i in range(value_at, header_end):  # the bin type and length bytes, alike in every record
        if body[i::stride] != bytes((body[i],)) * count:
            return None
    return UniformLayout(count, start, stride, key_at, header_end, value_len)


def validate_payload(payload: bytes | memoryview) -> int:
    """Decode a payload and check every record's shape; returns the record count.

    The partition actor runs this on every produce, so a malformed batch gets
    CORRUPT_BATCH instead of being stored to fail every consumer later. A
    uniform batch (what `encode_values` sends) is checked on its bytes by
    `uniform_record_count`; any other is decoded, and each check is one pass in
    C (``set(map(...))``), about 0.2 µs per record. The payload is stored
    exactly as it arrived either way.
    """
    count = uniform_record_count(payload)
    return count if count is not None else validate_by_decoding(payload)


def validate_by_decoding(payload: bytes | memoryview) -> int:
    """`validate_payload` for any batch: decode every record and check its shape."""
    try:
        records = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=False, ext_hook=_reject_ext)
    except CorruptBatch:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise CorruptBatch(f"batch payload is not valid msgpack: {type(exc).__name__}") from None
    if type(records) is not tuple or not records:
        raise CorruptBatch("batch payload must be a non-empty array of records")
    if set(map(type, records)) != {tuple} or set(map(len, records)) != {4}:
        raise CorruptBatch("every record must be [timestamp_ms, key, value, headers]")
    if set(map(type, map(_ts, records))) != {int}:
        raise CorruptBatch("record timestamps must be integers")
    if not set(map(type, map(_key, records))) <= {bytes, _NONE}:
        raise CorruptBatch("record keys must be bin or nil")
    if set(map(type, map(_value, records))) != {bytes}:
        raise CorruptBatch("record values must be bin")
    header_types = set(map(type, map(_headers, records)))
    if not header_types <= {dict, _NONE}:
        raise CorruptBatch("record headers must be a map or nil")
    if dict in header_types:
        for headers in map(_headers, records):
            if headers and not (set(map(type, headers)) <= {str} and set(map(type, headers.values())) <= {bytes}):
                raise CorruptBatch("record headers must map str to bin")
    return len(records)


def _reject_ext(code: int, data: bytes) -> None:
    raise CorruptBatch("msgpack ext types are not allowed", ext_code=code)


# -- the stored batch -------------------------------------------------------------------


def build_batch_header(payload: bytes | memoryview, *, base_offset: int, record_count: int,
                       append_time_ms: int, producer_id: int = 0, producer_seq: int = -1) -> bytes:
    """Header for a payload about to be appended. CRC covers header tail + payload."""
    tail = struct.pack(">IQIqqi", len(payload), base_offset, record_count, append_time_ms,
                       producer_id, producer_seq)
    crc = zlib.crc32(payload, zlib.crc32(tail))
    return BATCH_MAGIC + crc.to_bytes(4, "big") + tail


def parse_batch_header(buf: bytes | memoryview, pos: int = 0) -> BatchHeader:
    """Parse the header at ``pos``. Raises CorruptBatch on a bad magic or short buffer."""
    if len(buf) - pos < BATCH_HEADER_SIZE:
        raise CorruptBatch("short batch header", position=pos)
    magic, crc, length, base, count, ts, pid, seq = BATCH_HEADER.unpack_from(buf, pos)
    if magic != BATCH_MAGIC:
        raise CorruptBatch("bad batch magic", position=pos)
    if count == 0:
        raise CorruptBatch("batch with zero records", position=pos)
    return BatchHeader(crc, length, base, count, ts, pid, seq)


def batch_crc_ok(buf: bytes | memoryview, pos: int, header: BatchHeader) -> bool:
    end = pos + header.total_size
    if end > len(buf):
        return False
    view = memoryview(buf)
    crc = zlib.crc32(view[pos + BATCH_HEADER_SIZE:end], zlib.crc32(view[pos + _CRC_START:pos + BATCH_HEADER_SIZE]))
    return crc == header.crc


def iter_stored_batches(blob: bytes | memoryview, *, verify_crc: bool = True
                        ) -> Iterator[tuple[BatchHeader, memoryview]]:
    """Walk concatenated stored batches (a fetch reply frame). Yields (header, payload)."""
    view = memoryview(blob)
    pos = 0
    n = len(view)
    while pos < n:
        header = parse_batch_header(view, pos)
        end = pos + header.total_size
        if end > n:
            raise CorruptBatch("batch runs past the end of the frame", position=pos)
        if verify_crc and not batch_crc_ok(view, pos, header):
            raise CorruptBatch("batch CRC mismatch", position=pos, base_offset=header.base_offset)
        yield header, view[pos + BATCH_HEADER_SIZE:end]
        pos = end


def stored_range(blob: bytes | memoryview) -> tuple[int, int] | None:
    """The offsets [first, end) that a fetch reply's batches hold, from their
    headers alone (no CRC, no payload decoding); None for an empty frame.

    A client that fetched ahead uses it to know which offsets it already has.
    The payloads are checked when they are decoded.
    """
    view = memoryview(blob)
    n = len(view)
    if n == 0:
        return None
    first = parse_batch_header(view, 0).base_offset
    pos = 0
    while True:
        header = parse_batch_header(view, pos)
        end = pos + header.total_size
        if end > n:
            raise CorruptBatch("batch runs past the end of the frame", position=pos)
        if end == n:
            return first, header.next_offset
        pos = end


_first = itemgetter(0)


def _uniform_records(payload: memoryview, record_count: int, lo: int, hi: int, make: type, base: int,
                     source: tuple) -> list | None:
    """Records lo .. hi of a uniform batch that shares one timestamp, read off its bytes;
    None for any other batch (`_unpacked_records` then decodes it).

    A batch from `encode_values` (equal-sized values, one timestamp) is every
    record's value at a fixed stride: `struct.iter_unpack` slices them out in C,
    and each record is built from a `zip` of the shared parts, so the records are
    the only objects made per record. Decoding with msgpack makes a tuple per
    record and the record from it, which is also more for the garbage collector
    to count (bench/PROFILE.md, sixth pass).
    """
    layout = uniform_layout(payload)
    if layout is None:
        return None
    if layout.count != record_count:
        raise CorruptBatch("record count does not match header", base_offset=base)
    stride, key_at = layout.stride, layout.key_at
    body = payload[layout.start:]
    if record_count == 1:
        # One record shares its timestamp with itself: no strided checks, no iter_unpack.
        # A producer spread over many partitions sends one-record batches (1,024
        # partitions, window 1,000), and these steps were 10 of the 17 µs of decoding one.
        if lo >= hi:
            return []
        value_start = layout.value_start
        return [tuple.__new__(make, (msgpack.unpackb(body[1:key_at]), None,
                                     body[value_start:value_start + layout.value_length].tobytes(), None,
                                     base, source))]
    for i in range(1, key_at):  # each byte of the timestamp, alike in every record
        if body[i::stride] != bytes((body[i],)) * record_count:
            return None
    if lo >= hi:
        return []
    timestamp = msgpack.unpackb(body[1:key_at])
    values = map(_first, struct.iter_unpack(f"{layout.value_start}x{layout.value_length}s1x",
                                            body[lo * stride:hi * stride]))
    return list(map(tuple.__new__, repeat(make), zip(repeat(timestamp), repeat(None), values, repeat(None),
                                                      count(base + lo), repeat(source))))


def _unpacked_records(payload: memoryview, record_count: int, lo: int, hi: int, make: type, base: int,
                      source: tuple) -> list:
    """Records lo .. hi of any batch, decoded with msgpack; CorruptBatch if it is not a
    msgpack array of ``record_count`` four-item arrays."""
    try:
        records = msgpack.unpackb(payload, raw=False, use_list=False, ext_hook=_reject_ext)
    except Exception as exc:
        raise CorruptBatch(f"stored payload is not valid msgpack: {exc}", base_offset=base) from exc
    if not isinstance(records, tuple) or len(records) != record_count:
        raise CorruptBatch("record count does not match header", base_offset=base)
    try:
        lengths_ok = set(map(len, records)) == {4}
    except TypeError:  # a number, nil or bool where a record should be
        lengths_ok = False
    if not lengths_ok:
        raise CorruptBatch("stored record is not [timestamp_ms, key, value, headers]", base_offset=base)
    if lo or hi < len(records):
        records = records[lo:hi]
    # One tuple.__new__ per record from (stored record + (offset, source)), all in C:
    # no bytecode runs per record. Concatenating is also the type check: a stored
    # record that is a bin, str or map of length 4 instead of an array cannot be added
    # to a tuple.
    try:
        return list(map(tuple.__new__, repeat(make), map(add, records, zip(count(base + lo), repeat(source)))))
    except TypeError:
        raise CorruptBatch("stored record is not [timestamp_ms, key, value, headers]", base_offset=base) from None


def decode_fetched(blob: bytes | memoryview, topic: str, partition: int, *, from_offset: int = 0,
                   until_offset: int | None = None, verify_crc: bool = True,
                   make: type[Record] = Record, extra: tuple = ()) -> list:
    """Decode a fetch reply's batches into records with offsets in [from_offset, until_offset).

    ``make`` is `Record` or a subclass whose extra fields come from ``extra``
    (the consumer's lease, attempt and reason).
    """
    out: list = []
    source = (topic, partition, *extra)
    view = memoryview(blob)
    pos, n = 0, len(view)
    while pos < n:
        header = parse_batch_header(view, pos)
        start, pos = pos, pos + header.total_size
        if pos > n:
            raise CorruptBatch("batch runs past the end of the frame", position=start)
        base = header.base_offset
        if until_offset is not None and base >= until_offset:
            break
        if header.next_offset <= from_offset:
            continue  # before the window: skipped on its header, its CRC is checked when decoded
        if verify_crc and not batch_crc_ok(view, start, header):
            raise CorruptBatch("batch CRC mismatch", position=start, base_offset=base)
        payload = view[start + BATCH_HEADER_SIZE:pos]
        lo = from_offset - base if from_offset > base else 0
        hi = header.record_count if until_offset is None else min(header.record_count, until_offset - base)
        records = _uniform_records(payload, header.record_count, lo, hi, make, base, source)
        if records is None:
            records = _unpacked_records(payload, header.record_count, lo, hi, make, base, source)
        if out:
            out += records
        else:
            out = records  # the usual fetch is one batch: no copy
    return out


# -- key hashes (key_shared groups) ----------------------------------------------------

# The hash of a record without a key. A keyed record's hash is never this value, so a
# keyless record is never ordered behind a keyed one (docs/SEMANTICS.md, key_shared).
NO_KEY_HASH = 0


def key_hash(key: bytes | None) -> int:
    """The 32-bit hash that orders a record in a `key_shared` group: CRC-32 of the key
    bytes (0 maps to 0xFFFFFFFF), NO_KEY_HASH for no key. Two keys that collide are
    only ordered as one key, which is safe; 32 bits keep the coordinator's column at
    four bytes a record."""
    if key is None:
        return NO_KEY_HASH
    return zlib.crc32(key) or 0xFFFFFFFF


def key_hashes(blob: bytes | memoryview, from_offset: int) -> tuple[int, list[int]]:
    """The key hashes of the records a fetch reply holds from `from_offset` on:
    (offset of the first hash, hashes of consecutive offsets). An empty frame gives
    (from_offset, [])."""
    records = decode_fetched(blob, "", 0, from_offset=from_offset)
    if not records:
        return from_offset, []
    first = records[0].offset
    # Offsets within a partition's reply are consecutive; a gap would be a corrupt log.
    if records[-1].offset - first != len(records) - 1:
        raise CorruptBatch("fetched offsets are not consecutive", first=first)
    return first, [key_hash(r[1]) for r in records]
