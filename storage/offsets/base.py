"""The offset store: where a consumer group's progress becomes durable.

Theory of operation
-------------------
One row per (group_id, topic, partition) holds ``committed_offset`` (the next
offset to deliver), the ack holes above it (acked ranges ``[start, end)``),
the group generation and the reset epoch. The commit writer is the only
regular writer; it sends whole batches through `OffsetStore.upsert`, which is
one statement in one transaction whatever the batch size.

Every write goes through the *monotonic guard*, inside the statement itself
so that no interleaving of writers can move an offset backwards::

    apply  if  new.reset_epoch >  cur.reset_epoch
           or (new.reset_epoch == cur.reset_epoch and new.committed_offset >= cur.committed_offset)

An equal offset is applied so that holes (and the generation) can change
while the offset stands still. A ``groups reset`` bumps the reset epoch,
which is the only way to move an offset down; an advance still carrying the
old epoch arrives late and is then ignored. `winner` is the same rule in
Python, used to fold duplicate keys of one batch (a single ``INSERT … ON
CONFLICT`` may not touch a row twice) and by the commit writer to coalesce.

Backends live beside this module (`sqlite`, `postgres`) and import it; this
module imports neither. `urls.open_offset_store` picks one from a URL. Both
are tested by one contract suite (tests/offsets/test_store_contract.py).
"""

from __future__ import annotations

import abc
import dataclasses
import importlib.resources
import json
from typing import Iterable

import structlog

from zbroker.protocol.errors import ErrorCode, ZBrokerError
from zbroker.storage.offsets.metadata import LeaseState, Metadata, MetadataChanges

log = structlog.get_logger("zbroker.offsets")

TABLE = "consumer_group_offsets"
MIGRATIONS_TABLE = "zbroker_schema_migrations"

class OffsetStoreError(ZBrokerError):
    """The offset store failed. Retriable: the database may come back.

    ``data`` carries ``backend``, ``operation`` and, where known, ``cause``
    (the exception class) and ``sqlstate``.
    """

    code = ErrorCode.UNAVAILABLE


@dataclasses.dataclass(slots=True)
class OffsetRow:
    """One durable position: what the coordinator sends and what it reloads."""

    group_id: str
    topic: str
    partition: int
    committed_offset: int
    holes: list[tuple[int, int]]
    generation: int
    reset_epoch: int
    # Parked keys (issue 28): [[key_hash, failures, reason], ...]; [] for none.
    quarantine: list = dataclasses.field(default_factory=list)

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.group_id, self.topic, self.partition)

    def to_wire(self) -> list:
        """A LoadOffsetsReply row: [group, topic, partition, committed, holes, generation, reset_epoch],
        and the quarantine as an eighth element when there is one."""
        row = [self.group_id, self.topic, self.partition, self.committed_offset,
               [[s, e] for s, e in self.holes], self.generation, self.reset_epoch]
        if self.quarantine:
            row.append(self.quarantine)
        return row

    def quarantine_or_none(self) -> list | None:
        """The quarantine column's value: NULL for none, as rows written before it."""
        return self.quarantine or None


_MAX_INT64 = (1 << 63) - 1


def stored_holes(text: str, key: tuple[str, str, int]) -> list[tuple[int, int]]:
    """The holes column as `upsert` writes it: JSON ``[[start, end], ...]``, ascending, not overlapping.

    Anything else can only have been written by hand. It is read as no holes, with a
    warning: the offsets in them are then delivered again, which at-least-once allows.
    Refused, the row would fail every load of the offsets, and with it every group,
    for good; passed on, a reversed or overlapping range would corrupt the
    coordinator's ranges.
    """
    try:
        holes, last_end = [], None
        for start, end in json.loads(text):
            if not (type(start) is int and type(end) is int and 0 <= start < end <= _MAX_INT64
                    and (last_end is None or start >= last_end)):
                raise ValueError("not ascending, non-overlapping [start, end) ranges of offsets")
            holes.append((start, end))
            last_end = end
        return holes
    except (ValueError, TypeError) as exc:  # JSONDecodeError is a ValueError
        log.warning("offsets.holes_unreadable", group=key[0], topic=key[1], partition=key[2],
                    holes=str(text)[:200], reason=str(exc),
                    consequence="read as no holes: the acked offsets above the committed one are delivered again")
        return []


MAX_STORED_QUARANTINE = 1000


def stored_quarantine(text: str | None, key: tuple[str, str, int]) -> list:
    """The quarantine column as `upsert` writes it: NULL, or JSON ``[[key_hash, failures, reason], ...]``.

    Anything else is read as no quarantine, with a warning, for the reason
    `stored_holes` gives: those keys' records are then delivered again.
    """
    if text is None:
        return []
    try:
        rows = json.loads(text)
        if not (type(rows) is list and len(rows) <= MAX_STORED_QUARANTINE and all(
                type(r) is list and len(r) == 3 and type(r[0]) is int and 0 < r[0] < 1 << 32
                and type(r[1]) is int and r[1] >= 0 and type(r[2]) is str for r in rows)):
            raise ValueError(f"not a list of at most {MAX_STORED_QUARANTINE} [key_hash, failures, reason]")
        return rows
    except (ValueError, TypeError) as exc:
        log.warning("offsets.quarantine_unreadable", group=key[0], topic=key[1], partition=key[2],
                    quarantine=str(text)[:200], reason=str(exc),
                    consequence="read as no quarantine: the parked keys' records are delivered again")
        return []


def winner(current: OffsetRow, new: OffsetRow) -> OffsetRow:
    """The monotonic guard in Python: the row that an upsert of `new` over `current` leaves."""
    if new.reset_epoch > current.reset_epoch:
        return new
    if new.reset_epoch == current.reset_epoch and new.committed_offset >= current.committed_offset:
        return new
    return current


def fold(rows: Iterable[OffsetRow]) -> list[OffsetRow]:
    """Reduce a batch to one row per key, as if its rows were applied in order.

    Sorted by key so that two writers (an old and a new writer process that
    briefly overlap) lock rows in the same order and cannot deadlock.
    """
    by_key: dict[tuple[str, str, int], OffsetRow] = {}
    for row in rows:
        key = row.key
        cur = by_key.get(key)
        by_key[key] = row if cur is None else winner(cur, row)
    return [by_key[k] for k in sorted(by_key)]


class OffsetStore(abc.ABC):
    """One connection's worth of offset storage. Not safe across event loops.

    Every method raises `OffsetStoreError` (never a driver exception), so the
    commit writer has one thing to catch. A store reconnects by itself on the
    next call after a failure; `connect` only makes the first attempt eager.
    """

    backend: str
    schema: str | None

    @abc.abstractmethod
    async def connect(self) -> None:
        """Open the connection (idempotent)."""

    @abc.abstractmethod
    async def migrate(self) -> list[int]:
        """Apply pending migrations; return the versions applied now (empty when up to date)."""

    @abc.abstractmethod
    async def upsert(self, rows: Iterable[OffsetRow], coordinator_epoch: int | None = None) -> int:
        """Write `rows` through the monotonic guard in ONE statement; return rows changed.

        With a `coordinator_epoch`, the same statement first checks that it is still the
        coordinator lease's current epoch and writes nothing otherwise, raising
        `StaleEpoch` (data: ``epoch`` = the current one or None, ``got``). None writes
        unfenced, as a single-node broker always has.
        """

    @abc.abstractmethod
    async def load_metadata(self) -> Metadata:
        """Every topic and partition state (storage.offsets.metadata), read in one snapshot."""

    @abc.abstractmethod
    async def write_metadata(self, changes: MetadataChanges, coordinator_epoch: int) -> bool:
        """Apply `changes` in ONE transaction if every condition holds; else write nothing, return False.

        Conditions: `coordinator_epoch` is the lease's current epoch; each created topic
        is new; each updated or deleted topic exists with that incarnation; each
        partition update finds its `expected_leader_epoch` stored (None: no row yet, and
        its topic exists).
        """

    @abc.abstractmethod
    async def acquire_or_renew_lease(self, node_id: str, endpoint: str, lease_ms: int) -> LeaseState:
        """Take the coordinator lease if free or expired (the epoch grows by one), renew it if
        `node_id` holds it and it has not expired (the epoch stays), else report who holds it.

        Expiry is judged by the database's clock only.
        """

    @abc.abstractmethod
    async def load_page(self, after: tuple[str, str, int] | None, limit: int) -> list[OffsetRow]:
        """Up to `limit` rows whose key comes after `after` (from the first when None), in key order.

        A keyset query on the primary key: each page costs its own rows, so loading N
        rows in pages reads N rows, not N^2/limit. The order is the database's own
        (its collation); callers only pass back the last key of the previous page.
        """

    async def load_all(self, page_rows: int = 10_000) -> list[OffsetRow]:
        """Every row, in key order."""
        rows: list[OffsetRow] = []
        after = None
        while True:
            page = await self.load_page(after, page_rows)
            rows += page
            if len(page) < page_rows:
                return rows
            after = page[-1].key

    @abc.abstractmethod
    async def ping(self) -> None:
        """One round trip, to tell whether the database answers."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the connection (idempotent)."""

    def statistics(self) -> dict[str, int]:
        """Counters kept by the store itself (statements sent, reconnects)."""
        return {}

    async def __aenter__(self) -> "OffsetStore":
        await self.connect()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()


@dataclasses.dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str  # with "{schema}" standing for the quoted schema name


def load_migrations(backend: str) -> list[Migration]:
    """The versioned migrations of one backend: ``migrations/NNNN_name.<backend>.sql``.

    Each file must be idempotent on its own (IF NOT EXISTS) as well: the
    version table makes reapplying rare, the SQL makes it harmless.
    """
    out = []
    folder = importlib.resources.files("zbroker.storage.offsets").joinpath("migrations")
    suffix = f".{backend}.sql"
    for entry in folder.iterdir():
        if not entry.name.endswith(suffix):
            continue
        stem = entry.name[: -len(suffix)]
        version, _, name = stem.partition("_")
        out.append(Migration(int(version), name, entry.read_text(encoding="utf-8")))
    out.sort(key=lambda mig: mig.version)
    if len({mig.version for mig in out}) != len(out):
        raise ZBrokerError("two migrations share a version", backend=backend)
    return out
