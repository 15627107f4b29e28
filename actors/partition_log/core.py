"""Partition-log actor core: decisions for the topic-partitions one process owns.

Theory of operation
-------------------
The coordinator tells this actor which partitions it owns (`on_assign`). For
each owned partition the core holds a `PartitionLog` (storage/log), opened
through an injected `open_log` callable so that tests can hand it a log on a
temporary directory; the core itself touches no socket and reads no clock.

clocks
    Every deadline here (waiting fetches, the fsync interval, open retries,
    the once-a-second registration, report pacing) is on ``now_ms``, the
    shell's monotonic clock, the same one the coordinator and the commit
    writer run on: a wall clock stepped back by NTP would otherwise hold the
    registration back past the coordinator's 5 s dead-actor timeout. The wall
    clock is passed separately as ``wall_ms`` and used only where a time is
    stored: a batch's append time, a recovery report, and retention by time
    (which compares those stored times). A caller driving one hand clock may
    omit ``wall_ms``; it then equals ``now_ms``.

produce
    Checked in this order: ownership (NOT_OWNER, retriable: the client
    refreshes metadata), size (TOO_LARGE), payload shape (every record is
    checked in C-level passes; the payload is stored as it arrived, never
    re-encoded),
    idempotence (a retried (producer_id, sequence) gets its original offsets
    back with ``duplicate=True``), then the append. With ``fsync=always`` the
    reply is held until `end_turn`, which fsyncs every log written in this
    loop turn once: group commit across all the produce requests the shell
    drained in that turn.
fetch
    Reads whole stored batches from the batch holding ``offset``. A fetch at
    the log end with ``max_wait_ms`` is parked and answered by the next
    append to that partition, or empty at its deadline. With
    ``fsync=always`` no fetch reply carries records before their fsync: one
    answered in a turn that appended to its partition waits for `end_turn`.
    A fetch with ``follow`` that caught up is parked again after each reply,
    so a consumer at the log end gets every append without fetching again;
    the shell sends its nth reply with the request's id + n (`Reply.nth`).
many partitions in one request
    `produce_many` and `fetch_many` carry several partitions of this actor
    in one message. Each part of a produce_many goes through `produce` under
    a `_PartToken`; its reply (now, after end_turn's fsync, or once a
    replicated partition's high watermark covers it) is gathered, and the
    request's one reply leaves when its last part is settled (`_gathered`,
    applied to what every public method returns). A part's refusal is an
    error inside the reply, never the request's. A fetch_many reads each
    part as `fetch` would and never waits.
opening a log
    A log is fsynced whole when it is opened (unless ``fsync=never``): the
    previous owner may have died between a write and its fsync.
reports
    The coordinator must learn log ends quickly (consumers long-poll on it),
    so every turn that appended produces a report of the changed partitions,
    and every second a full report doubles as a heartbeat.
replicated partitions
    A partition that `assign` lists in ``replicas`` gets a `Replica`
    (replica.py) beside its log. As leader: produce is checked by it
    (NOT_LEADER, NOT_ENOUGH_REPLICAS) and its reply held until the high
    watermark covers the batch; consumer fetches see and are told only what
    is below the HW; `replica_fetch` is served (long-polled like a fetch,
    the waiting ones answered at `end_turn`: once for all of a turn's
    appends); the HW is reported as log_end. As follower: produce and fetch get
    NOT_LEADER, and the core emits `SendToLeader` fetches whose replies
    (`on_replica_fetch_reply`) it applies to the log, fsynced before the next
    fetch reports them under ``--fsync always``. A partition without replica
    state takes exactly the path above: the produce and fetch paths test
    ``self.replicas`` (an empty dict) once per request, nothing per record.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import heapq
import itertools
from typing import Any, Callable, Iterable

import structlog

from zbroker.protocol import messages as m
from zbroker.protocol.batch import stored_range, validate_payload
from zbroker.actors.partition_log.replica import (DEFAULT_REPLICA_LAG_MS, Acknowledge, ProposeIsr, Refuse, Replica,
                                                 ReplicaState, WaitingFetch)
from zbroker.protocol.batch import parse_batch_header
from zbroker.protocol.errors import (NotOwner, OffsetOutOfRange, ProtocolError, StaleEpoch, TooLarge, Unauthorized,
                                     UnknownOp, ZBrokerError)
from zbroker.storage.log.partition_log import LogConfig, PartitionLog

log = structlog.get_logger("zbroker.partition")

REPORT_INTERVAL_MS = 1000
# Log-end reports go out at most this often. A quiet partition's first append is
# reported at once; under a stream of appends, one report covers a millisecond of
# them instead of one per loop turn (at one record per request that was one
# coordinator wake-up per record: bench/PROFILE.md).
REPORT_PACE_MS = 1
# Why an assigned partition is not open, when the actor is short of descriptors.
NO_FILES_LEFT = "out of file descriptors: raise the open-file limit (ulimit -n)"
RETENTION_CHECK_MS = 30_000
RETRY_OPEN_MS = 1000
# Registrations go out every second and are answered within milliseconds.
REGISTRATION_UNANSWERED_WARN_MS = 5000
# Fetches waiting at the log end, across all partitions; one more answers the oldest (empty).
MAX_PARKED_FETCHES = 4096


@dataclasses.dataclass(frozen=True)
class FsyncPolicy:
    """``always`` | ``interval:MS`` | ``never``."""

    mode: str = "interval"
    interval_ms: int = 1000

    @classmethod
    def parse(cls, text: str) -> "FsyncPolicy":
        text = text.strip().lower()
        if text in ("always", "never"):
            return cls(mode=text, interval_ms=0)
        if text.startswith("interval:"):
            try:
                ms = int(text.split(":", 1)[1])
            except ValueError:
                ms = -1
            if ms > 0:
                return cls(mode="interval", interval_ms=ms)
        raise ValueError(f"--fsync must be 'always', 'never' or 'interval:MS' (MS > 0), not {text!r}")

    def __str__(self) -> str:
        return f"interval:{self.interval_ms}" if self.mode == "interval" else self.mode


@dataclasses.dataclass(frozen=True)
class Limits:
    max_batch_bytes: int = 8 << 20
    max_fetch_bytes: int = 4 << 20

    def to_dict(self) -> dict:
        from zbroker.protocol.codec import MAX_HEADER_BYTES
        return {"max_batch_bytes": self.max_batch_bytes, "max_fetch_bytes": self.max_fetch_bytes,
                "max_header_bytes": MAX_HEADER_BYTES}


# -- effects -------------------------------------------------------------------------------

# `nth` is 0 for the one reply of a request. A fetch that follows the log end gets
# further replies (PROTOCOL.md, `fetch`): the shell sends the nth with the request's
# correlation id + nth, so that a client can tell them apart without looking inside.
# Not frozen, though nothing changes them: a frozen dataclass sets each field through
# object.__setattr__, and making a Reply cost 7,300 instructions instead of 2,200 (one
# per produce request; callgrind, bench/PROFILE.md, twentieth pass).
@dataclasses.dataclass(slots=True)
class Reply:
    token: Any
    msg: m.Message
    frames: tuple = ()
    nth: int = 0


@dataclasses.dataclass(slots=True)
class ReplyError:
    token: Any
    op: str | None
    error: ZBrokerError
    nth: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class SendToLeader:
    """Send a follower's `replica_fetch` to the leader at `endpoint`; hand its reply (or
    the failure to get one) to `PartitionActorCore.on_replica_fetch_reply`."""
    endpoint: str
    msg: m.ReplicaFetch


@dataclasses.dataclass(frozen=True, slots=True)
class SendToCoordinator:
    """Send `msg` (alter_isr) to the coordinator; its reply goes to `on_alter_isr_reply`."""
    msg: m.Message


@dataclasses.dataclass(slots=True)
class _ParkedFetch:
    deadline_ms: int
    seq: int
    token: Any
    msg: m.Fetch
    done: bool = False
    # Where the next reply reads from, which reply it is, and what is left of the
    # fetch's byte budget: a followed fetch is parked again after each reply.
    offset: int = 0
    nth: int = 0
    bytes_left: int = 0

    def __lt__(self, other: "_ParkedFetch") -> bool:
        return (self.deadline_ms, self.seq) < (other.deadline_ms, other.seq)


@dataclasses.dataclass(slots=True)
class _Gathering:
    """A produce_many waiting for its parts: the reply leaves when `pending` reaches 0."""
    token: Any
    results: list
    pending: int


@dataclasses.dataclass(frozen=True, slots=True)
class _PartToken:
    """The token a produce_many's part is produced under: its reply fills `index`."""
    gathering: _Gathering
    index: int


class OpenFailed(Exception):
    """The log could not be opened yet (e.g. its previous owner still holds the lock)."""


def detached(err: ZBrokerError) -> ZBrokerError:
    """`err` without its traceback, nor the exception it was raised from or during.

    A traceback's frames hold the request's payload and reach back to the shell
    frame that holds the ReplyError: a cycle that kept every refused frame (up to
    64 MiB each) until a full collection. `raise ... from None` still sets
    `__context__`, whose own traceback closes the same cycle.
    """
    err.__traceback__ = err.__context__ = err.__cause__ = None
    return err


class OutOfFiles(OpenFailed):
    """No file descriptor left (the process's limit, or the system's): opening more
    partitions cannot work now, but the ones already open go on serving."""


OUT_OF_FILES = (errno.EMFILE, errno.ENFILE)
# What an open partition may hold: its lock, its active segment, and up to
# storage.log.partition_log.OPEN_READ_FDS (8) for reading closed segments.
FDS_PER_PARTITION = 10
# Left for everything else: sockets, the background fsync's dup()s and directory
# opens, segment rolls, the interpreter's own files.
RESERVED_FDS = 256


def _below(data: bytes, end: int) -> bytes:
    """The whole stored batches of `data` that end at or below offset `end` (a replicated
    partition's high watermark is a batch boundary: every replica holds the same batches)."""
    position = 0
    while position < len(data):
        header = parse_batch_header(data, position)
        if header.next_offset > end:
            break
        position += header.total_size
    return data if position == len(data) else data[:position]


def _within(data: bytes, limit: int) -> bytes:
    """The whole stored batches at the start of `data` that together fit in `limit` bytes."""
    position = 0
    while position < len(data):
        size = parse_batch_header(data, position).total_size
        if position + size > limit:
            break
        position += size
    return data[:position]


def partitions_for_open_files(limit: int) -> int:
    """How many partitions an actor may open under an open-file limit and still serve
    them all: opening until EMFILE would leave none for a fetch of an old segment,
    a segment roll or an fsync, each of which is an I/O error that stops the actor."""
    return max(1, (limit - RESERVED_FDS) // FDS_PER_PARTITION)


# (topic, partition, config, wall_ms): wall_ms stamps the log's recovery report.
LogOpener = Callable[[str, int, LogConfig, int], PartitionLog]
# Deletes a closed partition's files (delete_topic); raises OpenFailed when it cannot yet
# (another actor on the same storage still holds the partition), OSError on an I/O error.
LogRemover = Callable[[str, int], None]


class PartitionActorCore:
    def __init__(self, actor_id: str, *, open_log: LogOpener, fsync: FsyncPolicy = FsyncPolicy(),
                 limits: Limits = Limits(), background_sync: Callable[[list], None] | None = None,
                 max_open_partitions: int | None = None, replica_lag_ms: int = DEFAULT_REPLICA_LAG_MS,
                 remove_log: LogRemover | None = None) -> None:
        self.actor_id = actor_id
        self._remove_log = remove_log
        # Replicated partitions only (assign's `replicas`); empty for an R = 1 broker.
        self.replicas: dict[tuple[str, int], Replica] = {}
        self._replica_states: dict[tuple[str, int], ReplicaState] = {}
        self._parked_replica: dict[tuple[str, int], list[WaitingFetch]] = {}
        self._synced_leaders: set[tuple[str, int]] = set()  # fsync=always: report local ends after end_turn
        # Leaders appended to in this turn: their followers' waiting fetches are answered at
        # end_turn, once for all the turn's produces rather than once per produce.
        self._appended_leaders: set[tuple[str, int]] = set()
        self.coordinator_epoch = 0
        self.replica_lag_ms = replica_lag_ms
        self.max_open_partitions = max_open_partitions  # see partitions_for_open_files
        # With interval fsync nothing waits for the fsync, so the shell may run it on a
        # thread (a slow disk then stalls no request); `always` syncs here, before replying.
        self._background_sync = background_sync
        self.fsync = fsync
        self.limits = limits
        self._open_log = open_log
        self.logs: dict[tuple[str, int], PartitionLog] = {}
        self._wanted: dict[tuple[str, int], LogConfig] = {}  # assigned but not open yet
        self._why_not_open: dict[tuple[str, int], str] = {}  # of those, why the last try failed
        self._next_open_retry_ms = 0
        self._out_of_files_retries = 0  # consecutive open retries that ran out of descriptors
        self._dirty_since_sync: set[tuple[str, int]] = set()
        self._held_replies: list[Reply | ReplyError] = []  # fsync=always: sent after end_turn's fsync
        self._changed: set[tuple[str, int]] = set()
        # Waiting fetches per partition, by sequence number: answering one is O(1).
        self._parked: dict[tuple[str, int], dict[int, _ParkedFetch]] = {}
        self._parked_heap: list[_ParkedFetch] = []  # by deadline
        self._parked_fifo: collections.deque[_ParkedFetch] = collections.deque()  # by arrival
        self._parked_count = 0
        self._wake_after_sync: set[tuple[str, int]] = set()  # fsync=always: wake after end_turn's sync  # fetches waiting now (heap entries may include answered ones)
        self._seq = itertools.count()
        self._next_fsync_ms: int | None = None
        self._next_full_report_ms = 0
        self._next_report_ms = 0  # when a change may be reported (REPORT_PACE_MS after the last)
        self._next_retention_ms = 0
        self._unanswered_since_ms: int | None = None  # first registration since the last reply
        self._next_unanswered_warning_ms = 0
        # Payload bytes appended per partition while this process lives: reported with the
        # log range, the console's zbroker_bytes_produced_total (a counter reset when it restarts).
        self.bytes_in: dict[tuple[str, int], int] = {}
        self.counters = {"produce_requests": 0, "records_appended": 0, "bytes_appended": 0,
                         "duplicates": 0, "fetch_requests": 0, "errors": 0, "fsyncs": 0,
                         "produce_many_requests": 0, "fetch_many_requests": 0, "reports": 0}
        self._gathering = 0  # produce_many requests with parts not yet settled

    # -- assignment -------------------------------------------------------------------------

    def accept_assignment(self, msg: m.Assign | m.RegisterReply, now_ms: int, *,
                          wall_ms: int | None = None) -> list:
        """An `assign` (or `register` reply): refused with STALE_EPOCH from a coordinator
        older than one already obeyed."""
        if msg.coordinator_epoch < self.coordinator_epoch:
            raise StaleEpoch("assignment from an older coordinator", epoch=self.coordinator_epoch,
                             got=msg.coordinator_epoch)
        self.coordinator_epoch = msg.coordinator_epoch
        return self.on_assign(msg.assignment, now_ms, replicas=msg.replicas, wall_ms=wall_ms)

    def on_assign(self, assignment: Iterable, now_ms: int, replicas: Iterable = (), *,
                  wall_ms: int | None = None) -> list:
        """Own exactly the partitions in ``assignment`` ([[topic, partition, config], ...]);
        those in ``replicas`` ([[topic, partition, state], ...]) are replicated."""
        self._replica_states = {(t, int(p)): ReplicaState.from_wire(state) for t, p, state in replicas}
        wanted: dict[tuple[str, int], LogConfig] = {}
        for item in assignment:
            topic, partition, config = item[0], item[1], item[2] if len(item) > 2 else None
            wanted[(topic, int(partition))] = LogConfig.from_dict(config)
        effects: list = []
        for key in list(self.logs):
            if key not in wanted:
                effects += self._release(key, now_ms)
        self._apply_config_changes(wanted)
        self._wanted = {k: c for k, c in wanted.items() if k not in self.logs}
        self._why_not_open = {k: why for k, why in self._why_not_open.items() if k in self._wanted}
        self._open_wanted(now_ms, now_ms if wall_ms is None else wall_ms)
        return self._gathered(effects + self._sync_replicas(now_ms))

    def _sync_replicas(self, now_ms: int) -> list:
        """Give every open log the replica state its assignment names (or none)."""
        effects: list = []
        for key in [k for k in self.replicas if k not in self._replica_states or k not in self.logs]:
            effects += self._drop_replica(key, "the partition is no longer replicated here")
        for key, state in self._replica_states.items():
            plog = self.logs.get(key)
            if plog is None:
                continue
            replica = self.replicas.get(key)
            if replica is None:
                self.replicas[key] = Replica(key[0], key[1], self.actor_id, plog, state, now_ms,
                                             replica_lag_ms=self.replica_lag_ms,
                                             fetch_max_bytes=self.limits.max_fetch_bytes)
                self._changed.add(key)
                continue
            try:
                effects += self._replica_effects(key, replica.assign(state, now_ms), now_ms)
            except StaleEpoch as err:
                log.warning("replica.stale_assignment", topic=key[0], partition=key[1], epoch=err.data.get("epoch"),
                            got=err.data.get("got"))
            self._changed.add(key)
        return effects

    def _drop_replica(self, key: tuple[str, int], why: str) -> list:
        replica = self.replicas.pop(key)
        effects = [ReplyError(t.token, "produce", NotOwner(why, topic=key[0], partition=key[1]))
                   for t in replica.drop_held()]
        for parked in self._parked_replica.pop(key, []):
            effects.append(ReplyError(parked.token, "replica_fetch", NotOwner(why, topic=key[0], partition=key[1])))
        return effects

    def _replica_effects(self, key: tuple[str, int], effects: list, now_ms: int) -> list:
        """The replica core's effects as this actor's: replies released or failed, proposals
        sent; a high watermark that moved wakes the consumers waiting on it."""
        out: list = []
        for effect in effects:
            if isinstance(effect, Acknowledge):
                out.append(effect.token)
            elif isinstance(effect, Refuse):
                out.append(ReplyError(effect.token.token, "produce", detached(effect.error)))
            elif isinstance(effect, ProposeIsr):
                out.append(SendToCoordinator(effect.request))
        replica = self.replicas.get(key)
        if replica is not None and replica.hw_established and replica.high_watermark != replica.reported_hw:
            replica.reported_hw = replica.high_watermark
            self._changed.add(key)
            out += self._wake_parked(key, now_ms)
        return out
    def _apply_config_changes(self, wanted: dict) -> None:
        """An altered topic (alter_topic) reaches its open logs through the assignment: the
        new settings apply from now on, and retention is checked at the next tick rather
        than within RETENTION_CHECK_MS, so a shortened retention shows at once."""
        for key, plog in self.logs.items():
            config = wanted.get(key)
            if config is not None and config != plog.config:
                log.info("partition.config_changed", topic=key[0], partition=key[1], config=config.to_dict())
                plog.config = config
                self._next_retention_ms = 0

    def _open_wanted(self, now_ms: int, wall_ms: int) -> None:
        out_of_files = 0
        for key, config in list(self._wanted.items()):
            if out_of_files:
                out_of_files += 1  # the rest would fail the same way: wait for the next retry
                self._why_not_open[key] = NO_FILES_LEFT
                continue
            if self.max_open_partitions is not None and len(self.logs) >= self.max_open_partitions:
                out_of_files = 1
                self._why_not_open[key] = NO_FILES_LEFT
                continue
            try:
                plog = self._open_log(key[0], key[1], config, wall_ms)
                if self.fsync.mode != "never":
                    # What the previous owner wrote but had not yet fsynced when it died is
                    # made durable before any of it is served or reported.
                    self._make_durable(plog)
            except OutOfFiles:
                out_of_files = 1
                self._why_not_open[key] = NO_FILES_LEFT
                continue
            except OpenFailed as exc:
                log.info("partition.open_deferred", topic=key[0], partition=key[1], reason=str(exc))
                self._why_not_open[key] = str(exc)
                continue
            del self._wanted[key]
            self._why_not_open.pop(key, None)
            self.logs[key] = plog
            self._changed.add(key)
            rec = plog.recovery
            log.info("partition.opened", topic=key[0], partition=key[1], log_start=plog.log_start,
                     log_end=plog.log_end, truncated_bytes=getattr(rec, "truncated_bytes", 0))
        self._out_of_files_retries = self._out_of_files_retries + 1 if out_of_files else 0
        retries = self._out_of_files_retries
        if retries & (retries - 1) == 0 and retries:
            # Not one line per partition (a topic of thousands), nor one per second for ever.
            log.error("partition.open_deferred_out_of_files", partitions=out_of_files, open=len(self.logs),
                      retries=retries, max_open_partitions=self.max_open_partitions,
                      hint="raise the open-file limit (ulimit -n): each open partition holds 2-10 descriptors")
        self._next_open_retry_ms = now_ms + RETRY_OPEN_MS

    @staticmethod
    def _make_durable(plog: PartitionLog) -> None:
        try:
            plog.make_durable()
        except OSError as exc:
            if exc.errno not in OUT_OF_FILES:
                raise
            try:
                plog.close()  # its flush needs a descriptor too; the files are closed all the same
            except OSError:
                pass
            raise OutOfFiles(exc.strerror) from None

    def _release(self, key: tuple[str, int], now_ms: int) -> list:
        effects = self._drop_replica(key, "partition moved to another actor") if key in self.replicas else []
        plog = self.logs.pop(key)
        plog.close()
        self._dirty_since_sync.discard(key)
        for parked in list(self._parked.pop(key, {}).values()):
            if not parked.done:
                self._finish(parked)
                effects += self._behind_held(ReplyError(parked.token, "fetch", NotOwner(
                    "partition moved to another actor", topic=key[0], partition=key[1]), parked.nth))
        log.info("partition.released", topic=key[0], partition=key[1])
        return effects

    def delete_partitions(self, token: Any, msg: m.DeletePartitions, now_ms: int) -> list:
        """delete_topic reaches the disk: each partition is closed (if open here) and its
        files removed; one that cannot be removed yet is reported `failed` and asked again."""
        if msg.coordinator_epoch < self.coordinator_epoch:
            raise StaleEpoch("delete from an older coordinator", epoch=self.coordinator_epoch,
                             got=msg.coordinator_epoch)
        if self._remove_log is None:
            raise UnknownOp("this partition actor cannot delete logs", op=msg.op)
        effects: list = []
        deleted, failed = [], []
        for topic, partition in msg.partitions:
            key = (topic, partition)
            if key in self.logs:
                effects += self._release(key, now_ms)
            self._wanted.pop(key, None)
            self._why_not_open.pop(key, None)
            self._replica_states.pop(key, None)
            self.bytes_in.pop(key, None)
            try:
                self._remove_log(topic, partition)
            except OpenFailed as exc:
                failed.append([topic, partition, str(exc)])
                continue
            log.info("partition.deleted", topic=topic, partition=partition)
            deleted.append([topic, partition])
        return effects + [Reply(token, m.DeletePartitionsReply(deleted=deleted, failed=failed))]

    def owned(self) -> list[list]:
        return [[t, p] for (t, p) in sorted(self.logs)]

    def assignment_reply(self) -> m.AssignReply:
        return m.AssignReply(partitions=self.partition_reports(self.logs))

    # -- requests ---------------------------------------------------------------------------

    def handle(self, token: Any, env, now_ms: int, *, wall_ms: int | None = None,
               from_coordinator: bool = False) -> list:
        """Dispatch one decoded request envelope.

        ``assign`` is obeyed only on the coordinator's connection: on the client
        socket anyone could otherwise make this actor open (or drop) partitions.
        """
        return self._gathered(self._dispatch(token, env, now_ms, wall_ms, from_coordinator))

    def _dispatch(self, token: Any, env, now_ms: int, wall_ms: int | None, from_coordinator: bool) -> list:
        op = env.op
        try:
            if op in ("assign", "delete_partitions") and not from_coordinator:
                raise Unauthorized(f"{op} is accepted only from the coordinator", op=op)
            if op == "produce":
                return self.produce(token, env.msg, env.frames, now_ms, wall_ms=wall_ms)
            if op == "fetch":
                return self.fetch(token, env.msg, now_ms, env.corr_id)
            if op == "produce_many":
                return self.produce_many(token, env.msg, env.frames, now_ms, wall_ms=wall_ms)
            if op == "fetch_many":
                return self.fetch_many(token, env.msg)
            if op == "offset_for_time":
                return self.offset_for_time(token, env.msg)
            if op == "hello":
                return [Reply(token, m.HelloReply(version=m.PROTOCOL_VERSION, server="zbroker",
                                                   actor=f"partition-log:{self.actor_id}",
                                                   limits=self.limits.to_dict(),
                                                   features=["replication", "multi_partition"]))]
            if op == "status":
                return [Reply(token, m.StatusReply(actors=[self.status(now_ms)]))]
            if op == "assign":
                effects = self.accept_assignment(env.msg, now_ms, wall_ms=wall_ms)
                return effects + [Reply(token, self.assignment_reply())]
            if op == "replica_fetch":
                return self.replica_fetch(token, env.msg, now_ms)
            if op == "delete_partitions":
                return self.delete_partitions(token, env.msg, now_ms)
            raise UnknownOp(f"op {op!r} is not served by a partition actor", op=op)
        except ZBrokerError as err:
            self.counters["errors"] += 1
            return [ReplyError(token, op, detached(err))]

    def produce(self, token: Any, msg: m.Produce, frames: list, now_ms: int, *,
                wall_ms: int | None = None) -> list:
        self.counters["produce_requests"] += 1
        if 0 < msg.coordinator_epoch < self.coordinator_epoch:
            # A dead letter from a coordinator whose term is over (a paused former leader).
            raise StaleEpoch("produce from an older coordinator", epoch=self.coordinator_epoch,
                             got=msg.coordinator_epoch, topic=msg.topic, partition=msg.partition)
        key = (msg.topic, msg.partition)
        plog = self._owned_log(key)
        if len(frames) != 1:
            raise ProtocolError("produce carries exactly one payload frame", frames=len(frames))
        payload = frames[0]
        if len(payload) > self.limits.max_batch_bytes:
            raise TooLarge("batch exceeds max_batch_bytes", limit=self.limits.max_batch_bytes,
                           got=len(payload), topic=msg.topic, partition=msg.partition)
        count = validate_payload(payload)
        if self.replicas and key in self.replicas:
            return self._produce_replicated(token, msg, key, plog, payload, count, now_ms)
        if msg.producer_id:
            earlier = plog.check_sequence(msg.producer_id, msg.sequence)
            if earlier is not None:
                self.counters["duplicates"] += 1
                return self._produce_reply(token, m.ProduceReply(base_offset=earlier[0], count=earlier[1],
                                                                 duplicate=True))
        base = plog.append(payload, count, append_time_ms=now_ms if wall_ms is None else wall_ms,
                           producer_id=msg.producer_id, producer_seq=msg.sequence)
        self.counters["records_appended"] += count
        self.counters["bytes_appended"] += len(payload)
        self.bytes_in[key] = self.bytes_in.get(key, 0) + len(payload)
        self._dirty_since_sync.add(key)
        self._changed.add(key)
        reply = self._produce_reply(token, m.ProduceReply(base_offset=base, count=count))
        if self.fsync.mode == "always":
            # Waiting fetches see the records after the fsync, like the producer's reply: no
            # consumer may hold bytes that a crash before the sync could still take back.
            self._wake_after_sync.add(key)
            return reply
        return self._wake_parked(key, now_ms) + reply

    def produce_many(self, token: Any, msg: m.ProduceMany, frames: list, now_ms: int, *,
                     wall_ms: int | None = None) -> list:
        """Each part as `produce` would take it; one reply once every part is settled."""
        self.counters["produce_many_requests"] += 1
        if len(frames) != 1:
            raise ProtocolError("produce_many carries exactly one payload frame", frames=len(frames))
        payloads = m.split_payloads(msg.parts, frames[0])
        gathering = _Gathering(token, [None] * len(msg.parts), len(msg.parts))
        self._gathering += 1
        effects: list = []
        for index, (topic, partition, producer_id, sequence, _length) in enumerate(msg.parts):
            part = m.Produce(topic=topic, partition=partition, producer_id=producer_id, sequence=sequence)
            try:
                effects += self.produce(_PartToken(gathering, index), part, [payloads[index]], now_ms,
                                        wall_ms=wall_ms)
            except ZBrokerError as err:
                self.counters["errors"] += 1
                effects.append(ReplyError(_PartToken(gathering, index), "produce", detached(err)))
        return effects

    def _gathered(self, effects: list) -> list:
        """Part replies of produce_many requests folded into their requests' replies."""
        if not self._gathering:
            return effects
        out = []
        for effect in effects:
            token = getattr(effect, "token", None)
            if type(token) is not _PartToken:
                out.append(effect)
                continue
            gathering = token.gathering
            if isinstance(effect, Reply):
                r = effect.msg
                gathering.results[token.index] = [r.base_offset, r.count, r.duplicate, None]
            else:
                gathering.results[token.index] = [0, 0, False, effect.error.to_wire()]
            gathering.pending -= 1
            if gathering.pending == 0:
                self._gathering -= 1
                out.append(Reply(gathering.token, m.ProduceManyReply(results=gathering.results)))
        return out

    def fetch_many(self, token: Any, msg: m.FetchMany) -> list:
        """Each part read as `fetch` reads it, within the request's byte budget; a part the
        budget no longer reaches gets nothing (length 0) and is fetched again."""
        self.counters["fetch_many_requests"] += 1
        budget = min(max(msg.max_bytes, 1), self.limits.max_fetch_bytes)
        rows, chunks, touched_dirty = [], [], False
        for topic, partition, offset, max_bytes in msg.parts:
            key = (topic, partition)
            try:
                plog = self._owned_log(key)
                visible_end = self._visible_end(key, plog)
                data = b""
                if budget > 0:
                    data = self._read_visible(key, plog, offset, min(max(max_bytes, 1), budget), visible_end)
                    if chunks and len(data) > budget:
                        # Only the first part with records may pass the budget (by its first
                        # batch, so that a consumer always makes progress), as in Kafka.
                        data = _within(data, budget)
                elif not 0 <= offset <= plog.log_end:
                    plog.read(offset, 1)  # the same OFFSET_OUT_OF_RANGE as a part that is read
            except ZBrokerError as err:
                rows.append([0, 0, 0, detached(err).to_wire()])
                continue
            budget -= len(data)
            rows.append([plog.log_start, visible_end, len(data), None])
            if data:
                chunks.append(data)
                touched_dirty = touched_dirty or key in self._dirty_since_sync
        reply = Reply(token, m.FetchManyReply(parts=rows), (b"".join(chunks),))
        if touched_dirty and self.fsync.mode == "always":
            self._held_replies.append(reply)  # as `_after_sync`: no records before their fsync
            return []
        return [reply]

    def _visible_end(self, key: tuple[str, int], plog: PartitionLog) -> int:
        """Where a consumer's view of the partition ends: the log end, or a replicated
        partition's high watermark (NOT_LEADER from a follower)."""
        if self.replicas and key in self.replicas:
            replica = self.replicas[key]
            if not replica.is_leader:
                raise replica.not_leader_error()
            return replica.high_watermark
        return plog.log_end

    def _read_visible(self, key: tuple[str, int], plog: PartitionLog, offset: int, max_bytes: int,
                      visible_end: int) -> bytes:
        if self.replicas and key in self.replicas:
            # Consumers see only what is on min_insync replicas.
            return _below(plog.read(offset, max_bytes), visible_end) if offset < visible_end else b""
        return plog.read(offset, max_bytes)

    def _produce_replicated(self, token: Any, msg: m.Produce, key: tuple[str, int], plog: PartitionLog,
                            payload: Any, count: int, now_ms: int) -> list:
        """acks=all: refused unless this replica leads with min_insync in sync (nothing
        appended), and answered once the high watermark covers the batch."""
        replica = self.replicas[key]
        refusal = replica.check_produce()
        if refusal is not None:
            raise refusal
        if msg.producer_id:
            earlier = plog.check_sequence(msg.producer_id, msg.sequence)
            if earlier is not None:
                # Answered only once the original batch is replicated too.
                self.counters["duplicates"] += 1
                reply = Reply(token, m.ProduceReply(base_offset=earlier[0], count=earlier[1], duplicate=True))
                return self._replica_effects(key, replica.hold(reply, earlier[0] + earlier[1], now_ms), now_ms)
        base = plog.append(payload, count, append_time_ms=now_ms, producer_id=msg.producer_id,
                           producer_seq=msg.sequence)
        self.counters["records_appended"] += count
        self.counters["bytes_appended"] += len(payload)
        self.bytes_in[key] = self.bytes_in.get(key, 0) + len(payload)
        self._dirty_since_sync.add(key)
        effects = replica.hold(Reply(token, m.ProduceReply(base_offset=base, count=count)), base + count, now_ms)
        if self.fsync.mode == "always":
            self._synced_leaders.add(key)  # its own copy counts after end_turn's fsync
        else:
            effects += replica.on_local_end(plog.log_end, now_ms)
        replica.appended(len(payload), now_ms)
        self._appended_leaders.add(key)
        return self._replica_effects(key, effects, now_ms)

    def _produce_reply(self, token: Any, reply: m.ProduceReply) -> list:
        effect = Reply(token, reply)
        if self.fsync.mode == "always":
            # Held until end_turn() has fsynced. A duplicate is held too: the original
            # may have been written, but not yet fsynced, by this same turn.
            self._held_replies.append(effect)
            return []
        return [effect]

    def fetch(self, token: Any, msg: m.Fetch, now_ms: int, corr_id: Any = None) -> list:
        self.counters["fetch_requests"] += 1
        key = (msg.topic, msg.partition)
        plog = self._owned_log(key)
        if msg.follow and not (isinstance(corr_id, int) and corr_id + msg.follow < 1 << 64):
            raise ProtocolError("a fetch with 'follow' needs an integer id that stays below 2^64 + follow",
                                op="fetch", field="follow", got=msg.follow)
        budget = self._fetch_bytes(msg)
        if self.replicas and key in self.replicas:
            replica = self.replicas[key]
            if not replica.is_leader:
                raise replica.not_leader_error()
            if msg.offset >= replica.high_watermark and msg.max_wait_ms > 0:
                return self._park(token, msg, now_ms, msg.offset, 0, budget)
        elif msg.offset == plog.log_end and msg.max_wait_ms > 0:
            return self._park(token, msg, now_ms, msg.offset, 0, budget)
        return self._answer(token, msg, plog, msg.offset, 0, budget, now_ms)

    def offset_for_time(self, token: Any, msg: m.OffsetForTime) -> list:
        """Where `reset_group --to-datetime` puts a group: batch append times are stored here."""
        plog = self._owned_log((msg.topic, msg.partition))
        return [Reply(token, m.OffsetForTimeReply(offset=plog.offset_for_time(msg.time_ms),
                                                  log_start=plog.log_start, log_end=plog.log_end))]

    def _fetch_bytes(self, msg: m.Fetch) -> int:
        return min(max(msg.max_bytes, 1), self.limits.max_fetch_bytes)

    def _park(self, token: Any, msg: m.Fetch, now_ms: int, offset: int, nth: int, bytes_left: int) -> list:
        key = (msg.topic, msg.partition)
        effects = self._make_room_for_a_parked_fetch()
        parked = _ParkedFetch(now_ms + msg.max_wait_ms, next(self._seq), token, msg,
                              offset=offset, nth=nth, bytes_left=bytes_left)
        self._parked.setdefault(key, {})[parked.seq] = parked
        heapq.heappush(self._parked_heap, parked)
        self._parked_fifo.append(parked)
        self._parked_count += 1
        if len(self._parked_heap) > 2 * self._parked_count + 1024:
            # Answered fetches stay in the heap until their deadline; drop them now.
            self._parked_heap = [p for p in self._parked_heap if not p.done]
            heapq.heapify(self._parked_heap)
        if len(self._parked_fifo) > 2 * self._parked_count + 1024:
            self._parked_fifo = collections.deque(p for p in self._parked_fifo if not p.done)
        return effects

    def _answer(self, token: Any, msg: m.Fetch, plog: PartitionLog, offset: int, nth: int, bytes_left: int,
                now_ms: int | None) -> list:
        """The `nth` reply of a fetch, read from `offset`; with `now_ms`, a followed fetch
        that still has replies and bytes left and caught up with the log end is parked
        again (its reply says `more`). `now_ms=None` ends it (deadline, shutdown)."""
        key = (msg.topic, msg.partition)
        visible_end = self.replicas[key].high_watermark if self.replicas and key in self.replicas else plog.log_end
        data = self._read_visible(key, plog, offset, bytes_left, visible_end)
        next_offset = offset
        if data:
            span = stored_range(data)
            next_offset = offset if span is None else span[1]
        bytes_left -= len(data)
        more = (now_ms is not None and nth < msg.follow and bytes_left > 0 and msg.max_wait_ms > 0
                and next_offset == visible_end)
        reply = Reply(token, m.FetchReply(log_start=plog.log_start, log_end=visible_end, more=more), (data,), nth)
        effects = self._after_sync((msg.topic, msg.partition), reply)
        if more:
            effects += self._park(token, msg, now_ms, next_offset, nth + 1, bytes_left)
        return effects

    def _after_sync(self, key: tuple[str, int], effect: Any) -> list:
        """With fsync=always, a fetch answered in a turn that appended to its partition
        waits for end_turn's fsync, like the produce replies: it may carry the new records."""
        if self.fsync.mode == "always" and key in self._dirty_since_sync:
            self._held_replies.append(effect)
            return []
        return [effect]

    def _behind_held(self, effect: Any) -> list:
        """With fsync=always, an effect that must not overtake the replies held for end_turn's
        fsync (a followed fetch's earlier reply may be among them) waits behind them."""
        if self._held_replies:
            self._held_replies.append(effect)
            return []
        return [effect]

    def _finish(self, parked: _ParkedFetch) -> None:
        """A waiting fetch stops waiting (it is being answered); heap entries stay until popped."""
        parked.done = True
        self._parked_count -= 1
        waiting = self._parked.get((parked.msg.topic, parked.msg.partition))
        if waiting is not None:
            waiting.pop(parked.seq, None)

    def _make_room_for_a_parked_fetch(self) -> list:
        """Keep waiting fetches bounded: past the cap, the oldest is answered at once, empty."""
        if self._parked_count < MAX_PARKED_FETCHES:
            return []
        # The oldest first; answered ones are skipped here (amortised O(1) per fetch: a
        # client flooding parked fetches must not make every fetch cost the whole set).
        oldest = self._parked_fifo.popleft()
        while oldest.done:
            oldest = self._parked_fifo.popleft()
        self._finish(oldest)
        key = (oldest.msg.topic, oldest.msg.partition)
        return self._last_reply(oldest, self.logs[key])

    def _last_reply(self, parked: _ParkedFetch, plog: PartitionLog) -> list:
        """A waiting fetch answered with what there is, and ended (deadline, room, shutdown)."""
        return self._answer(parked.token, parked.msg, plog, parked.offset, parked.nth, parked.bytes_left, None)

    def _wake_parked(self, key: tuple[str, int], now_ms: int) -> list:
        waiting = self._parked.pop(key, None)
        if not waiting:
            return []
        plog = self.logs[key]
        visible_end = self.replicas[key].high_watermark if self.replicas and key in self.replicas else plog.log_end
        effects = []
        for parked in list(waiting.values()):
            if parked.done:  # answered meanwhile, to make room for a fetch parked again below
                continue
            if parked.offset >= visible_end:
                # Parked after the append that woke it (fsync=always wakes at end_turn): it
                # has nothing to read yet, and waits on instead of getting an empty reply.
                self._parked.setdefault(key, {})[parked.seq] = parked
                continue
            self._finish(parked)
            try:
                effects += self._answer(parked.token, parked.msg, plog, parked.offset, parked.nth,
                                        parked.bytes_left, now_ms)
            except OffsetOutOfRange as err:
                effects.append(ReplyError(parked.token, "fetch", err, parked.nth))
        return effects

    # -- replication: leader side -------------------------------------------------------------

    def replica_fetch(self, token: Any, msg: m.ReplicaFetch, now_ms: int) -> list:
        key = (msg.topic, msg.partition)
        self._owned_log(key)
        replica = self.replicas.get(key)
        if replica is None:
            raise NotOwner("the partition is not replicated on this actor", topic=key[0], partition=key[1])
        try:
            reply, data, effects = replica.on_replica_fetch(msg, now_ms)
        except ZBrokerError as err:
            return self._replica_effects(key, getattr(err, "effects", []), now_ms) + [
                ReplyError(token, "replica_fetch", detached(err))]
        effects = self._replica_effects(key, effects, now_ms)
        # Parked at the log end, even when this very fetch moved the HW: the follower learns
        # the HW with its next answer, as Kafka's followers do. Answering at once cost every
        # replicated produce a second round trip per follower (bench/PROFILE.md, twenty-first
        # and twenty-fourth passes). A follower elected leader does not start from its own
        # HW, one answer old, but from the last one published, which its assignment carries.
        if not data and reply.diverging is None and msg.max_wait_ms > 0 and msg.fetch_offset == reply.log_end:
            self._parked_replica.setdefault(key, []).append(replica.wait_at_end(token, msg, now_ms))
            return effects
        return effects + [Reply(token, reply, (data,))]

    def _wake_replica_fetches(self, key: tuple[str, int], now_ms: int) -> list:
        """Answer the followers' waiting fetches the replica says are due (`Replica.answer_at`)."""
        parked = self._parked_replica.get(key)
        replica = self.replicas.get(key)
        if not parked or replica is None:
            return []
        due, waiting = [], []
        for fetch in parked:
            fetch.due_ms = replica.answer_at(fetch, now_ms)
            (due if fetch.due_ms <= now_ms else waiting).append(fetch)
        if not due:
            return []
        self._parked_replica[key] = waiting
        effects = []
        for fetch in due:
            effects += self.replica_fetch(fetch.token, dataclasses.replace(fetch.msg, max_wait_ms=0), now_ms)
        return effects

    def on_alter_isr_reply(self, key: tuple[str, int], reply: m.AlterIsrReply | None, error: ZBrokerError | None,
                           now_ms: int) -> list:
        replica = self.replicas.get(key)
        if replica is None:
            return []
        if reply is not None:
            return self._gathered(self._replica_effects(key, replica.on_isr_recorded(reply, now_ms), now_ms))
        return self._gathered(self._replica_effects(key, replica.on_isr_refused(error, now_ms), now_ms))

    # -- replication: follower side ---------------------------------------------------------

    def replica_fetches(self, now_ms: int) -> list:
        """The `replica_fetch` requests followers should send now."""
        out = []
        for replica in self.replicas.values():
            request = replica.next_fetch(now_ms)
            if request is not None:
                out.append(SendToLeader(*request))
        return out

    def on_replica_fetch_reply(self, key: tuple[str, int], reply: m.ReplicaFetchReply | None, frames: list,
                               error: ZBrokerError | None, now_ms: int) -> list:
        replica = self.replicas.get(key)
        if replica is None:
            return []
        if reply is None:
            replica.on_fetch_failed(error, now_ms)
            return []
        plog = self.logs[key]
        end_before = plog.log_end
        replica.on_fetch_reply(reply, b"".join(bytes(f) for f in frames), now_ms)
        if plog.log_end != end_before or reply.diverging is not None:
            # Not reported at once: a follower's log end is only shown (describe's
            # replica_log_ends), and the registration each second carries it. A report per
            # answer was a coordinator wake-up per replicated batch and follower.
            if self.fsync.mode == "always":
                plog.flush()  # the next fetch reports this end: it must be on disk first
                self.counters["fsyncs"] += 1
            else:
                self._dirty_since_sync.add(key)
        return self.replica_fetches(now_ms)

    def _owned_log(self, key: tuple[str, int]) -> PartitionLog:
        plog = self.logs.get(key)
        if plog is None:
            raise NotOwner("this actor does not own the partition; refresh metadata",
                           topic=key[0], partition=key[1], actor_id=self.actor_id,
                           opening=key in self._wanted)
        return plog

    # -- time -------------------------------------------------------------------------------

    def end_turn(self, now_ms: int) -> list:
        """Called once per loop turn after the shell drained its sockets."""
        woken: list = []
        if self._appended_leaders:
            for key in self._appended_leaders:
                woken += self._wake_replica_fetches(key, now_ms)
            self._appended_leaders.clear()
        if not self._held_replies and not self._wake_after_sync and not self._synced_leaders:
            return self._gathered(woken) if woken else []
        self.sync_dirty()
        held, self._held_replies = self._held_replies + woken, []
        if self._synced_leaders:
            leaders, self._synced_leaders = self._synced_leaders, set()
            for key in leaders:
                replica = self.replicas.get(key)
                if replica is not None:
                    held += self._replica_effects(key, replica.on_local_end(self.logs[key].log_end, now_ms), now_ms)
        for key in self._wake_after_sync:
            held += self._wake_parked(key, now_ms)
        self._wake_after_sync.clear()
        return self._gathered(held)

    def sync_dirty(self) -> None:
        for key in self._dirty_since_sync:
            plog = self.logs.get(key)
            if plog is not None:
                plog.flush()
                self.counters["fsyncs"] += 1
        self._dirty_since_sync.clear()

    def tick(self, now_ms: int, *, wall_ms: int | None = None) -> list:
        wall = now_ms if wall_ms is None else wall_ms
        effects: list = []
        while self._parked_heap and self._parked_heap[0].deadline_ms <= now_ms:
            parked = heapq.heappop(self._parked_heap)
            if parked.done:
                continue
            self._finish(parked)
            key = (parked.msg.topic, parked.msg.partition)
            plog = self.logs.get(key)
            if plog is None:
                effects += self._behind_held(ReplyError(parked.token, "fetch", NotOwner(
                    "partition moved", topic=key[0], partition=key[1]), parked.nth))
            else:
                effects += self._last_reply(parked, plog)
        if self.fsync.mode == "interval" and self._dirty_since_sync:
            if self._next_fsync_ms is None:
                self._next_fsync_ms = now_ms + self.fsync.interval_ms
            elif now_ms >= self._next_fsync_ms:
                if self._background_sync is None:
                    self.sync_dirty()
                else:
                    jobs = [job for key in self._dirty_since_sync if key in self.logs
                            for job in self.logs[key].sync_jobs()]
                    self._dirty_since_sync.clear()
                    self.counters["fsyncs"] += 1
                    self._background_sync(jobs)
                self._next_fsync_ms = None
        if self._wanted and now_ms >= self._next_open_retry_ms:
            self._open_wanted(now_ms, wall)
            effects += self._sync_replicas(now_ms)
        if self.replicas:
            for key, replica in self.replicas.items():
                keeping_up = replica.keeping_up
                effects += self._replica_effects(key, replica.tick(now_ms), now_ms)
                if replica.keeping_up != keeping_up:  # `zbroker status` shows it (state_row)
                    self._changed.add(key)
                if any(fetch.due_ms <= now_ms for fetch in self._parked_replica.get(key, ())):
                    effects += self._wake_replica_fetches(key, now_ms)
            effects += self.replica_fetches(now_ms)
        if now_ms >= self._next_retention_ms:
            self._next_retention_ms = now_ms + RETENTION_CHECK_MS
            for key, plog in self.logs.items():
                if plog.enforce_retention(wall):
                    self._changed.add(key)
                    log.info("partition.retention", topic=key[0], partition=key[1], log_start=plog.log_start)
        return self._gathered(effects)

    def next_deadline(self) -> int | None:
        candidates = [self._next_full_report_ms]
        if self._changed:
            candidates.append(self._next_report_ms)
        if self._parked_heap:
            candidates.append(self._parked_heap[0].deadline_ms)
        if self._next_fsync_ms is not None:
            candidates.append(self._next_fsync_ms)
        elif self.fsync.mode == "interval" and self._dirty_since_sync:
            candidates.append(0)  # arm the fsync timer on the next tick
        if self._wanted:
            candidates.append(self._next_open_retry_ms)
        for key, replica in self.replicas.items():
            due = replica.deadline_ms()
            if due is not None:
                candidates.append(due)
            candidates += [fetch.due_ms for fetch in self._parked_replica.get(key, ())]
        return min(candidates)

    # -- reports ----------------------------------------------------------------------------

    def partition_reports(self, keys: Iterable[tuple[str, int]]) -> list[list]:
        """[topic, partition, log_start, log_end, bytes, bytes_appended]; a replicated partition's
        leader reports its high watermark as log_end (the coordinator leases only replicated
        records), once it has computed one in its epoch (`Replica.hw_established`: the log end
        shown never dips), and its followers leave it out."""
        if self.replicas:
            return [self._report_row(t, p) for (t, p) in sorted(keys)
                    if (t, p) in self.logs and ((t, p) not in self.replicas or self._publishes_hw(self.replicas[(t, p)]))]
        bytes_in = self.bytes_in
        return [[t, p, plog.log_start, plog.log_end, plog.size_bytes, bytes_in.get((t, p), 0)]
                for (t, p) in sorted(keys) if (plog := self.logs.get((t, p))) is not None]

    @staticmethod
    def _publishes_hw(replica: Replica) -> bool:
        return replica.is_leader and replica.hw_established

    def _report_row(self, topic: str, partition: int) -> list:
        plog = self.logs[(topic, partition)]
        replica = self.replicas.get((topic, partition))
        end = plog.log_end if replica is None else replica.high_watermark
        return [topic, partition, plog.log_start, end, plog.size_bytes, self.bytes_in.get((topic, partition), 0)]

    def replica_states(self, keys: Iterable[tuple[str, int]] | None = None) -> list[list]:
        """`replica_states` items for every replica held (or those of `keys`)."""
        chosen = sorted(self.replicas) if keys is None else sorted(k for k in keys if k in self.replicas)
        return [self.replicas[k].state_row() for k in chosen]

    def heartbeat_due(self, now_ms: int) -> bool:
        """Once a second the shell re-registers: a full report that doubles as a heartbeat."""
        if now_ms < self._next_full_report_ms:
            return False
        self._next_full_report_ms = now_ms + REPORT_INTERVAL_MS
        self._changed.clear()
        return True

    def registration_sent(self, now_ms: int) -> int | None:
        """A registration went out. Returns how long registrations have gone unanswered
        when that deserves a warning (after REGISTRATION_UNANSWERED_WARN_MS, then once a
        minute), else None.

        The coordinator answers every one. The usual reason it does not is a second actor
        started with this actor id: the coordinator's ROUTER refuses a connection under an
        identity already connected, so this actor's messages vanish and it would sit idle
        without a word (or the coordinator is down, which the supervisor reports too)."""
        if self._unanswered_since_ms is None:
            self._unanswered_since_ms = now_ms
        silent = now_ms - self._unanswered_since_ms
        if silent < REGISTRATION_UNANSWERED_WARN_MS or now_ms < self._next_unanswered_warning_ms:
            return None
        self._next_unanswered_warning_ms = now_ms + 60_000
        return silent

    def registration_answered(self) -> None:
        self._unanswered_since_ms = None
        self._next_unanswered_warning_ms = 0

    @property
    def registered(self) -> bool:
        return self._unanswered_since_ms is None

    def registration(self, *, endpoint: str, storage_id: str, pid: int, rack: str | None = None) -> m.Register:
        # The partitions it was given but could not open go too, with why, so that
        # `zbroker status` says what only this actor's log would otherwise say.
        not_open = [[t, p, self._why_not_open.get((t, p), "opening")]
                    for (t, p) in sorted(self._wanted)[:m.MAX_NOT_OPEN_LISTED]]
        return m.Register(actor_id=self.actor_id, endpoint=endpoint, storage_id=storage_id, pid=pid,
                          partitions=self.partition_reports(self.logs), not_open=not_open,
                          not_open_count=len(self._wanted), replica_states=self.replica_states(),
                          rack=rack)

    def take_report(self, now_ms: int) -> m.Report | None:
        """Log ends of the partitions that changed since the last report, if any and if the
        last report is at least REPORT_PACE_MS old (`next_deadline` says when to ask again)."""
        if not self._changed or now_ms < self._next_report_ms:
            return None
        self._next_report_ms = now_ms + REPORT_PACE_MS
        self.counters["reports"] += 1  # messages to the coordinator per request: bench.one_record
        changed, self._changed = self._changed, set()
        return m.Report(actor_id=self.actor_id, partitions=self.partition_reports(changed),
                        replica_states=self.replica_states(changed) if self.replicas else [])

    def status(self, now_ms: int) -> dict:
        return {"kind": "partition-log", "actor_id": self.actor_id, "fsync": str(self.fsync),
                "registered": self.registered,
                "partitions": self.partition_reports(self.logs),
                "opening": [[t, p] for (t, p) in sorted(self._wanted)],
                "counters": dict(self.counters)}

    # -- shutdown ---------------------------------------------------------------------------

    def close(self) -> list:
        """Answer parked fetches, fsync and close every log."""
        effects: list = []
        for waiting in list(self._parked.values()):
            for parked in list(waiting.values()):
                if not parked.done:
                    self._finish(parked)
                    plog = self.logs[(parked.msg.topic, parked.msg.partition)]
                    effects.append(Reply(parked.token, m.FetchReply(log_start=plog.log_start, log_end=plog.log_end),
                                         (b"",), parked.nth))
        self._parked.clear()
        self._parked_heap.clear()
        self._parked_fifo.clear()
        effects += self.end_turn(0)
        for plog in self.logs.values():
            plog.close()
        self.logs.clear()
        return effects

