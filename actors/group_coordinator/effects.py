"""What the group coordinator core asks its shell to do.

Every entry point of `GroupCoordinatorCore` returns a list of these plain
values; the shell performs them in order. None of them is a request *to* the
core: results come back through the core's `on_*` methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zbroker.protocol.errors import ZBrokerError
from zbroker.protocol.messages import Message


@dataclass(frozen=True, slots=True)
class Reply:
    """Send `msg` as the reply to the request identified by `token`."""
    token: Any
    msg: Message


@dataclass(frozen=True, slots=True)
class ReplyError:
    """Answer the request identified by `token` with an error reply."""
    token: Any
    error: ZBrokerError


@dataclass(frozen=True, slots=True)
class PersistOffsets:
    """Hand the newest progress of one (group, topic, partition) to the commit writer.

    `holes` are the finished (acked or dead-lettered) ranges above `committed`,
    lowest first, at most the core's `max_persisted_holes`. The writer replies
    with what became durable; the shell passes that to `core.on_durable`.
    A higher `reset_epoch` must override a higher `committed` (see reset_group).
    `quarantine` lists the keys parked there, [[key_hash, failures, reason], ...]
    (key_order.MAX_PARKED_KEYS at most), persisted with the holes.
    """
    group: str
    topic: str
    partition: int
    committed: int
    holes: list[list[int]] = field(hash=False)
    generation: int
    reset_epoch: int
    quarantine: list = field(default_factory=list, hash=False)

    def as_advance(self) -> list:
        """The element of an `Advance` message (protocol.messages.Advance): seven fields, and
        the quarantine as an eighth only when there is one."""
        row = [self.group, self.topic, self.partition, self.committed, [list(h) for h in self.holes],
               self.generation, self.reset_epoch]
        if self.quarantine:
            row.append(self.quarantine)
        return row


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """Copy record `offset` of topic/partition to `dlq_topic`, then give this effect
    back to `core.on_dead_letter_done` (or `on_dead_letter_failed`).

    With `drop_value` the copy carries no value, only a `zb-dlq-value-dropped` header
    with its size (and, if even that is too large, neither the original headers nor the
    key): the full copy was refused TOO_LARGE."""
    group: str
    topic: str
    partition: int
    offset: int
    dlq_topic: str
    attempts: int
    last_reason: str
    dead_lettering_id: int  # which dead-lettering of the offset this copy is for
    drop_value: bool = False


@dataclass(frozen=True, slots=True)
class FetchKeyHashes:
    """Learn the key hashes of topic/partition from offset `start` on (key_shared groups):
    fetch its stored batches, hash them with `protocol.batch.key_hashes`, and give the
    result to `core.on_key_hashes` (None for a failed fetch). At most one is under way
    per group and partition."""
    group: str
    topic: str
    partition: int
    start: int


@dataclass(frozen=True, slots=True)
class PersistGroupConfig:
    """Store a group's configuration; give it back through `core.restore_group_config`.
    `config` None: the group was deleted, forget its configuration."""
    group: str
    config: dict | None = field(hash=False)


@dataclass(frozen=True, slots=True)
class Log:
    """A state change worth a log line. `fields` is structured context."""
    event: str
    fields: dict = field(hash=False)
