"""Frame codec: the only place where zbroker frames are packed and unpacked.

A message is a ZeroMQ multipart message. Frame 0 is a msgpack map, the
*header*; any further frames are opaque payloads (a produce batch, fetched
batches). Requests carry ``v`` (protocol version), ``op`` and ``id`` (a
correlation id chosen by the sender, echoed in the reply) beside their
fields. Replies carry ``v``, ``op``, ``id`` and ``ok``; an error reply has
``ok: false`` and an ``error`` map instead of fields.

Decoding never raises anything but `ProtocolError` (or a subclass) for what
a peer sent, so a shell can turn every failure into an error reply. The
exception carries ``corr_id`` and ``op`` when they could be read, so the error
reply can still be matched to its request: a header that is a map is read for
them even when it is refused for what else it holds (an ext value, bytes after
the map), because a client matching replies by id would otherwise wait for a
reply that never comes. Those rare cases are read a second time, off the fast
path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import msgpack

from zbroker.protocol import messages as m
from zbroker.protocol.errors import ProtocolError, TooLarge, UnknownOp, UnsupportedVersion, ZBrokerError

MAX_HEADER_BYTES = 1 << 20
MAX_FRAMES = 4
# The largest frame an actor's socket accepts (ZMQ_MAXMSGSIZE applies per frame).
# libzmq drops a bigger one before it costs memory, and closes that connection:
# the request gets no reply at all (PROTOCOL.md, section 6).
MAX_FRAME_BYTES = 64 << 20

_packer = msgpack.Packer(use_bin_type=True)


@dataclass(slots=True)
class Envelope:
    """A decoded request or reply."""

    op: str
    corr_id: Any
    msg: m.Message | None = None
    error: ZBrokerError | None = None
    frames: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def is_tell(self) -> bool:
        return self.op in m.TELLS


class _ExtFound(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


def _reject_ext(code: int, data: bytes) -> None:
    raise ProtocolError("msgpack ext types are not allowed", ext_code=code)


def _stop_at_ext(code: int, data: bytes) -> None:
    raise _ExtFound(code)


def _keep_ext(code: int, data: bytes) -> msgpack.ExtType:
    return msgpack.ExtType(code, b"")


def _readable_id_and_op(header: Any) -> tuple[Any, Any]:
    """The id and op of a header refused for something else, where they can be read."""
    if not isinstance(header, dict):
        return None, None
    corr_id, op = header.get("id"), header.get("op")
    return (corr_id if _valid_id(corr_id) else None), op


def _unpack_header(frame: bytes | memoryview) -> dict:
    if len(frame) > MAX_HEADER_BYTES:
        raise TooLarge("header frame too large", limit=MAX_HEADER_BYTES, got=len(frame))
    try:
        header = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True,
                                 ext_hook=_stop_at_ext)
    except _ExtFound as found:
        try:  # again, keeping ext values, to read the id and op beside them
            kept = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True, ext_hook=_keep_ext)
        except msgpack.ExtraData as extra:
            kept = extra.unpacked
        except Exception:
            kept = None
        raise _fail(ProtocolError("msgpack ext types are not allowed", ext_code=found.code),
                    *_readable_id_and_op(kept)) from None
    except msgpack.ExtraData as extra:
        corr_id, op = _readable_id_and_op(extra.unpacked)
        raise _fail(ProtocolError("bytes follow the header map", trailing_bytes=len(extra.extra)),
                    corr_id, op) from None
    except Exception as exc:  # FormatError, StackError, ValueError, UnicodeDecodeError...
        raise ProtocolError(f"header is not a valid msgpack map: {type(exc).__name__}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header must be a msgpack map", expected="map", got=m.family(header))
    return header


def _fail(exc: ProtocolError, corr_id: Any, op: Any) -> ProtocolError:
    exc.corr_id = corr_id if _valid_id(corr_id) else None
    exc.op = op if isinstance(op, str) and len(op) <= 64 else None
    return exc


def _valid_id(corr_id: Any) -> bool:
    return corr_id is None or (isinstance(corr_id, int) and not isinstance(corr_id, bool)
                               and 0 <= corr_id < 1 << 64)


def _check_envelope(frames: Sequence[bytes], *, reply: bool = False) -> tuple[dict, Any, Any]:
    if not frames:
        raise _fail(ProtocolError("empty message"), None, None)
    try:
        header = _unpack_header(frames[0])
    except ProtocolError as exc:
        if not hasattr(exc, "corr_id"):
            exc = _fail(exc, None, None)
        raise exc
    except TooLarge as exc:
        err = ProtocolError(exc.message, **exc.data)
        err.code = exc.code
        raise _fail(err, None, None)
    corr_id = header.get("id")
    op = header.get("op")
    if not _valid_id(corr_id):
        raise _fail(ProtocolError("'id' must be an unsigned 64-bit integer or nil", field="id",
                                  expected="uint64 | nil", got=m.family(corr_id)), None, op)
    if len(frames) > MAX_FRAMES:
        # Checked after the header so that the error reply carries the request's id.
        raise _fail(ProtocolError("too many frames", limit=MAX_FRAMES, got=len(frames)), corr_id, op)
    version = header.get("v")
    if not isinstance(version, int) or isinstance(version, bool) or version not in m.SUPPORTED_VERSIONS:
        raise _fail(UnsupportedVersion(f"protocol version {version!r:.40} is not supported",
                                       supported=list(m.SUPPORTED_VERSIONS)), corr_id, op)
    # An error reply to a request that could not be read carries a nil op.
    if not isinstance(op, str) and not (reply and op is None and header.get("ok") is False):
        got = {"got": m.family(op)} if "op" in header else {}  # a missing key has no `got`
        raise _fail(ProtocolError("'op' must be a string", field="op", expected="str", **got), corr_id, None)
    if not reply and ("ok" in header or "error" in header):
        # The key that tells a reply from a request on a two-way socket: a request that
        # carries it would be read as a reply there, so it is refused everywhere.
        raise _fail(ProtocolError("a request carries no 'ok' or 'error'",
                                  field="ok" if "ok" in header else "error"), corr_id, op)
    return header, corr_id, op


# -- requests ---------------------------------------------------------------------------

def encode_request(msg: m.Message, corr_id: int | None, frames: Sequence[bytes] = ()) -> list:
    header = msg.to_fields()
    header["v"] = m.PROTOCOL_VERSION
    header["op"] = msg.op
    header["id"] = corr_id
    return [_packer.pack(header), *frames]


def decode_request(frames: Sequence[bytes]) -> Envelope:
    header, corr_id, op = _check_envelope(frames)
    cls = m.REQUESTS.get(op)
    if cls is None:
        raise _fail(UnknownOp(f"unknown op {op!r:.64}", op=op[:64]), corr_id, op)
    try:
        msg = m.build(cls, header)
    except ProtocolError as exc:
        raise _fail(exc, corr_id, op)
    return Envelope(op, corr_id, msg=msg, frames=list(frames[1:]))


# -- replies ----------------------------------------------------------------------------

def encode_reply(msg: m.Message, corr_id: Any, frames: Sequence[bytes] = ()) -> list:
    """The reply's frames; a header over MAX_HEADER_BYTES becomes a TOO_LARGE error.

    The receiver would drop such a header unread, and then could not even tell which
    request it answered: the error names the request and says how large the reply was.
    """
    header = msg.to_fields()
    header["v"] = m.PROTOCOL_VERSION
    header["op"] = msg.op
    header["id"] = corr_id
    header["ok"] = True
    packed = _packer.pack(header)
    if len(packed) > MAX_HEADER_BYTES:
        return encode_error(msg.op, corr_id, TooLarge(
            f"the {msg.op} reply would be {len(packed)} bytes, over the {MAX_HEADER_BYTES}-byte header limit",
            limit=MAX_HEADER_BYTES, got=len(packed)))
    return [packed, *frames]


def encode_error(op: str | None, corr_id: Any, error: ZBrokerError) -> list:
    return [_packer.pack({"v": m.PROTOCOL_VERSION, "op": op, "id": corr_id, "ok": False,
                          "error": error.to_wire()})]


def decode_reply(frames: Sequence[bytes]) -> Envelope:
    header, corr_id, op = _check_envelope(frames, reply=True)
    ok = header.get("ok")
    if ok is False:
        return Envelope(op, corr_id, error=ZBrokerError.from_wire(header.get("error")))
    if ok is not True:
        raise _fail(ProtocolError("reply must carry 'ok'"), corr_id, op)
    cls = m.REPLIES.get(op)
    if cls is None:
        raise _fail(UnknownOp(f"unknown reply op {op!r:.64}"), corr_id, op)
    try:
        msg = m.build(cls, header)
    except ProtocolError as exc:
        raise _fail(exc, corr_id, op)
    return Envelope(op, corr_id, msg=msg, frames=list(frames[1:]))


def decode_any(frames: Sequence[bytes]) -> tuple[bool, Envelope]:
    """Decode a request or a reply, for sockets that carry both directions.

    Returns ``(is_reply, envelope)``. Replies are told apart by their ``ok`` key.
    """
    header_is_reply = False
    if frames and len(frames[0]) <= MAX_HEADER_BYTES:
        try:
            header = msgpack.unpackb(frames[0], raw=False, strict_map_key=True, ext_hook=_reject_ext)
            header_is_reply = isinstance(header, dict) and "ok" in header
        except Exception:
            header_is_reply = False
    if header_is_reply:
        return True, decode_reply(frames)
    return False, decode_request(frames)


def pack_value(value: Any) -> bytes:
    """Pack a plain value (used for JSON-like files such as topic metadata snapshots)."""
    return _packer.pack(value)


def unpack_value(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_reject_ext)
    except Exception as exc:
        raise ProtocolError(f"not valid msgpack: {type(exc).__name__}") from None
