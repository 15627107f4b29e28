"""Client logic that does no I/O, shared by the sync and the asyncio clients.

* `MetadataCache`: topic -> partition -> endpoint, refreshed on NOT_OWNER,
  UNAVAILABLE or a timeout.
* `BatchAccumulator`: records gathered per partition into payloads, with the
  idempotent producer's per-partition sequence numbers. A batch keeps its
  (producer_id, sequence) across retries, so a retry after a timeout lands once.
* `AckAccumulator`: per-record acks folded into ``[topic, partition, lease,
  start, end]`` ranges, flushed every N records or M milliseconds, so a
  consumer acking each record individually sends one frame per thousand.
* `ConsumedRecord`: a record plus the lease it was delivered under.
* `ReadAhead`: record bytes fetched before their lease arrives (exclusive
  groups), so the fetch round trip leaves the consumer's critical path.
* `Deduper`: a TTL set of message ids, for handlers that must not act twice
  on a redelivered record.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any, Container, Iterable

from zbroker.protocol.batch import Record, encode_columns, encode_values, stored_range
from zbroker.protocol.codec import MAX_FRAME_BYTES
from zbroker.protocol.errors import StaleLease, TooLarge, UnknownPartition, UnknownTopic
from zbroker.protocol.partitioner import partition_for_key


class ConsumedRecord(Record):
    """A record with the lease under which this consumer holds it: its source is
    ``(topic, partition, lease_id, attempt, reason)``, shared by the delivery's records."""

    __slots__ = ()
    _fields = Record._fields + ("lease_id", "attempt", "reason")

    @property
    def lease_id(self) -> int:
        return self[5][2]

    @property
    def attempt(self) -> int:
        return self[5][3]

    @property
    def reason(self) -> str:
        return self[5][4]

    @property
    def lease(self) -> list:
        topic, partition, lease_id = self[5][:3]
        return [topic, partition, lease_id, self[4], self[4] + 1]


class MetadataCache:
    def __init__(self) -> None:
        self.topics: dict[str, list[dict]] = {}

    def update(self, topics: list[dict]) -> None:
        for t in topics:
            self.topics[t["name"]] = t["partitions"]

    def partitions(self, topic: str) -> int:
        parts = self.topics.get(topic)
        if parts is None:
            raise UnknownTopic(f"unknown topic {topic!r}", topic=topic)
        return len(parts)

    def endpoint(self, topic: str, partition: int) -> str | None:
        parts = self.topics.get(topic)
        if parts is None:
            raise UnknownTopic(f"unknown topic {topic!r}", topic=topic)
        if not 0 <= partition < len(parts):
            raise UnknownPartition(f"{topic!r} has no partition {partition}", topic=topic, partition=partition,
                                   partitions=len(parts))
        return parts[partition].get("endpoint")

    def forget(self, topic: str) -> None:
        self.topics.pop(topic, None)

    def redirect(self, topic: str, partition: int, endpoint: str) -> None:
        """A NOT_LEADER/NOT_OWNER error named the partition's leader: send there next."""
        parts = self.topics.get(topic)
        if parts is not None and 0 <= partition < len(parts):
            parts[partition] = {**parts[partition], "endpoint": endpoint}

    def endpoints(self, assignment: Iterable) -> list[str]:
        """The actors' endpoints for ``assignment`` ([topic, partition] pairs), where known."""
        found = set()
        for topic, partition in assignment:
            parts = self.topics.get(topic)
            if parts is not None and 0 <= partition < len(parts) and parts[partition].get("endpoint"):
                found.add(parts[partition]["endpoint"])
        return sorted(found)


class PendingBatch:
    """A payload on its way to one partition; keeps its sequence across retries."""

    __slots__ = ("topic", "partition", "payload", "count", "producer_id", "sequence", "attempts", "outcome")

    def __init__(self, topic: str, partition: int, payload: bytes, count: int, producer_id: int, sequence: int,
                 outcome: "BatchOutcome | None") -> None:
        self.topic = topic
        self.partition = partition
        self.payload = payload
        self.count = count
        self.producer_id = producer_id
        self.sequence = sequence
        self.attempts = 0
        self.outcome = outcome  # what its records' handles read; None when nobody holds one (send_many)

    def acknowledged(self, base_offset: int) -> None:
        if self.outcome is not None:
            self.outcome.base_offset = base_offset

    def failed(self, error: Exception) -> None:
        if self.outcome is not None:
            self.outcome.error = error

    def over_frame_limit(self) -> TooLarge | None:
        """The error for a payload no actor can receive, else None. An actor's socket drops a
        frame over MAX_FRAME_BYTES without a reply: sent anyway, it would time out, and be
        sent again at every retry, before failing as a TIMEOUT that hides the cause."""
        if len(self.payload) <= MAX_FRAME_BYTES:
            return None
        return TooLarge(f"batch of {len(self.payload):,} bytes exceeds the {MAX_FRAME_BYTES:,} bytes a frame may carry",
                        limit=MAX_FRAME_BYTES, got=len(self.payload), topic=self.topic, partition=self.partition)


# The protocol's sequences are signed 32-bit (docs/PROTOCOL.md, section 13): a
# partition whose producer id has numbered this many batches moves to a new id.
MAX_SEQUENCE = (1 << 31) - 1


def new_producer_id() -> int:
    """A random, non-zero 63-bit id (randomness keeps producers apart; nothing registers them)."""
    return random.getrandbits(62) | 1


def record_size_estimate(value: bytes, key: bytes | None, headers: dict | None) -> int:
    """About what a record adds to a batch payload, so that ``batch_bytes`` bounds the
    payload however large its keys and headers are (the broker refuses a payload over
    its max_batch_bytes: every record in it would fail)."""
    size = len(value) + 16
    if key is not None:
        size += len(key)
    if headers:
        size += sum(len(k) + len(v) + 4 for k, v in headers.items())
    return size


_BYTES_LIKE = (bytes, bytearray, memoryview)


def checked_record(value: Any, key: Any, headers: Any) -> tuple[bytes, bytes | None, dict | None]:
    """``(value, key, headers)`` as a batch holds them, or TypeError naming what is wrong.

    Checked when the record is sent, not when its batch is encoded: a wrong type
    found then would fail the whole batch, every other record in it with it.
    """
    if type(value) is not bytes:
        if not isinstance(value, _BYTES_LIKE):
            raise TypeError(f"a record's value must be bytes, not {type(value).__name__}")
        value = bytes(value)
    if key is not None and type(key) is not bytes:
        if not isinstance(key, _BYTES_LIKE):
            raise TypeError(f"a record's key must be bytes or None, not {type(key).__name__}")
        key = bytes(key)
    if headers is not None:
        if not isinstance(headers, dict):
            raise TypeError(f"a record's headers must be a dict of str to bytes, not {type(headers).__name__}")
        for name, item in headers.items():
            if not isinstance(name, str) or not isinstance(item, _BYTES_LIKE):
                raise TypeError("a record's headers must be a dict of str to bytes, "
                                f"not {type(name).__name__} to {type(item).__name__}")
        headers = {name: bytes(item) for name, item in headers.items()} if headers else None
    return value, key, headers


def checked_partition(partition: Any) -> int:
    """An explicit partition: a non-negative int, else TypeError or ValueError from the send
    (one the topic does not have is UNKNOWN_PARTITION, from the metadata)."""
    if type(partition) is not int:
        raise TypeError(f"a record's partition must be an int or None, not {type(partition).__name__}")
    if partition < 0:
        raise ValueError(f"a record's partition must be >= 0, not {partition}")
    return partition


def checked_topics(topics: Any) -> list[str]:
    """A consumer's topics: a list (or other iterable) of names. A lone str would be read as
    its letters, each a topic of its own."""
    if isinstance(topics, (str, bytes)):
        raise TypeError(f"topics must be a list of topic names, not a {type(topics).__name__}: "
                        f"did you mean topics=[{topics!r}]?")
    names = list(topics)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"a topic name must be a str, not {type(name).__name__}")
    return names


def checked_timestamp(timestamp_ms: Any) -> int:
    """A record's explicit timestamp: an int that msgpack packs (-2**63 .. 2**64 - 1),
    else TypeError or ValueError from the send, for the reason `checked_record` gives."""
    if type(timestamp_ms) is not int:
        raise TypeError(f"a record's timestamp_ms must be an int, not {type(timestamp_ms).__name__}")
    if not -(1 << 63) <= timestamp_ms < 1 << 64:
        raise ValueError(f"a record's timestamp_ms must fit in 64 bits, not {timestamp_ms}")
    return timestamp_ms


class BatchOutcome:
    """What became of one batch: set once, when it is acknowledged or fails for good.

    Its records' handles read it, so settling a batch is one assignment, not one per record.
    """

    __slots__ = ("topic", "partition", "base_offset", "error")

    def __init__(self, topic: str, partition: int) -> None:
        self.topic = topic
        self.partition = partition
        self.base_offset: int | None = None
        self.error: Exception | None = None


class DeliveryHandle:
    """The record's offset once its batch is acknowledged, or the error it failed with."""

    # Two slots: a producer makes one per record sent (bench/PROFILE.md, tenth pass).
    __slots__ = ("_outcome", "_index")

    def __init__(self, outcome: BatchOutcome, index: int) -> None:
        self._outcome = outcome
        self._index = index  # the record's place in its batch

    @property
    def topic(self) -> str:
        return self._outcome.topic

    @property
    def partition(self) -> int:
        return self._outcome.partition

    @property
    def offset(self) -> int | None:
        base = self._outcome.base_offset
        return None if base is None else base + self._index

    @property
    def error(self) -> Exception | None:
        return self._outcome.error

    @property
    def done(self) -> bool:
        return self._outcome.base_offset is not None or self._outcome.error is not None

    def __repr__(self) -> str:
        return f"DeliveryHandle({self.topic}/{self.partition}@{self.offset}, error={self.error!r})"


class OpenBatch:
    """The records of one partition gathered so far, and when the first came.

    Kept as columns, so that the usual record (no key, no headers, the same
    millisecond as the one before) costs one append: ``values`` in order;
    ``stamps`` the runs of equal timestamps, ``(first index, timestamp_ms)``;
    ``extras`` ``{index: (key, headers)}`` for the records that have either
    (`protocol.batch.encode_columns` packs them).
    """

    __slots__ = ("values", "stamps", "last_stamp", "extras", "outcome", "size", "opened_at")

    def __init__(self, topic: str, partition: int, opened_at: float) -> None:
        self.values: list[bytes] = []
        self.stamps: list[tuple[int, int]] = []
        self.last_stamp: int | None = None
        self.extras: dict[int, tuple[bytes | None, dict | None]] = {}
        self.outcome = BatchOutcome(topic, partition)
        self.size = 0  # estimated payload bytes (record_size_estimate)
        self.opened_at = opened_at

    def stamp(self, timestamp_ms: int) -> None:
        """Start a run of ``timestamp_ms`` at the record appended last."""
        self.stamps.append((len(self.values) - 1, timestamp_ms))
        self.last_stamp = timestamp_ms


class BatchAccumulator:
    def __init__(self, *, batch_size: int, batch_bytes: int, producer_id: int | None = None) -> None:
        self.batch_size = batch_size
        self.batch_bytes = batch_bytes
        self.producer_id = producer_id if producer_id is not None else new_producer_id()
        # Partitions whose sequences ran out under `producer_id` continue under a new id.
        self._producer_ids: dict[tuple[str, int], int] = {}
        # One entry per partition with records waiting: a send costs one lookup.
        self._open: dict[tuple[str, int], OpenBatch] = {}
        self._sequences: dict[tuple[str, int], int] = {}
        # Key-less records go round-robin one *batch* at a time: they stick to a
        # partition until its batch closes, so batches stay full.
        self._sticky: dict[str, list[int]] = {}  # topic -> [partition, partition count]
        # topic -> the open batch of its sticky partition, where a key-less record
        # goes now: the producer's fast path appends to it without choosing a partition.
        self.keyless_open: dict[str, OpenBatch] = {}

    def choose_partition(self, topic: str, partitions: int, key: bytes | None) -> int:
        if key is not None:
            return partition_for_key(key, partitions)
        sticky = self._sticky.get(topic)
        if sticky is None or sticky[1] != partitions:
            sticky = self._sticky[topic] = [random.randrange(partitions), partitions]
            self._track_sticky(topic)
        return sticky[0]

    def _rotate(self, topic: str, partition: int) -> None:
        sticky = self._sticky.get(topic)
        if sticky is not None and sticky[0] == partition:
            sticky[0] = (partition + 1) % sticky[1]
            self._track_sticky(topic)

    def _track_sticky(self, topic: str) -> None:
        """Point `keyless_open` at the open batch of the topic's sticky partition, if it has one."""
        batch = self._open.get((topic, self._sticky[topic][0]))
        if batch is None:
            self.keyless_open.pop(topic, None)
        else:
            self.keyless_open[topic] = batch

    def add(self, topic: str, partition: int, record: list, size: int, now: float
            ) -> tuple[DeliveryHandle, PendingBatch | None]:
        """Add one record ``[timestamp_ms, key, value, headers]`` (checked by `checked_record`):
        its handle, and the batch closed now, if one was.

        A batch closes when it holds ``batch_size`` records or ``batch_bytes``, and
        before a record that would take it past ``batch_bytes``: that record starts
        the next batch, so a record too large for the broker fails alone instead of
        with the records that happened to share its batch."""
        key = (topic, partition)
        batch = self._open.get(key)
        if batch is not None and batch.size + size > self.batch_bytes:
            closed = self.close(key)
            batch = self._open[key] = OpenBatch(topic, partition, now)
            sticky = self._sticky.get(topic)
            if sticky is not None and sticky[0] == partition:
                self.keyless_open[topic] = batch
            return self._append(batch, record, size), closed
        if batch is None:
            batch = self._open[key] = OpenBatch(topic, partition, now)
            sticky = self._sticky.get(topic)
            if sticky is not None and sticky[0] == partition:
                self.keyless_open[topic] = batch
        handle = self._append(batch, record, size)
        if len(batch.values) >= self.batch_size or batch.size >= self.batch_bytes:
            return handle, self.close(key)
        return handle, None

    @staticmethod
    def _append(batch: OpenBatch, record: list, size: int) -> DeliveryHandle:
        stamp, record_key, value, headers = record
        values = batch.values
        handle = DeliveryHandle(batch.outcome, len(values))
        values.append(value)
        if stamp != batch.last_stamp:
            batch.stamp(stamp)
        if record_key is not None or headers:
            batch.extras[len(values) - 1] = (record_key, headers or None)
        batch.size += size
        return handle

    def add_keyless(self, topic: str, value: bytes, timestamp_ms: int) -> tuple[DeliveryHandle, PendingBatch | None] | None:
        """Add a key-less, header-less ``bytes`` value to the open batch of the topic's
        sticky partition: its handle and the batch it filled, if it did; None when that
        partition has no open batch, or the value would take it past ``batch_bytes``
        (then `choose_partition` and `add` take the record).

        The synchronous `Producer.send` does the same inline, one call less per record."""
        batch = self.keyless_open.get(topic)
        if batch is None or batch.size + len(value) + 16 > self.batch_bytes:
            return None  # `add` starts the next batch with a record that would overflow this one
        values = batch.values
        index = len(values)
        values.append(value)
        if timestamp_ms != batch.last_stamp:
            batch.stamp(timestamp_ms)
        batch.size += len(value) + 16
        handle = DeliveryHandle(batch.outcome, index)
        if index + 1 >= self.batch_size or batch.size >= self.batch_bytes:
            return handle, self.close((topic, batch.outcome.partition))
        return handle, None

    def add_many_values(self, topic: str, partition: int, values: list[bytes], timestamp_ms: int) -> list[PendingBatch]:
        """Key-less, header-less values in full batches (``batch_size`` records and
        about ``batch_bytes`` at most each), encoded by the `encode_values` fast path.
        A batch that `add` holds open for the partition goes first: its records were
        sent first, and a partition keeps the order records were sent in."""
        out, start, n = [], 0, len(values)
        if (topic, partition) in self._open:
            out.append(self.close((topic, partition)))
        # Per-record overhead in the payload: array header, timestamp, nils, bin header.
        budget = self.batch_bytes
        while start < n:
            end = min(n, start + self.batch_size)
            size = sum(map(len, values[start:end])) + 18 * (end - start)
            while size > budget and end - start > 1:  # halve until it fits (rare: large values)
                end = start + (end - start) // 2
                size = sum(map(len, values[start:end])) + 18 * (end - start)
            chunk = values[start:end]
            producer_id, seq = self._next_sequence(topic, partition)
            out.append(PendingBatch(topic, partition, encode_values(chunk, timestamp_ms), len(chunk), producer_id,
                                    seq, None))
            start = end
        return out

    def close(self, key: tuple[str, int]) -> PendingBatch:
        batch = self._open.pop(key)
        topic, partition = key
        if self.keyless_open.get(topic) is batch:
            del self.keyless_open[topic]
        self._rotate(topic, partition)
        producer_id, seq = self._next_sequence(topic, partition)
        return PendingBatch(topic, partition, encode_columns(batch.values, batch.stamps, batch.extras),
                            len(batch.values), producer_id, seq, batch.outcome)

    def _next_sequence(self, topic: str, partition: int) -> tuple[int, int]:
        """The (producer_id, sequence) of the partition's next batch."""
        key = (topic, partition)
        seq = self._sequences.get(key, 0)
        if seq > MAX_SEQUENCE:
            # Batches already numbered keep their id and sequence for their retries.
            self._producer_ids[key] = new_producer_id()
            seq = 0
        self._sequences[key] = seq + 1
        return self._producer_ids.get(key, self.producer_id), seq

    def oldest_opened_at(self) -> float | None:
        """When the longest-waiting open batch got its first record (None: nothing buffered)."""
        return next(iter(self._open.values())).opened_at if self._open else None  # opened first (see `due`)

    def due(self, now: float, linger_s: float) -> list[PendingBatch]:
        """Batches whose first record has waited at least the linger time."""
        # The same float form as Producer.linger_deadline(), so a deadline reached is a batch sent.
        # `_open` is in the order the batches were opened (a closed one leaves it, a new one
        # goes last): the due ones are a prefix. Scanning every open batch cost 1,024 steps
        # per linger at 1,024 partitions.
        keys = []
        for k, b in self._open.items():
            if b.opened_at + linger_s > now:
                break
            keys.append(k)
        return [self.close(k) for k in keys]

    def drain(self) -> list[PendingBatch]:
        return [self.close(k) for k in list(self._open)]

    def buffered_records(self) -> int:
        return sum(len(b.values) for b in self._open.values())


class AckAccumulator:
    """Folds individual acks into ranges: consecutive offsets of one lease merge.

    The common case, the next offset of the range acked last, touches only
    ``_tail``; the dict finds the open range of any other lease.
    """

    def __init__(self) -> None:
        self._ranges: list[list] = []
        self._last: dict[tuple[str, int, int], list] = {}
        self._tail: list | None = None
        self.count = 0

    def add(self, topic: str, partition: int, lease_id: int, offset: int) -> None:
        self.count += 1
        tail = self._tail
        if (tail is not None and tail[4] == offset and tail[2] == lease_id and tail[1] == partition
                and tail[0] == topic):
            tail[4] = offset + 1
            return
        key = (topic, partition, lease_id)
        last = self._last.get(key)
        if last is not None and last[4] == offset:
            last[4] = offset + 1
            self._tail = last
            return
        rng = [topic, partition, lease_id, offset, offset + 1]
        self._ranges.append(rng)
        self._last[key] = rng
        self._tail = rng

    def add_range(self, item: list) -> None:
        self.count += item[4] - item[3]
        self._ranges.append(list(item))
        self._tail = None

    def take(self) -> list[list]:
        ranges, self._ranges = self._ranges, []
        self._last.clear()
        self._tail = None
        self.count = 0
        return ranges

    def __bool__(self) -> bool:
        return bool(self._ranges)


class _AheadSlot:
    __slots__ = ("next", "chunks", "in_flight", "fetch_bytes", "patience", "due")

    def __init__(self, next_offset: int, fetch_bytes: int) -> None:
        self.next = next_offset  # where this partition's next fresh lease should start
        self.chunks: list[tuple[int, int, Any]] = []  # (first, end, frame), in offset order
        # (correlation id of the reply awaited, offset it starts at, id of the fetch's last
        # possible reply): a fetch that follows the log end gets a reply per append, the
        # nth with the fetch's id + n, and stays out until one says it has no `more`.
        self.in_flight: tuple[int, int, int] | None = None
        self.fetch_bytes = fetch_bytes
        # How long a live actor may take to send the fetch's next reply (its wait plus the
        # request timeout), and when that runs out (None: no limit). A fetch parked at an
        # actor that died (kill -9) gets no reply at all, and nothing else would end it.
        self.patience: float | None = None
        self.due: float | None = None


class ReadAhead:
    """Record bytes fetched before the lease that will cover them, per partition.

    In an exclusive group the coordinator leases a partition's fresh records in
    offset order to its one owner, so the owner's next lease starts where its
    last one ended. The consumer fetches from there while it waits for the
    coordinator, or while the application handles the batch it already has:
    the fetch round trip leaves the critical path, and a parked fetch brings a
    new record from the partition actor at the same time as the coordinator
    learns of it, instead of one more round trip after the lease.

    It leases nothing. Bytes are handed to the application only under a lease
    the coordinator granted, and an offset names the same record for the life
    of a log, so a wrong guess costs a fetch, never a duplicate or a loss.
    Memory is bounded by ``max_bytes`` over all partitions (the frames held
    plus the fetches out) and by ``ahead_bytes`` per partition beyond its
    next lease. Pure: the consumer does the I/O and reports what came back.
    """

    def __init__(self, *, max_bytes: int = 32 << 20, ahead_bytes: int = 2 << 20,
                 fetch_bytes: int = 1 << 20) -> None:
        self.max_bytes = max_bytes
        self.ahead_bytes = ahead_bytes
        self.default_fetch_bytes = fetch_bytes
        self._slots: dict[tuple[str, int], _AheadSlot] = {}
        self.stats = {"served": 0, "fetches": 0}

    def leased(self, key: tuple[str, int], start: int, end: int) -> None:
        """A lease [start, end) was delivered: the next fresh one starts at ``end`` or later."""
        slot = self._slots.get(key)
        if slot is None:
            self._slots[key] = _AheadSlot(end, self.default_fetch_bytes)
        elif end > slot.next:
            slot.next = end

    def covering(self, key: tuple[str, int], offset: int) -> Any:
        """A held frame with the record at ``offset`` (and maybe more after it), or None."""
        slot = self._slots.get(key)
        if slot is not None:
            for first, end, frame in slot.chunks:
                if first <= offset < end:
                    self.stats["served"] += 1
                    return frame
        return None

    def awaited(self, key: tuple[str, int], offset: int) -> int | None:
        """The fetch out that may bring ``offset`` (it asked for ``offset`` or earlier)."""
        slot = self._slots.get(key)
        if slot is None or slot.in_flight is None or slot.in_flight[1] > offset:
            return None
        return slot.in_flight[0]

    def arrived(self, key: tuple[str, int], corr: int, frame: Any, more: bool = False,
                now: float | None = None) -> int | None:
        """The reply ``corr`` came back with ``frame`` (None: it failed; b"": nothing new yet).
        With ``more`` the fetch stays out; returns the id of its next reply, if one is awaited
        (due, if ``sent`` gave a patience, within it of ``now``)."""
        slot = self._slots.get(key)
        if slot is None or slot.in_flight is None or slot.in_flight[0] != corr:
            return None
        _corr, offset, last = slot.in_flight
        slot.in_flight = None
        if frame is None:
            del self._slots[key]  # the partition moved or failed: start over from the next lease
            return None
        span = stored_range(frame)
        if span is not None and span[1] > slot.next:
            slot.chunks.append((span[0], span[1], frame))
            if len(slot.chunks) > 1 and slot.chunks[-2][0] > span[0]:
                slot.chunks.sort(key=lambda c: c[0])
        if more and corr < last:
            slot.in_flight = (corr + 1, offset if span is None else max(offset, span[1]), last)
            # A followed fetch's wait runs again from each reply (PROTOCOL.md, fetch).
            slot.due = None if slot.patience is None or now is None else now + slot.patience
            return corr + 1
        return None

    def wanted(self) -> list[tuple[tuple[str, int], int, int]]:
        """Fetches to send now: (partition key, offset, max_bytes). Drops frames behind every lease."""
        held = 0
        for slot in self._slots.values():
            kept = [c for c in slot.chunks if c[1] > slot.next]
            slot.chunks = kept
            held += sum(len(c[2]) for c in kept)
            if slot.in_flight is not None:
                held += slot.fetch_bytes
        out = []
        for key, slot in self._slots.items():
            if slot.in_flight is not None:
                continue
            offset = max([slot.next] + [c[1] for c in slot.chunks])
            buffered = sum(len(c[2]) for c in slot.chunks)
            if buffered >= self.ahead_bytes or held + slot.fetch_bytes > self.max_bytes:
                continue
            held += slot.fetch_bytes
            out.append((key, offset, slot.fetch_bytes))
        return out

    def in_flight(self) -> list[tuple[tuple[str, int], int]]:
        """(partition key, correlation id) of every fetch out."""
        return [(key, slot.in_flight[0]) for key, slot in self._slots.items() if slot.in_flight is not None]

    def overtaken(self, key: tuple[str, int], arrived: Container[int]) -> bool:
        """A later reply of the fetch out for ``key`` has arrived and the awaited one has not:
        the actor dropped it (replies of one fetch come in order). Every later id of the
        fetch is looked at: a full queue at the actor drops a run of replies, not one."""
        slot = self._slots.get(key)
        if slot is None or slot.in_flight is None:
            return False
        corr, _offset, last = slot.in_flight
        return corr not in arrived and any(c in arrived for c in range(corr + 1, last + 1))

    def sent(self, key: tuple[str, int], corr: int, offset: int, follow: int = 0,
             patience: float | None = None, now: float = 0.0) -> None:
        """A fetch went out; with ``patience``, each of its replies is due within that long
        (of ``now``, then of the reply before it), else `overdue` names it."""
        slot = self._slots.get(key)
        if slot is not None:
            slot.in_flight = (corr, offset, corr + follow)
            slot.patience = patience
            slot.due = None if patience is None else now + patience
            self.stats["fetches"] += 1

    def overdue(self, now: float) -> list[tuple[str, int]]:
        """Partitions whose fetch out is past its due time: its actor died or hangs."""
        return [key for key, slot in self._slots.items()
                if slot.in_flight is not None and slot.due is not None and slot.due <= now]

    def drop(self, key: tuple[str, int]) -> list[tuple[int, int]]:
        """Forget a partition; returns the ids its fetch may still get replies under, as
        [(first, last)] (none if no fetch is out): a followed fetch reserved a range."""
        slot = self._slots.pop(key, None)
        if slot is None or slot.in_flight is None:
            return []
        corr, _offset, last = slot.in_flight
        return [(corr, last)]

    def retain(self, keys: Iterable[tuple[str, int]]) -> list[tuple[int, int]]:
        """Keep only ``keys`` (the partitions still assigned); returns the orphaned id ranges."""
        keep = set(keys)
        return [r for k in [k for k in self._slots if k not in keep] for r in self.drop(k)]

    def clear(self) -> list[tuple[int, int]]:
        return self.retain(())

    def held_bytes(self) -> int:
        return sum(len(c[2]) for slot in self._slots.values() for c in slot.chunks)


# Ranges per ack/nack/extend/reject request. A range naming a 200-character topic
# takes about 235 bytes, so 4000 of them stay under the 1 MiB header limit, whose
# TOO_LARGE reply has no id to match (PROTOCOL.md s.6): larger sets go in several requests.
RANGES_PER_REQUEST = 4000


def in_request_sized_chunks(ranges: list) -> list[list]:
    return [ranges[i:i + RANGES_PER_REQUEST] for i in range(0, len(ranges), RANGES_PER_REQUEST)] or [[]]


class ChunkedSettle:
    """The outcome of one nack/extend/reject sent as several requests (`in_request_sized_chunks`).

    The coordinator applies the valid ranges of each request and answers STALE_LEASE
    when any of its ranges is stale; every chunk must still go, and the caller gets
    what one request would have said: the records applied, or one STALE_LEASE with
    everything stale in all of them.
    """

    def __init__(self) -> None:
        self.applied = 0
        self.stale: list = []
        self.stale_omitted = 0
        self.data: dict = {}

    def replied(self, msg: Any) -> None:
        self.applied += msg.applied

    def refused(self, err: StaleLease) -> None:
        data = dict(err.data)
        self.applied += int(data.pop("applied", 0))
        self.stale += data.pop("stale", [])
        self.stale_omitted += int(data.pop("stale_omitted", 0))
        self.data.update(data)  # group, member_id, deadline_in_ms: alike in every chunk

    def outcome(self) -> int:
        if not self.stale and not self.stale_omitted:
            return self.applied
        extra = {"stale_omitted": self.stale_omitted} if self.stale_omitted else {}
        raise StaleLease(f"{len(self.stale) + self.stale_omitted} range(s) are not leased under the given lease id; "
                         f"nothing was applied to them", **self.data, stale=self.stale, applied=self.applied, **extra)


def group_by_lease(records: Iterable[ConsumedRecord]) -> list[list]:
    acc = AckAccumulator()
    for r in sorted(records, key=lambda r: (r.topic, r.partition, r.lease_id, r.offset)):
        acc.add(r.topic, r.partition, r.lease_id, r.offset)
    return acc.take()


class Deduper:
    """Remembers message ids for ``ttl_s`` (bounded by ``max_entries``).

    ``first_time(id, now)`` is True the first time an id is seen within the TTL,
    so a handler can skip the side effect of a redelivered record. Time is
    passed in, as everywhere in zbroker's decision code.
    """

    def __init__(self, ttl_s: float = 600.0, max_entries: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._seen: OrderedDict[Any, float] = OrderedDict()

    def first_time(self, message_id: Any, now: float) -> bool:
        self._expire(now)
        if message_id in self._seen:
            return False
        self._seen[message_id] = now + self.ttl_s
        if len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)
        return True

    def _expire(self, now: float) -> None:
        while self._seen:
            oldest_id, expires = next(iter(self._seen.items()))
            if expires > now:
                break
            self._seen.popitem(last=False)

    def __len__(self) -> int:
        return len(self._seen)


def record_id(record: Record) -> tuple:
    """The natural message id: where the record lives. Use a header for app-level ids."""
    return (record.topic, record.partition, record.offset)
