"""The one rule the decoders must keep, as plain functions both fuzzers call.

Any bytes in: a value out, or `ProtocolError` (frames) / `CorruptBatch` (stored
batches, a `ProtocolError` subclass). Nothing else may escape. An error a
decoder raises must also turn into an error reply that a client can decode:
that is how an actor answers the frame.
"""

from __future__ import annotations

import struct
import zlib

import msgpack

from zbroker.protocol import codec
from zbroker.protocol.batch import (BATCH_HEADER_SIZE, CorruptBatch, build_batch_header, decode_fetched,
                            iter_stored_batches, payload_record_count, validate_payload)
from zbroker.protocol.errors import ProtocolError


def _readable_id(frame: bytes) -> int | None:
    """The id a client reading the header map as msgpack would see, ext values and
    bytes after the map notwithstanding (None: there is none to echo)."""
    if len(frame) > codec.MAX_HEADER_BYTES:
        return None
    try:
        header = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except msgpack.ExtraData as extra:
        header = extra.unpacked
    except Exception:
        return None
    corr_id = header.get("id") if isinstance(header, dict) else None
    return corr_id if type(corr_id) is int and 0 <= corr_id < 1 << 64 else None


def check_request(frames: list[bytes]) -> None:
    try:
        env = codec.decode_request(frames)
    except ProtocolError as exc:
        reply = codec.encode_error(exc.op, exc.corr_id, exc)
        back = codec.decode_reply(reply)  # the actor's error reply is itself valid
        assert back.error is not None and back.error.code == exc.code
        if frames:  # a client matching replies by id sees the error whenever its id was readable
            assert back.corr_id == _readable_id(bytes(frames[0])), (back.corr_id, back.error)
        return
    assert isinstance(env.op, str) and env.msg is not None
    assert env.frames == list(frames[1:])


def check_reply(frames: list[bytes]) -> None:
    try:
        env = codec.decode_reply(frames)
    except ProtocolError:
        return
    assert (env.msg is None) != (env.error is None)


def check_any(frames: list[bytes]) -> None:
    try:
        codec.decode_any(frames)
    except ProtocolError:
        pass


def check_stored(blob: bytes, verify_crc: bool = True) -> None:
    try:
        for header, payload in iter_stored_batches(blob, verify_crc=verify_crc):
            assert header.record_count >= 1 and len(payload) == header.payload_length
    except CorruptBatch:
        pass
    try:
        records = decode_fetched(blob, "t", 0, from_offset=0, verify_crc=verify_crc)
    except CorruptBatch:
        return
    assert isinstance(records, list)


def check_payload(payload: bytes) -> None:
    for fn in (payload_record_count, validate_payload):
        try:
            count = fn(payload)
        except CorruptBatch:
            continue
        assert isinstance(count, int) and count >= 1


def stored(payload: bytes, *, base: int = 0, count: int = 1, seq: int = -1, pid: int = 0) -> bytes:
    """A stored batch with a correct CRC around any payload: reaches the record decoder."""
    return build_batch_header(payload, base_offset=base, record_count=count, append_time_ms=1,
                              producer_id=pid, producer_seq=seq) + payload


def recrc(blob: bytes) -> bytes:
    """Fix the CRC of the first batch after a mutation, so the mutation is not caught by it."""
    if len(blob) < BATCH_HEADER_SIZE:
        return blob
    length = struct.unpack_from(">I", blob, 8)[0]
    end = min(len(blob), BATCH_HEADER_SIZE + length)
    crc = zlib.crc32(blob[BATCH_HEADER_SIZE:end], zlib.crc32(blob[8:BATCH_HEADER_SIZE]))
    return blob[:4] + crc.to_bytes(4, "big") + blob[8:]
