"""Errors with stable wire codes.

Every error that crosses a socket is a `ZBrokerError`: a stable `code` (the
string on the wire, never renamed), a human `message`, a `retriable` flag that
tells a client whether the same request may succeed later, and `data`, a map of
facts (topic, partition, generation, ...) so that callers never parse messages.
"""

from __future__ import annotations

import enum
from typing import Any


class ErrorCode(str, enum.Enum):
    """Stable error codes. The value is what travels on the wire."""

    BAD_REQUEST = "BAD_REQUEST"
    UNSUPPORTED_VERSION = "UNSUPPORTED_VERSION"
    UNKNOWN_OP = "UNKNOWN_OP"
    UNKNOWN_TOPIC = "UNKNOWN_TOPIC"
    UNKNOWN_PARTITION = "UNKNOWN_PARTITION"
    TOPIC_EXISTS = "TOPIC_EXISTS"
    TOO_LARGE = "TOO_LARGE"
    NOT_OWNER = "NOT_OWNER"
    FENCED = "FENCED"
    UNKNOWN_MEMBER = "UNKNOWN_MEMBER"
    STALE_LEASE = "STALE_LEASE"
    OFFSET_OUT_OF_RANGE = "OFFSET_OUT_OF_RANGE"
    DUPLICATE_SEQUENCE = "DUPLICATE_SEQUENCE"
    CORRUPT_BATCH = "CORRUPT_BATCH"
    UNKNOWN_GROUP = "UNKNOWN_GROUP"
    UNAUTHORIZED = "UNAUTHORIZED"
    UNAVAILABLE = "UNAVAILABLE"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    TIMEOUT = "TIMEOUT"
    INTERNAL = "INTERNAL"
    # Replication and clustering (hello's `features` says which an actor sends).
    NOT_LEADER = "NOT_LEADER"
    NOT_ENOUGH_REPLICAS = "NOT_ENOUGH_REPLICAS"
    STALE_EPOCH = "STALE_EPOCH"
    NOT_COORDINATOR = "NOT_COORDINATOR"
    # Admin operations (PROTOCOL.md s.7).
    GROUP_NOT_EMPTY = "GROUP_NOT_EMPTY"
    INVALID_PARTITIONS = "INVALID_PARTITIONS"
    TOPIC_IN_USE = "TOPIC_IN_USE"


# Whether a client may retry the same request unchanged and expect it to work
# once the broker has recovered or metadata has been refreshed.
RETRIABLE: dict[ErrorCode, bool] = {
    ErrorCode.BAD_REQUEST: False,
    ErrorCode.UNSUPPORTED_VERSION: False,
    ErrorCode.UNKNOWN_OP: False,
    ErrorCode.UNKNOWN_TOPIC: False,
    ErrorCode.UNKNOWN_PARTITION: False,
    ErrorCode.TOPIC_EXISTS: False,
    ErrorCode.TOO_LARGE: False,
    ErrorCode.NOT_OWNER: True,
    ErrorCode.FENCED: True,
    ErrorCode.UNKNOWN_MEMBER: True,
    ErrorCode.STALE_LEASE: False,
    ErrorCode.OFFSET_OUT_OF_RANGE: False,
    ErrorCode.DUPLICATE_SEQUENCE: False,
    ErrorCode.CORRUPT_BATCH: False,
    ErrorCode.UNKNOWN_GROUP: False,
    ErrorCode.UNAUTHORIZED: False,
    ErrorCode.UNAVAILABLE: True,
    ErrorCode.SHUTTING_DOWN: True,
    ErrorCode.TIMEOUT: True,
    ErrorCode.INTERNAL: False,
    # Another replica leads the partition now: refresh metadata (data.leader is a hint).
    ErrorCode.NOT_LEADER: True,
    # Fewer in-sync replicas (or, for create_topic, fewer qualifying actors) than
    # required: retriable because replicas catch up and actors register.
    ErrorCode.NOT_ENOUGH_REPLICAS: True,
    # The sender's leader or coordinator epoch is older than the receiver's: the
    # sender was replaced and must not retry; it learns the new state instead.
    ErrorCode.STALE_EPOCH: False,
    # This node's coordinator stands by: follow data.leader, or try the next node.
    ErrorCode.NOT_COORDINATOR: True,
    # delete_group of a group with live members: retrying is right only once they
    # have left, which the operator decides; a loop would delete it under a restart.
    ErrorCode.GROUP_NOT_EMPTY: False,
    # alter_topic asked for fewer partitions than exist (partitions only grow).
    ErrorCode.INVALID_PARTITIONS: False,
    # delete_topic of a topic some group's live members consume: as GROUP_NOT_EMPTY, the
    # operator stops them first; retrying in a loop would delete it under them.
    ErrorCode.TOPIC_IN_USE: False,
}


class ZBrokerError(Exception):
    """Root of every zbroker error, local or received from a peer."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, code: ErrorCode | None = None, **data: Any) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.data: dict[str, Any] = data

    @property
    def retriable(self) -> bool:
        return RETRIABLE.get(self.code, False)

    def to_wire(self) -> dict[str, Any]:
        return {
            "code": self.code.value,
            "message": self.message,
            "retriable": self.retriable,
            "data": self.data,
        }

    @classmethod
    def from_wire(cls, error: Any) -> "ZBrokerError":
        """Rebuild the most specific error class from an error map off the wire."""
        if not isinstance(error, dict):
            return ProtocolError(f"malformed error reply: {error!r:.200}")
        raw_code = error.get("code")
        message = str(error.get("message", ""))
        data = error.get("data") if isinstance(error.get("data"), dict) else {}
        try:
            code = ErrorCode(raw_code)
        except ValueError:
            return ZBrokerError(f"{raw_code}: {message}", code=ErrorCode.INTERNAL, wire_code=raw_code, **data)
        err_cls = _BY_CODE.get(code, ZBrokerError)
        err = err_cls.__new__(err_cls)
        ZBrokerError.__init__(err, message, code=code, **data)
        return err

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code.value}, message={self.message!r}, data={self.data!r})"


class ProtocolError(ZBrokerError):
    """A peer sent something that is not a valid frame. Never crashes an actor."""

    code = ErrorCode.BAD_REQUEST


class UnsupportedVersion(ProtocolError):
    code = ErrorCode.UNSUPPORTED_VERSION


class UnknownOp(ProtocolError):
    code = ErrorCode.UNKNOWN_OP


class TooLarge(ZBrokerError):
    code = ErrorCode.TOO_LARGE


class UnknownTopic(ZBrokerError):
    code = ErrorCode.UNKNOWN_TOPIC


class UnknownPartition(ZBrokerError):
    code = ErrorCode.UNKNOWN_PARTITION


class TopicExists(ZBrokerError):
    code = ErrorCode.TOPIC_EXISTS


class NotOwner(ZBrokerError):
    code = ErrorCode.NOT_OWNER


class Fenced(ZBrokerError):
    code = ErrorCode.FENCED


class UnknownMember(ZBrokerError):
    code = ErrorCode.UNKNOWN_MEMBER


class StaleLease(ZBrokerError):
    code = ErrorCode.STALE_LEASE


class OffsetOutOfRange(ZBrokerError):
    code = ErrorCode.OFFSET_OUT_OF_RANGE


class DuplicateSequence(ZBrokerError):
    code = ErrorCode.DUPLICATE_SEQUENCE


class CorruptBatch(ProtocolError):
    code = ErrorCode.CORRUPT_BATCH


class UnknownGroup(ZBrokerError):
    code = ErrorCode.UNKNOWN_GROUP


class Unauthorized(ZBrokerError):
    code = ErrorCode.UNAUTHORIZED


class Unavailable(ZBrokerError):
    code = ErrorCode.UNAVAILABLE


class ShuttingDown(ZBrokerError):
    code = ErrorCode.SHUTTING_DOWN


class RequestTimeout(ZBrokerError):
    code = ErrorCode.TIMEOUT


class NotLeader(ZBrokerError):
    code = ErrorCode.NOT_LEADER


class NotEnoughReplicas(ZBrokerError):
    code = ErrorCode.NOT_ENOUGH_REPLICAS


class StaleEpoch(ZBrokerError):
    code = ErrorCode.STALE_EPOCH


class NotCoordinator(ZBrokerError):
    code = ErrorCode.NOT_COORDINATOR


class GroupNotEmpty(ZBrokerError):
    code = ErrorCode.GROUP_NOT_EMPTY


class InvalidPartitions(ZBrokerError):
    code = ErrorCode.INVALID_PARTITIONS


class TopicInUse(ZBrokerError):
    code = ErrorCode.TOPIC_IN_USE


_BY_CODE: dict[ErrorCode, type[ZBrokerError]] = {
    cls.code: cls
    for cls in (
        ProtocolError, UnsupportedVersion, UnknownOp, TooLarge, UnknownTopic, UnknownPartition,
        TopicExists, NotOwner, Fenced, UnknownMember, StaleLease, OffsetOutOfRange,
        DuplicateSequence, CorruptBatch, UnknownGroup, Unauthorized, Unavailable, ShuttingDown,
        RequestTimeout, NotLeader, NotEnoughReplicas, StaleEpoch, NotCoordinator, GroupNotEmpty,
        InvalidPartitions, TopicInUse,
    )
}
