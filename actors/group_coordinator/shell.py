"""Group-coordinator process: one ROUTER, two pure cores, and the plumbing between them.

Everything dials this actor: clients (topics, groups), partition-log actors
(``partition:<id>`` identities: register, report; they serve ``assign``,
``fetch`` and ``produce`` sent back to them), and the commit writer
(identity ``writer``: writer_status; it serves ``advance`` and
``load_offsets``). Decisions live in `TopicRegistry` (placement) and
`GroupCoordinatorCore` (groups, leases, commits); this module only routes
messages, reads the clock once per turn, persists metadata files, and runs
the two multi-step effects that need other actors:

* committed-offset persistence: `PersistOffsets` effects are coalesced per key
  and sent to the writer as one ``advance`` at most every ADVANCE_COALESCE_MS
  (50 ms); the writer's reply says
  what is durable and goes back to the core via ``on_durable``. Unconfirmed
  advances are resent when the writer restarts or stays silent.
* dead letters: fetch the record from its partition actor, append it with
  provenance headers to the DLQ topic (created on demand) with an idempotent
  producer id, then tell the core it is done (or why it failed: a copy refused
  TOO_LARGE is made again without its value when the core says so).
"""

from __future__ import annotations

import collections

import itertools
import os
import random
import time
from pathlib import Path
from typing import Any, Callable

import zmq

from zbroker.actors import runtime, security
from zbroker.client.wire import recv_frames
from zbroker.actors.group_coordinator import effects as fx
from zbroker.actors.group_coordinator.core import GroupConfig, GroupCoordinatorCore
from zbroker.actors.group_coordinator.leadership import (BecomeLeader, LeaderKnown, Leadership, LeadershipConfig,
                                                         RenewLease, StepDown)
from zbroker.actors.group_coordinator.stored_metadata import (Pending, StoredMetadata, metadata_from_wire,
                                                              snapshot_from_store)
from zbroker.actors.group_coordinator.topics import (AssignActor, DeletePartitionsOn, LogEvent, PersistTopics,
                                                     ReloadMetadata, TopicRegistry, WriteMetadata)
from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.batch import decode_fetched, encode_records, key_hashes
from zbroker.protocol.errors import (ErrorCode, NotCoordinator, ProtocolError, ShuttingDown, TopicExists, TopicInUse,
                                     Unauthorized, Unavailable, UnknownOp, ZBrokerError)
from zbroker.storage.offsets.metadata import SINGLE_NODE_EPOCH, LeaseState, MetadataChanges

TURN_BUDGET = 512
WRITER_IDENTITY = b"writer"
ADVANCE_RESEND_MS = 3000
# Committed offsets go to the writer at most this often. Sending on every ack that
# moved a commit costs a message and a reply per ack (thousands a second on a busy
# group). At 5 ms, a consumer acking 2,000 paced records a second kept the writer
# at 15-20 % of a core, most of it waking up for each message, and the wake-ups
# competed with the data path; at 50 ms it is 4-5 %. A commit is only a restart
# point: 50 ms more of acked records may be redelivered after a crash, never lost.
ADVANCE_COALESCE_MS = 50
# How long a stopping coordinator waits for the writer to confirm the advances it handed it
# last (well inside the supervisor's 10 s stop timeout; a writer that cannot flush, a
# database outage, costs the stop this long and the rows are redelivered, as after a crash).
SHUTDOWN_DRAIN_MS = 3000
LOAD_RETRY_MS = 1000
# Rows per load_offsets page; halved while the writer answers TOO_LARGE (a row may
# carry up to 1,000 hole ranges, about 11 KB: a full page of those is over the header limit).
LOAD_PAGE_ROWS = 2000
WRITER_SILENT_MS = 3000
REQUEST_TIMEOUT_MS = 5000
# A reset is answered once the writer has its new offsets on disk; past this
# (shorter than a client's default 5 s request timeout, so it sees why),
# the client gets UNAVAILABLE (the reset stays in effect and may still land).
RESET_DURABLE_TIMEOUT_MS = 4_000
# Bytes of stored batches one key-hash fetch reads (key_shared groups).
KEY_FETCH_BYTES = 1 << 20
GROUP_OPS = {"join", "heartbeat", "leave", "poll", "ack", "nack", "extend", "reject", "list_groups",
             "describe_group", "configure_group", "reset_group", "list_quarantine", "release_key",
             "delete_group"}
# What hello says this coordinator supports (PROTOCOL.md, hello).
FEATURES = ["key_shared", "replication", "cluster"]
# Requests that arrive before a term can serve them (its metadata still loading, or no lease
# answer yet) wait at most this long, and at most this many: shorter than a client's 5 s
# request timeout, so it hears why.
PARK_MAX_MS = 4_000
MAX_PARKED = 10_000
# Served by a node whatever its role: its own commit writer's reports.
ANY_ROLE_OPS = {"writer_status"}
# Admin operations the shell serves itself, one method each (named like the op).
ADMIN_SHELL_OPS = {"alter_topic", "delete_topic"}


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class MetaFiles:
    """Topic placement and group configs, as msgpack files written atomically."""

    def __init__(self, data_dir: Path) -> None:
        self.topics_path = data_dir / "meta" / "topics.msgpack"
        self.groups_path = data_dir / "meta" / "groups.msgpack"

    def load(self, path: Path) -> Any:
        if not path.exists():
            return None
        return codec.unpack_value(path.read_bytes())

    def save(self, path: Path, value: Any) -> None:
        _atomic_write(path, codec.pack_value(value))


class Outbound:
    """Requests this actor sends to other actors, matched to replies by peer, op and id.

    A reply counts only if it comes from the peer that was asked and names the
    op that was sent; anything else is dropped. Callbacks get the reply, or
    None when it timed out (or its handling failed), and must treat None as
    "try again later".
    """

    def __init__(self, log: Any, first_id: int = 1) -> None:
        self.log = log
        # The shell starts each incarnation's ids above any an earlier one used: the commit
        # writer keeps requests waiting across a coordinator restart and answers them on the
        # new connection, and a reply to the old coordinator's id must match nothing here.
        self._ids = itertools.count(first_id)
        self.pending: dict[int, tuple[int, bytes, str, Callable[[codec.Envelope | None], None]]] = {}

    def new(self, now_ms: int, peer: bytes, op: str, on_reply: Callable[[codec.Envelope | None], None]) -> int:
        corr = next(self._ids)
        self.pending[corr] = (now_ms + REQUEST_TIMEOUT_MS, peer, op, on_reply)
        return corr

    def resolve(self, peer: bytes, env: codec.Envelope) -> None:
        entry = self.pending.get(env.corr_id) if isinstance(env.corr_id, int) else None
        if entry is None or entry[1] != peer or (env.op is not None and env.op != entry[2]):
            self.log.warning("reply.unexpected", peer=peer.decode(errors="replace"), op=env.op)
            return
        del self.pending[env.corr_id]
        self._call(entry[3], env)

    def expire(self, now_ms: int) -> None:
        expired = [c for c, entry in self.pending.items() if entry[0] <= now_ms]
        for corr in expired:
            self._call(self.pending.pop(corr)[3], None)

    def _call(self, callback: Callable[[codec.Envelope | None], None], env: codec.Envelope | None) -> None:
        try:
            callback(env)
        except Exception:
            self.log.exception("reply.handling_failed", op=None if env is None else env.op)
            if env is not None:
                try:
                    callback(None)
                except Exception:
                    self.log.exception("reply.handling_failed", op=None)


class CoordinatorShell:
    def __init__(self, router: zmq.Socket, internal: zmq.Socket, data_dir: Path, log: Any,
                 acl: security.Acl | None = None, *, unclean_leader_election: bool = False,
                 cluster: bool = False, lease_ms: int = 5000, node_id: str | None = None) -> None:
        self.router = router  # clients
        self.internal = internal  # the broker's own actors: partition logs and the commit writer
        self.acl = acl
        self.internal_endpoint: str | None = None
        self.endpoint: str | None = None  # set once bound
        self.log = log
        self.meta = MetaFiles(data_dir)
        self.unclean_leader_election = unclean_leader_election
        # With PostgreSQL the node is one of a cluster: it leads only while it holds the lease
        # (leadership.py). With SQLite it is a cluster of one and leads from the start.
        self.cluster = cluster
        self.lease_ms = lease_ms
        self.node_id = node_id
        self.leadership: Leadership | None = None
        self.leader: LeaderKnown | None = None
        self.lease_requests: dict[int, int] = {}  # outbound corr id -> leadership request id
        self.epoch: int | None = None  # the term this node leads in; None: standing by
        # The term this node stood down from with its state kept: resumed if the next lease
        # it takes is the very next epoch (nobody led in between), rebuilt otherwise.
        self.dormant_epoch: int | None = None
        # Requests that came before this term could serve them (metadata still loading, or
        # no lease answer yet): served, or answered, once it can. (arrival ms, identity, env, sock)
        self.parked: list[tuple[int, bytes, codec.Envelope, zmq.Socket | None]] = []
        self.writer: dict[str, Any] = {"pid": None, "healthy": False, "metrics": {}, "last_seen_ms": None}
        self.writer_fenced_pid: int | None = None  # the writer pid that has answered a held lease ask
        self.dead_letter_producer_id = random.getrandbits(62) | 1
        # Lease asks outlive terms (a standby's ask is what starts one), so they have their own.
        self.lease_outbound = Outbound(log, first_id=(time.time_ns() // 1_000_000) << 20)
        self._term_state(None)
        if not cluster:
            self.start_term(SINGLE_NODE_EPOCH, runtime.now_ms())

    def _term_state(self, epoch: int | None) -> None:
        """Everything a term holds in memory, fresh: what a takeover (or a start) rebuilds
        from the store. Nothing of a previous term survives into the next one."""
        self.topics = TopicRegistry(unclean_leader_election=self.unclean_leader_election,
                                    coordinator_epoch=epoch or SINGLE_NODE_EPOCH)
        # Lease ids must never repeat across coordinator incarnations or terms: a stale ack
        # from before a restart (or a failover) must not match a lease handed out after it.
        base = (time.time_ns() // 1_000_000) << 20
        self.core = GroupCoordinatorCore(lease_id_base=base)
        self.group_configs: dict[str, dict] = {}  # from the store, with the topics
        # Correlation ids, like lease ids, never repeat across incarnations (see Outbound).
        self.outbound = Outbound(self.log, first_id=base)
        self.stored = StoredMetadata()
        self.metadata_loading = False
        self.next_metadata_ms = 0
        self.ready = False  # metadata loaded: topic and actor requests are served
        self.offsets_loaded = False
        self.next_load_ms = 0
        self.load_in_flight = False
        self.loaded_rows: list[tuple] = []
        self.load_after: list | None = None  # the key the next page starts after
        self.load_page_rows = LOAD_PAGE_ROWS
        self.unconfirmed: dict[tuple[str, str, int], list] = {}  # newest advance per key not yet durable
        self.to_send: dict[tuple[str, str, int], list] = {}
        self.last_advance_sent_ms = 0
        self.last_resend_ms = 0
        self.dead_letter_seq: dict[tuple[str, int], int] = {}
        # Dead-letter topic -> the copies waiting for the one in progress (start_dead_letter).
        self.dead_letter_queues: dict[str, collections.deque] = {}
        self.dead_letter_copying: set[str] = set()
        # A dead-letter topic's max_batch_bytes, from its TOO_LARGE refusals: how much of a
        # record a copy without its value may keep (see dead_letter_payload).
        self.dead_letter_limits: dict[str, int] = {}
        # (dead_lettering_id, offset) -> the record whose full copy was refused, while the core answers.
        self.refused_copies: dict[tuple[int, int], Any] = {}
        self.open_polls: set[int] = set()
        self.tokens: dict[int, runtime.RouterToken] = {}
        # reset_group replies held until durable: token key -> (group, topic, reply, give up at)
        self.reset_requests: dict[int, tuple[str, str]] = {}
        self.held_resets: dict[int, tuple[str, str, m.ResetGroupReply, int]] = {}
        # delete_topic replies held until the files are gone and the tombstones durable:
        # token key -> (its reply, give up at)
        self.held_deletes: dict[int, tuple[m.DeleteTopicReply, int]] = {}

    # -- terms: leading, standing by --------------------------------------------------------

    def start_term(self, epoch: int, now: int) -> None:
        """Lead at `epoch`: everything in memory is rebuilt from the store (topics and replica
        state, then committed offsets with their holes); partition actors are relearnt as
        they re-register. Requests wait (`parked`) until the metadata is loaded."""
        if self.dormant_epoch is not None and epoch == self.dormant_epoch + 1:
            # Epochs grow by one at every take: this node took the one after its own, so
            # no other node led in between and the store holds nothing this memory lacks
            # (a database outage longer than the lease, with this node the only one).
            self.log.info("coordinator.resumed", epoch=epoch, previous_epoch=self.dormant_epoch)
            self.topics.coordinator_epoch = epoch
            self.to_send.update(self.unconfirmed)  # the writer dropped them with the old epoch
        else:
            self._term_state(epoch)
            self.log.info("coordinator.leading", epoch=epoch, node_id=self.node_id)
        self.dormant_epoch = None
        self.epoch = epoch
        self.pump_metadata(now)

    def end_term(self, reason: str, now: int) -> None:
        """Stop leading now: whatever waits for this term is answered NOT_COORDINATOR, and
        its in-memory leases end (their records are redelivered by the next leader)."""
        if self.epoch is None:
            return
        epoch, self.epoch = self.epoch, None
        self.log.warning("coordinator.standing_by", epoch=epoch, reason=reason)
        error = self.not_coordinator()
        for key in list(self.tokens):
            self.reply_error(self.tokens.pop(key), error)
        for key in list(self.open_polls):
            self.core.cancel_parked(key)
        self.open_polls.clear()
        self.reset_requests.clear()
        self.held_resets.clear()
        self.answer_parked(now)
        # Kept, not served, until the next term says whether it may go on (start_term).
        self.dormant_epoch = epoch

    def not_coordinator(self) -> NotCoordinator:
        leader = self.leader
        if leader is None or leader.node_id is None or (self.epoch is not None and leader.node_id == self.node_id):
            data = None
        else:
            data = {"endpoint": leader.endpoint, "node_id": leader.node_id, "epoch": leader.epoch}
        return NotCoordinator("this node's coordinator stands by; another node leads the cluster"
                              if data else "no node leads the cluster yet", leader=data)

    def leading(self, now: int) -> bool:
        """May this node act as leader now? A leader past its local deadline steps down first."""
        if self.leadership is not None and self.epoch is not None and not self.leadership.acting(now):
            self.apply_leadership(self.leadership.on_tick(now), now)
        return self.epoch is not None

    def tick_leadership(self, now: int) -> None:
        if not self.cluster:
            return
        if self.leadership is None:
            if self.endpoint is None:
                return  # not bound yet: nothing to advertise
            self.leadership = Leadership(self.node_id or self.endpoint, self.endpoint,
                                         LeadershipConfig(lease_ms=self.lease_ms))
        self.apply_leadership(self.leadership.on_tick(now), now)

    def apply_leadership(self, effects: list, now: int) -> None:
        for effect in effects:
            if isinstance(effect, RenewLease):
                corr = self.lease_outbound.new(now, WRITER_IDENTITY, "coordinator_lease",
                                               lambda env, rid=effect.request_id: self.on_lease_reply(rid, env))
                runtime.send_reply(self.internal, WRITER_IDENTITY, codec.encode_request(
                    m.CoordinatorLease(node_id=effect.node_id, endpoint=effect.endpoint,
                                       lease_ms=effect.lease_ms), corr))
            elif isinstance(effect, LeaderKnown):
                if self.leader is None or (effect.node_id, effect.epoch) != (self.leader.node_id, self.leader.epoch):
                    self.log.info("coordinator.leader_known", leader=effect.node_id, endpoint=effect.endpoint,
                                  epoch=effect.epoch)
                self.leader = effect
            elif isinstance(effect, BecomeLeader):
                self.start_term(effect.epoch, now)
            elif isinstance(effect, StepDown):
                self.end_term(effect.reason, now)

    def on_lease_reply(self, request_id: int, env: codec.Envelope | None) -> None:
        assert self.leadership is not None
        now = runtime.now_ms()
        if env is None or env.error is not None or env.msg is None:
            if env is not None and env.error is not None:
                self.log.warning("coordinator.lease_failed", reason=env.error.message, code=env.error.code.value)
            self.apply_leadership(self.leadership.on_lease_failed(request_id, now), now)
        else:
            msg = env.msg
            lease = LeaseState(msg.holder, msg.holder_endpoint, msg.epoch, msg.held, msg.remaining_ms)
            if msg.held:
                self.writer_fenced_pid = self.writer["pid"]
            self.apply_leadership(self.leadership.on_lease_answer(request_id, lease, now), now)
        if self.epoch is None and self.leader is not None:
            self.answer_parked(now)

    def park(self, identity: bytes, env: codec.Envelope, now: int, sock: zmq.Socket | None) -> None:
        if len(self.parked) >= MAX_PARKED:
            runtime.send_reply(sock or self.router, identity, codec.encode_error(env.op, env.corr_id, Unavailable(
                "the coordinator is starting and holds too many requests; retry")))
            return
        self.parked.append((now, identity, env, sock))

    def answer_parked(self, now: int, expired_only: bool = False) -> None:
        """Serve what was parked (this term is ready), or refuse it (no term, or it waited too long)."""
        if not self.parked:
            return
        keep, parked = [], self.parked
        self.parked = []
        for arrived, identity, env, sock in parked:
            if expired_only and now - arrived < PARK_MAX_MS:
                keep.append((arrived, identity, env, sock))
            elif self.epoch is not None and self.ready and not expired_only:
                self.on_request(identity, env, now, sock)
            elif env.op not in m.TELLS:
                error = Unavailable("the coordinator is still loading its metadata; retry") \
                    if self.epoch is not None else self.not_coordinator()
                runtime.send_reply(sock or self.router, identity, codec.encode_error(env.op, env.corr_id, error))
        self.parked = keep + self.parked

    # -- metadata in the store -------------------------------------------------------------

    def pump_metadata(self, now: int) -> None:
        """Load the store's metadata once per term, then send its queued writes, one at a time."""
        if self.epoch is None or self.metadata_loading or now < self.next_metadata_ms:
            return
        if not self.stored.loaded:
            if self.writer["last_seen_ms"] is None:
                return  # asked once the writer has said it is there
            self.metadata_loading = True
            self.request(WRITER_IDENTITY, m.LoadMetadata(), now, self.on_metadata_loaded)
            return
        item = self.stored.next_to_send(self.topics)
        if item is None:
            return
        assert item.changes is not None
        self.metadata_loading = True
        self.request(WRITER_IDENTITY, m.WriteMetadata(coordinator_epoch=self.epoch, **item.changes.to_wire()), now,
                     lambda env, item=item: self.on_metadata_written(item, env))

    def on_metadata_loaded(self, env: codec.Envelope | None) -> None:
        self.metadata_loading = False
        now = runtime.now_ms()
        if env is None or env.error is not None or env.msg is None:
            self.next_metadata_ms = now + LOAD_RETRY_MS
            self.log.warning("metadata.load_failed", reason=None if env is None or env.error is None
                             else env.error.message)
            return
        meta = metadata_from_wire(env.msg.topics, env.msg.partitions, env.msg.group_configs)
        self.stored.on_loaded(meta)
        legacy = self.meta.load(self.meta.topics_path) if self.meta.topics_path.exists() else None
        if legacy and not meta.topics:
            # A deployment from before topic metadata moved into the store: its file is
            # written into the store once, then renamed so that it is never read again.
            self.topics.restore(legacy)
            changes = self.stored.migration_changes(legacy)
            self.stored.queue.append(Pending(changes=changes))
            self.stored.when_durable(lambda ok: ok and self.retire_topics_file(len(changes.create_topics)))
        else:
            self.topics.restore(snapshot_from_store(meta))
            if legacy is not None:
                self.retire_topics_file(0)
        for name, topic in self.topics.topics.items():
            self.core.set_topic(name, topic["partitions"])
        self.restore_group_configs(meta.group_configs)
        self.ready = True
        self.log.info("metadata.loaded", topics=len(self.topics.topics), epoch=self.epoch)
        self.answer_parked(now)
        self.pump_metadata(now)
        self.pump_writer(now)

    def restore_group_configs(self, stored: dict[str, dict]) -> None:
        """Group configs from the store; a groups.msgpack from before goes into it once."""
        legacy = self.meta.load(self.meta.groups_path) if self.meta.groups_path.exists() else None
        configs = dict(stored)
        if legacy and not stored:
            configs = dict(legacy)
            self.stored.write(MetadataChanges(group_configs=tuple(sorted(configs.items()))))
            self.stored.when_durable(lambda ok: ok and self.retire_file(self.meta.groups_path, len(configs)))
        elif legacy is not None:
            self.retire_file(self.meta.groups_path, 0)
        self.group_configs = configs
        for group, config in configs.items():
            self.core.restore_group_config(group, GroupConfig.from_dict(config))

    def retire_topics_file(self, migrated: int) -> None:
        self.retire_file(self.meta.topics_path, migrated)

    def retire_file(self, path: Path, migrated: int) -> None:
        """A metadata file now in the store: renamed, never read again."""
        os.replace(path, path.with_name(path.name + ".migrated"))
        self.log.info("metadata.migrated_from_file", entries=migrated, file=str(path))

    def on_metadata_written(self, item: Pending, env: codec.Envelope | None) -> None:
        self.metadata_loading = False
        now = runtime.now_ms()
        if env is None or env.error is not None or env.msg is None:
            # Unknown outcome (no answer, the store failing): the same change set goes again.
            self.log.warning("metadata.write_failed", reason=None if env is None or env.error is None
                             else env.error.message)
            self.stored.resend()
            self.next_metadata_ms = now + LOAD_RETRY_MS
            return
        if not env.msg.applied and item.attempts > 1:
            # A retry refused: the first attempt may have landed after all. Read the store.
            self.metadata_loading = True

            def verify(reload: codec.Envelope | None) -> None:
                self.metadata_loading = False
                if reload is None or reload.error is not None or reload.msg is None:
                    self.stored.resend()
                    self.next_metadata_ms = runtime.now_ms() + LOAD_RETRY_MS
                    return
                assert item.changes is not None
                landed = self.stored.already_applied(item.changes, metadata_from_wire(
                    reload.msg.topics, reload.msg.partitions, reload.msg.group_configs))
                self.finish_metadata_write(landed, runtime.now_ms())

            self.request(WRITER_IDENTITY, m.LoadMetadata(), now, verify)
            return
        self.finish_metadata_write(env.msg.applied, now)

    def finish_metadata_write(self, applied: bool, now: int) -> None:
        if not applied:
            self.log.error("metadata.write_refused", epoch=self.epoch,
                           reason="the store holds other metadata than this coordinator (or its epoch is over)")
        self.stored.on_written(applied)
        if not applied and self.epoch is not None:
            # What this term holds in memory is not what the store holds: start the term over
            # from the store (a refused epoch ends it at the next lease answer anyway).
            epoch = self.epoch
            self.end_term("a metadata write was refused", now)
            self.start_term(epoch, now)
            return
        self.pump_metadata(now)

    # -- inbound ----------------------------------------------------------------------------

    def on_internal_message(self, identity: bytes, frames: list, now: int) -> None:
        """From a partition actor or the commit writer, on the internal endpoint."""
        try:
            is_reply, env = codec.decode_any(frames)
        except ProtocolError as err:
            self.log.warning("actor.bad_frame", peer=identity.decode(errors="replace"), reason=err.message,
                             op=err.op)
            if err.op not in m.TELLS:  # a tell is never answered, not even with an error (PROTOCOL.md s.16)
                runtime.send_reply(self.internal, identity, codec.encode_error(err.op, err.corr_id, err))
            return
        if is_reply:
            (self.lease_outbound if env.op == "coordinator_lease" else self.outbound).resolve(identity, env)
            return
        self.on_request(identity, env, now, sock=self.internal)

    def on_client_message(self, identity: bytes, frames: list, now: int, user: str | None) -> None:
        env, error = runtime.decode_or_error(frames, self.log)
        if error is not None:
            runtime.send_reply(self.router, identity, error)
            return
        try:
            if env.op in security.INTERNAL_OPS:
                # Actors speak on the internal endpoint; here anyone could claim to be one.
                raise Unauthorized(f"{env.op!r} is only served on the internal endpoint", op=env.op)
            if self.acl is not None:
                self.acl.check(user, env.op, env.msg)
        except ZBrokerError as err:
            self.log.warning("auth.denied", op=env.op, reason=err.message, data=err.data)
            self.reply_error(runtime.RouterToken(identity, env.corr_id, env.op), err)
            return
        self.on_request(identity, env, now)

    def on_request(self, identity: bytes, env: codec.Envelope, now: int, sock: zmq.Socket | None = None) -> None:
        token = runtime.RouterToken(identity, env.corr_id, env.op, sock)
        op, msg = env.op, env.msg
        if op not in ANY_ROLE_OPS:
            if not self.leading(now):
                if self.cluster and self.leader is None:
                    self.park(identity, env, now, sock)  # the first lease answer says who leads
                elif op not in m.TELLS:
                    self.reply_error(token, self.not_coordinator())
                return
            if not self.ready and op != "hello":
                self.park(identity, env, now, sock)
                return
        try:
            if op in GROUP_OPS:
                self.group_request(token, op, msg, now)
            elif op == "register":
                self.apply(self.topics.register(msg.actor_id, msg.endpoint, msg.storage_id, msg.pid,
                                                msg.partitions, now, msg.not_open, msg.not_open_count,
                                                rack=msg.rack, replica_states=msg.replica_states), now)
                self.feed_ranges(self.topics.on_report(msg.actor_id, msg.partitions, now), now)
                self.reply(token, m.RegisterReply(assignment=self.topics.assignment_for(msg.actor_id),
                                                  replicas=self.topics.replicas_for(msg.actor_id),
                                                  coordinator_epoch=self.topics.coordinator_epoch))
            elif op == "report":
                self.feed_ranges(self.topics.on_report(msg.actor_id, msg.partitions, now), now)
                if msg.replica_states:
                    self.topics.on_replica_states(msg.actor_id, msg.replica_states)
            elif op == "alter_isr":
                # Only on the internal endpoint, whose routing ids cannot be taken over: the
                # identity says which actor proposes.
                sender = identity.decode(errors="replace").removeprefix("partition:")
                self.apply(self.topics.alter_isr(sender, msg.topic, msg.partition, msg.leader_epoch, msg.isr,
                                                 self.hold(token)), now)
            elif op == "reassign_partition":
                self.apply(self.topics.reassign(msg.topic, msg.partition, msg.replicas, self.hold(token)), now)
            elif op == "deregister":
                self.apply(self.topics.deregister(msg.actor_id, msg.pid, now), now)
            elif op == "writer_status":
                self.on_writer_status(msg, now)
            elif op == "hello":
                self.reply(token, m.HelloReply(version=m.PROTOCOL_VERSION, server="zbroker",
                                               actor="group-coordinator",
                                               limits={"max_header_bytes": codec.MAX_HEADER_BYTES},
                                               features=list(FEATURES),
                                               internal_endpoint=self.internal_endpoint))
            elif op == "metadata":
                self.reply(token, m.MetadataReply(topics=self.topics.metadata(msg.topics)))
            elif op == "list_topics":
                self.reply(token, m.ListTopicsReply(topics=sorted(self.topics.topics)))
            elif op == "describe_topic":
                self.reply(token, m.DescribeTopicReply(topic=msg.topic, partitions=self.topics.describe(msg.topic),
                                                       config=self.topics.require_topic(msg.topic)["config"]))
            elif op == "create_topic":
                if msg.replication_factor == 1 and msg.min_insync in (None, 1):
                    self.create_topic(msg.topic, msg.partitions, msg.config, now)
                    self.reply_when_durable(token, m.CreateTopicReply(topic=msg.topic, partitions=msg.partitions))
                else:  # answered once its placement is durable
                    self.create_topic(msg.topic, msg.partitions, msg.config, now,
                                      replication_factor=msg.replication_factor, min_insync=msg.min_insync,
                                      token=self.hold(token))
            elif op == "status":
                under = self.topics.replication_status()
                self.reply(token, m.StatusReply(actors=self.status(now), under_replicated=under,
                                                healthy=self.healthy(now)
                                                and not any(u["below_min_insync"] for u in under)))
            elif op in ADMIN_SHELL_OPS:
                getattr(self, op)(token, msg, now)
            else:
                raise UnknownOp(f"op {op!r} is not served by the coordinator", op=op)
        except ZBrokerError as err:
            self.tokens.pop(id(token), None)  # refused before any effect could answer it
            if op in m.TELLS and sock is self.internal:
                self.log.warning("actor.tell_refused", op=op, code=err.code.value, reason=err.message)
            else:
                self.reply_error(token, err)
        except OSError:
            self.log.exception("meta.io_error", op=op)
            raise
        except Exception as exc:
            # A bug must cost one request, not the coordinator (nor leave its token behind).
            self.tokens.pop(id(token), None)
            self.reset_requests.pop(id(token), None)
            self.open_polls.discard(id(token))
            self.log.exception("request.internal_error", op=op)
            self.reply_error(token, ZBrokerError(f"internal error: {type(exc).__name__}", code=ErrorCode.INTERNAL))

    def group_request(self, token: runtime.RouterToken, op: str, msg: m.Message, now: int,
                      targets: dict[int, int] | None = None) -> None:
        if op == "reset_group" and msg.to_time_ms is not None and targets is None:
            self.reset_group_by_time(token, msg, now)
            return
        key = id(token)
        self.tokens[key] = token
        if op == "poll":
            self.open_polls.add(key)
        elif op == "reset_group":
            self.reset_requests[key] = (msg.group, msg.topic)
        if targets is not None:
            self.apply(self.core.reset_group(key, msg, now, targets), now)
            return
        handler = getattr(self.core, op)
        self.apply(handler(key, msg, now), now)

    def reset_group_by_time(self, token: runtime.RouterToken, msg: m.ResetGroup, now: int) -> None:
        """`reset_group` with `to_time_ms`: the partition actors hold the batches' append
        times, so each is asked where the time falls (`offset_for_time`); the reset itself
        then runs in the core like any other, with those offsets."""
        count = self.topics.partition_count(msg.topic)
        owners = {p: self.topics.partitions[(msg.topic, p)].owner for p in range(count)}
        unplaced = [p for p, owner in owners.items() if self.topics.endpoint_of(msg.topic, p) is None]
        if unplaced:
            raise Unavailable(f"{msg.topic}/{unplaced[0]} has no live partition actor", topic=msg.topic,
                              partition=unplaced[0])
        targets: dict[int, int] = {}
        outcome: list = []  # holds the first failure: the request is answered once

        def on_reply(partition: int, env: codec.Envelope | None) -> None:
            if outcome:
                return
            if env is None or env.error is not None or env.msg is None:
                outcome.append(env)
                self.reply_error(token, env.error if env is not None and env.error is not None else Unavailable(
                    f"no answer from the actor of {msg.topic}/{partition}", topic=msg.topic, partition=partition))
                return
            targets[partition] = env.msg.offset
            if len(targets) == count:
                outcome.append(env)
                self.group_request(token, "reset_group", msg, runtime.now_ms(), targets)

        for p, owner in owners.items():
            self.request(f"partition:{owner}".encode(), m.OffsetForTime(topic=msg.topic, partition=p,
                                                                         time_ms=msg.to_time_ms),
                         now, lambda env, p=p: on_reply(p, env))

    def hold(self, token: runtime.RouterToken) -> int:
        """A token the cores answer later through an `fx.Reply` effect."""
        self.tokens[id(token)] = token
        return id(token)

    def create_topic(self, name: str, partitions: int, config: dict | None, now: int, **replication: Any) -> None:
        try:
            effects = self.topics.create_topic(name, partitions, config, now, **replication)
        except ZBrokerError:
            if replication.get("token") is not None:
                self.tokens.pop(replication["token"], None)
            raise
        self.apply(effects, now)
        if self.offsets_loaded:  # offsets stored under the name before (a deletion cut short) do not carry over
            self.apply(self.core.forget_topic(name, now), now)
        self.core.set_topic(name, partitions)
        self.log.info("topic.created", topic=name, partitions=partitions)

    # -- admin operations (PROTOCOL.md s.8.5) --------------------------------------------

    def alter_topic(self, token: runtime.RouterToken, msg: m.AlterTopic, now: int) -> None:
        changes = {k: v for k, v in (("retention_ms", msg.retention_ms), ("retention_bytes", msg.retention_bytes))
                   if v is not None}
        self.apply(self.topics.alter_topic(msg.topic, msg.partitions, changes, now), now)
        topic = self.topics.require_topic(msg.topic)
        self.core.set_topic(msg.topic, topic["partitions"])
        self.log.info("topic.altered", topic=msg.topic, partitions=topic["partitions"], **changes)
        self.reply_when_durable(token, m.AlterTopicReply(topic=msg.topic, partitions=topic["partitions"],
                                                         config=topic["config"]))

    def reply_when_durable(self, token: runtime.RouterToken, msg: m.Message) -> None:
        """Answer once what the request changed is in the store (durable before acknowledged)."""
        key = self.hold(token)

        def answer(applied: bool) -> None:
            held = self.tokens.pop(key, None)
            if held is None:
                return
            if applied:
                self.reply(held, msg)
            else:
                self.reply_error(held, Unavailable("the store refused this change (another coordinator "
                                                   "may have taken over); retry", op=token.op))
        self.stored.when_durable(answer)

    def delete_topic(self, token: runtime.RouterToken, msg: m.DeleteTopic, now: int) -> None:
        """Refused while live members consume it; otherwise the topic goes from the registry,
        its groups' offsets get tombstones, and the partition actors delete the files. The
        reply waits for both (up to RESET_DURABLE_TIMEOUT_MS; then it lists what is pending)."""
        topic = self.topics.require_topic(msg.topic)
        if not self.offsets_loaded:
            raise Unavailable("the group coordinator is still loading stored offsets", op=msg.op)
        consumers = self.core.consumers_of(msg.topic)
        if consumers:
            raise TopicInUse(f"topic {msg.topic!r} is consumed by live members of {len(consumers)} group(s) "
                             f"({', '.join(sorted(consumers))}); stop them first", topic=msg.topic,
                             groups=sorted(consumers))
        partitions = topic["partitions"]
        groups = sorted(self.core.groups_on_topic(msg.topic))
        self.apply(self.topics.delete_topic(msg.topic, now), now)
        self.apply(self.core.forget_topic(msg.topic, now), now)
        for key in [k for k in self.dead_letter_seq if k[0] == msg.topic]:
            del self.dead_letter_seq[key]
        self.log.info("topic.deleted", topic=msg.topic, partitions=partitions, groups=groups)
        self.held_deletes[self.hold(token)] = (m.DeleteTopicReply(topic=msg.topic, partitions=partitions,
                                                                  groups=groups),
                                               now + RESET_DURABLE_TIMEOUT_MS)
        self.release_deletes(now)

    def release_deletes(self, now: int) -> None:
        for key, (reply, give_up_at) in list(self.held_deletes.items()):
            pending = self.topics.pending_deletion(reply.topic)
            durable = not any(k[1] == reply.topic for k in self.unconfirmed)
            if (pending or not durable) and now < give_up_at:
                continue
            del self.held_deletes[key]
            if durable:
                reply.pending = pending
                self.reply(self.tokens.pop(key), reply)
            else:
                self.reply_error(self.tokens.pop(key), Unavailable(
                    "the topic is deleted but the commit writer has not made the removal of its offsets "
                    "durable yet", topic=reply.topic))

    def on_partitions_deleted(self, actor_id: str, env: codec.Envelope | None, now: int) -> None:
        if env is None or env.error is not None or env.msg is None:
            return  # asked again after DELETE_RESEND_MS
        for topic, partition, reason in env.msg.failed:
            self.log.warning("topic.partition_not_deleted", actor_id=actor_id, topic=topic, partition=partition,
                             reason=reason)
        self.apply(self.topics.on_partitions_deleted(actor_id, env.msg.deleted), now)
        self.release_deletes(now)

    def feed_ranges(self, ranges: list, now: int) -> None:
        for topic, partition, start, end in ranges:
            self.apply(self.core.on_log_range(topic, partition, start, end, now), now)

    # -- effects ----------------------------------------------------------------------------

    def apply(self, effects: list, now: int) -> None:
        for effect in effects:
            if isinstance(effect, fx.Reply):
                reset = self.reset_requests.pop(effect.token, None)
                if reset is not None:
                    # Acknowledging a reset that a crash could still undo would be a lie:
                    # the reply waits until the writer reports the new offsets durable.
                    self.held_resets[effect.token] = (*reset, effect.msg, now + RESET_DURABLE_TIMEOUT_MS)
                    continue
                self.reply(self.tokens.pop(effect.token), effect.msg)
                self.open_polls.discard(effect.token)
            elif isinstance(effect, fx.ReplyError):
                self.reset_requests.pop(effect.token, None)
                self.reply_error(self.tokens.pop(effect.token), effect.error)
                self.open_polls.discard(effect.token)
            elif isinstance(effect, fx.PersistOffsets):
                row = effect.as_advance()
                key = (effect.group, effect.topic, effect.partition)
                self.unconfirmed[key] = row
                self.to_send[key] = row
            elif isinstance(effect, fx.DeadLetter):
                self.start_dead_letter(effect, now)
            elif isinstance(effect, fx.FetchKeyHashes):
                self.fetch_key_hashes(effect, now)
            elif isinstance(effect, fx.PersistGroupConfig):
                if effect.config is None:  # delete_group
                    self.group_configs.pop(effect.group, None)
                else:
                    self.group_configs[effect.group] = effect.config
                self.stored.write(MetadataChanges(group_configs=((effect.group, effect.config),)))
                self.pump_metadata(now)
            elif isinstance(effect, fx.Log):
                self.log.info(effect.event, **effect.fields)
            elif isinstance(effect, PersistTopics):
                self.stored.sync()
                self.pump_metadata(now)
            elif isinstance(effect, WriteMetadata):
                # Durable before effective: the decision takes effect once the store has it.
                item = self.stored.decide(effect)
                registry = self.topics
                item.held.append(lambda ok, registry=registry, write_id=effect.write_id:
                                 registry is self.topics and self.apply(
                                     registry.on_metadata_written(write_id, ok, runtime.now_ms()), runtime.now_ms()))
                self.pump_metadata(now)
            elif isinstance(effect, ReloadMetadata):
                pass  # finish_metadata_write starts the term over from the store
            elif isinstance(effect, LogEvent):
                loud = effect.event in ("controller.unclean_election", "controller.partition_offline")
                (self.log.warning if loud else self.log.info)(effect.event, **effect.fields)
            elif isinstance(effect, AssignActor):
                self.stored.sync()  # the placement it carries, if it is new
                self.pump_metadata(now)
                # After what placed it is durable: an actor must not serve a placement a
                # restarted (or another) coordinator would not know.
                registry = self.topics
                self.stored.when_durable(lambda ok, registry=registry, actor=effect.actor_id:
                                         ok and registry is self.topics and self.send_assign(actor, runtime.now_ms()))
            elif isinstance(effect, DeletePartitionsOn):
                self.request(f"partition:{effect.actor_id}".encode(),
                             m.DeletePartitions(partitions=effect.partitions,
                                                coordinator_epoch=self.topics.coordinator_epoch), now,
                             lambda env, a=effect.actor_id: self.on_partitions_deleted(a, env, runtime.now_ms()))
            else:  # pragma: no cover
                raise TypeError(f"unknown effect {effect!r}")

    def reply(self, token: runtime.RouterToken, msg: m.Message) -> None:
        runtime.send_reply(token.sock or self.router, token.identity, codec.encode_reply(msg, token.corr_id))

    def reply_error(self, token: runtime.RouterToken, err: ZBrokerError) -> None:
        runtime.send_reply(token.sock or self.router, token.identity,
                           codec.encode_error(token.op, token.corr_id, err))

    def request(self, identity: bytes, msg: m.Message, now: int, on_reply: Callable,
                frames: tuple = ()) -> None:
        corr = self.outbound.new(now, identity, msg.op, on_reply)
        runtime.send_reply(self.internal, identity, codec.encode_request(msg, corr, frames))

    def send_assign(self, actor_id: str, now: int) -> None:
        assignment = self.topics.assignment_for(actor_id)
        self.log.info("placement.assign", actor_id=actor_id, partitions=[[t, p] for t, p, _c in assignment])
        self.request(f"partition:{actor_id}".encode(),
                     m.Assign(assignment=assignment, replicas=self.topics.replicas_for(actor_id),
                              coordinator_epoch=self.topics.coordinator_epoch), now, lambda env: None)

    # -- commit writer ----------------------------------------------------------------------

    def on_writer_status(self, msg: m.WriterStatus, now: int) -> None:
        restarted = self.writer["pid"] != msg.pid
        self.writer.update(pid=msg.pid, healthy=msg.healthy, metrics=msg.metrics, last_seen_ms=now)
        if restarted:
            self.log.info("writer.seen", pid=msg.pid)
            # Whatever the previous writer had not confirmed may be lost: resend it.
            self.to_send.update(self.unconfirmed)

    def pump_writer(self, now: int) -> None:
        if self.epoch is None or not self.ready:
            return
        if self.cluster and self.writer_fenced_pid != self.writer["pid"]:
            # A writer that has not answered a lease ask since it started would flush
            # unfenced: its first held answer gives it this term's epoch (within a second).
            return
        if not self.offsets_loaded:
            if self.writer["last_seen_ms"] is not None and not self.load_in_flight and now >= self.next_load_ms:
                # After a failure the load goes on from the page that failed: the pages are
                # keyset queries, still valid with a new writer, and starting over could
                # time out on the same page again and again.
                self._request_offsets_page(now)
            return
        if self.unconfirmed and now - self.last_resend_ms > ADVANCE_RESEND_MS:
            # Rows the writer never confirmed (a lost reply, a writer that failed them) go
            # again every few seconds, even while other groups keep advances flowing.
            self.last_resend_ms = now
            for key, row in self.unconfirmed.items():
                self.to_send.setdefault(key, row)
        if not self.to_send or now - self.last_advance_sent_ms < ADVANCE_COALESCE_MS:
            return
        batch, self.to_send = list(self.to_send.values()), {}
        self.last_advance_sent_ms = now
        # Half the header limit per request leaves room for the envelope and any misjudged row.
        for rows in m.split_advances(batch, codec.MAX_HEADER_BYTES // 2):
            self.request(WRITER_IDENTITY, m.Advance(advances=rows), now,
                         lambda env, rows=rows: self.on_advance_reply(env, rows))

    def _request_offsets_page(self, now: int) -> None:
        self.load_in_flight = True
        self.request(WRITER_IDENTITY, m.LoadOffsets(after=self.load_after, limit=self.load_page_rows), now,
                     self.on_offsets_loaded)

    def on_offsets_loaded(self, env: codec.Envelope | None) -> None:
        self.load_in_flight = False
        now = runtime.now_ms()
        if (env is not None and env.error is not None and env.error.code is ErrorCode.TOO_LARGE
                and self.load_page_rows > 1):
            # The page did not fit in a reply: ask for the same page in half as many rows.
            self.load_page_rows = max(1, self.load_page_rows // 2)
            self.log.info("offsets.load_page_smaller", rows=self.load_page_rows)
            self._request_offsets_page(now)
            return
        if env is None or env.error is not None or env.msg is None:
            self.next_load_ms = now + LOAD_RETRY_MS
            self.log.warning("offsets.load_failed", reason=None if env is None or env.error is None
                             else env.error.message)
            return
        self.loaded_rows.extend(tuple(r) for r in env.msg.rows)
        if env.msg.more:
            self.load_after = list(self.loaded_rows[-1][:3])
            self._request_offsets_page(now)
            return
        rows, self.loaded_rows = self.loaded_rows, []
        self.offsets_loaded = True
        self.log.info("offsets.loaded", rows=len(rows))
        # A later term of a cluster took over from a leader whose leases died with it (or
        # with its term): its redeliveries say so.
        reason = "coordinator_failover" if self.cluster and (self.epoch or 0) > 1 else "restart"
        self.apply(self.core.load_offsets(rows, now, reason), now)
        for (topic, partition), part in self.topics.partitions.items():
            if part.owner is not None and part.log_end:
                self.apply(self.core.on_log_range(topic, partition, part.log_start, part.log_end, now), now)

    def on_advance_reply(self, env: codec.Envelope | None, sent_rows: list) -> None:
        if env is None or env.error is not None or env.msg is None:
            return  # resent after ADVANCE_RESEND_MS
        now = runtime.now_ms()
        durable = [tuple(d) for d in env.msg.durable]
        sent = {(row[0], row[1], row[2]): row for row in sent_rows}
        for group, topic, partition, committed, reset_epoch in durable:
            key = (group, topic, partition)
            row = self.unconfirmed.get(key)
            if row is None:
                continue
            # The reply names the offset, not the holes: a newer row with the same offset
            # but more acked ranges above it is confirmed only by the reply to its own request.
            if (reset_epoch, committed) > (row[6], row[3]) or (
                    row is sent.get(key) and (reset_epoch, committed) >= (row[6], row[3])):
                del self.unconfirmed[key]
        self.apply(self.core.on_durable(durable, now), now)
        self.release_resets(now)
        if self.held_deletes:
            self.release_deletes(now)

    def release_resets(self, now: int) -> None:
        """Answer the resets whose offsets are durable, and give up on those past their time."""
        for key, (group, topic, reply, give_up_at) in list(self.held_resets.items()):
            durable = all((self.core.durable_reset_epoch(group, topic, p) or 0) >= reply.reset_epoch
                          for p, _target in reply.partitions)
            if durable:
                del self.held_resets[key]
                self.reply(self.tokens.pop(key), reply)
            elif now >= give_up_at:
                del self.held_resets[key]
                self.reply_error(self.tokens.pop(key), Unavailable(
                    "the reset is applied but the commit writer has not made it durable; retry",
                    group=group, topic=topic, reset_epoch=reply.reset_epoch))

    # -- dead letters -----------------------------------------------------------------------

    def start_dead_letter(self, effect: fx.DeadLetter, now: int) -> None:
        """Copies into one dead-letter topic go one at a time, in the order the core asked
        for them. SEMANTICS.md promises that a released key's records reach the DLQ in
        order; copies made side by side did not keep it when one had to be retried (the
        DLQ topic created on demand had no owner yet for the first copy): CI saw the three
        records of a released key land as r2, r0, r1."""
        self.dead_letter_queues.setdefault(effect.dlq_topic, collections.deque()).append(effect)
        self.next_dead_letter(effect.dlq_topic, now)

    def next_dead_letter(self, dlq_topic: str, now: int) -> None:
        if dlq_topic in self.dead_letter_copying:
            return
        queue = self.dead_letter_queues.get(dlq_topic)
        if not queue:
            self.dead_letter_queues.pop(dlq_topic, None)
            return
        self.dead_letter_copying.add(dlq_topic)
        self.copy_dead_letter(queue.popleft(), now)

    def dead_letter_copied(self, effect: fx.DeadLetter) -> None:
        self.dead_letter_copying.discard(effect.dlq_topic)
        now = runtime.now_ms()
        self.apply(self.core.on_dead_letter_done(effect, now), now)
        self.next_dead_letter(effect.dlq_topic, now)

    def dead_letter_not_copied(self, effect: fx.DeadLetter, error: ZBrokerError | None) -> None:
        """The copies queued behind a failed one fail with it, in order, so that the core's
        retries (one timer each, same deadline, fired in the order set) come back in order."""
        self.dead_letter_copying.discard(effect.dlq_topic)
        behind = list(self.dead_letter_queues.pop(effect.dlq_topic, ()))
        now = runtime.now_ms()
        self.apply(self.core.on_dead_letter_failed(effect, now, error), now)
        for later in behind:
            self.apply(self.core.on_dead_letter_failed(later, now, None), now)
        self.next_dead_letter(effect.dlq_topic, now)

    def copy_dead_letter(self, effect: fx.DeadLetter, now: int) -> None:
        def failed(reason: str, error: ZBrokerError | None = None, *, refused: bool = False) -> None:
            """`refused`: `error` is the dead-letter topic's answer to the copy (the core
            decides on it); otherwise it failed before (fetch, topic creation)."""
            # A retriable error (or no answer) may pass by itself; any other one needs an
            # operator (or is a bug), so it is an error in the log at every retry. A full
            # copy refused TOO_LARGE is the exception: the core has it copied without its value.
            too_large = refused and error is not None and error.code is ErrorCode.TOO_LARGE and not effect.drop_value
            log = self.log.warning if error is None or error.retriable or too_large else self.log.error
            log("dead_letter.too_large" if too_large else "dead_letter.retry", group=effect.group,
                topic=effect.topic, partition=effect.partition, offset=effect.offset, reason=reason,
                code=None if error is None else error.code.value, drop_value=effect.drop_value)
            self.dead_letter_not_copied(effect, error if refused else None)

        # The record whose full copy was just refused: no need to fetch it again.
        # (id, offset): one dead-lettering id covers every record of a range settled together.
        copy_key = (effect.dead_lettering_id, effect.offset)
        refused = self.refused_copies.pop(copy_key, None) if effect.drop_value else None
        if refused is not None:
            self.append_dead_letter(effect, refused, failed)
            return
        owner = self.topics.partitions.get((effect.topic, effect.partition))
        if owner is None or owner.owner is None:
            failed("source partition has no owner")
            return
        if effect.dlq_topic not in self.topics.topics:
            try:
                self.create_topic(effect.dlq_topic, 1, None, now)
            except TopicExists:
                pass
            except ZBrokerError as err:
                # A name the broker refuses (a configuration from an older version): the
                # record stays dead-lettering and is retried, and the error is in the log.
                failed(f"cannot create the dead-letter topic {effect.dlq_topic!r}: {err.message}", err)
                return

        def on_fetched(env: codec.Envelope | None) -> None:
            if env is None or env.error is not None:
                failed("fetch failed" if env is None else env.error.message, None if env is None else env.error)
                return
            records = decode_fetched(env.frames[0] if env.frames else b"", effect.topic, effect.partition,
                                     from_offset=effect.offset, until_offset=effect.offset + 1)
            if not records:
                # Gone through retention: nothing left to copy, the record is finished.
                self.log.warning("dead_letter.source_gone", topic=effect.topic, partition=effect.partition,
                                 offset=effect.offset)
                self.dead_letter_copied(effect)
                return
            self.append_dead_letter(effect, records[0], failed)

        self.request(f"partition:{owner.owner}".encode(),
                     m.Fetch(topic=effect.topic, partition=effect.partition, offset=effect.offset,
                             max_bytes=1 << 20), now, on_fetched)

    def fetch_key_hashes(self, effect: fx.FetchKeyHashes, now: int) -> None:
        """Read the stored batches from `effect.start` and give the core their key hashes.
        A plain fetch, so any partition actor serves it; hashing here keeps the core free
        of record bytes (docs/SEMANTICS.md, key_shared)."""
        def answer(first: int | None, hashes: list[int] | None) -> None:
            now = runtime.now_ms()
            self.apply(self.core.on_key_hashes(effect, first, hashes, now), now)

        owner = self.topics.partitions.get((effect.topic, effect.partition))
        if owner is None or owner.owner is None:
            answer(None, None)
            return

        def on_fetched(env: codec.Envelope | None) -> None:
            if env is None or env.error is not None:
                answer(None, None)
                return
            try:
                answer(*key_hashes(env.frames[0] if env.frames else b"", effect.start))
            except ZBrokerError as err:  # a corrupt batch: logged, and asked again later
                self.log.warning("key_hashes.failed", topic=effect.topic, partition=effect.partition,
                                 offset=effect.start, reason=err.message)
                answer(None, None)

        self.request(f"partition:{owner.owner}".encode(),
                     m.Fetch(topic=effect.topic, partition=effect.partition, offset=effect.start,
                             max_bytes=KEY_FETCH_BYTES), now, on_fetched)

    def dead_letter_payload(self, effect: fx.DeadLetter, rec: Any) -> bytes:
        """The batch that copies `rec` to the dead-letter topic, with provenance headers.

        With `effect.drop_value` the value is empty (its size is in
        `zb-dlq-value-dropped`); if the copy would still exceed the dead-letter
        partition's max_batch_bytes (learnt from its TOO_LARGE refusal), the original
        headers are left out too, then the key, each replaced by a header with its size.
        """
        provenance = {
            "zb-dlq-source-topic": effect.topic.encode(),
            "zb-dlq-source-partition": str(effect.partition).encode(),
            "zb-dlq-source-offset": str(effect.offset).encode(),
            "zb-dlq-attempts": str(effect.attempts).encode(),
            "zb-dlq-reason": str(effect.last_reason).encode(),
            "zb-dlq-group": effect.group.encode(),
        }
        if not effect.drop_value:
            return encode_records([[rec.timestamp_ms, rec.key, rec.value, {**(rec.headers or {}), **provenance}]])
        provenance["zb-dlq-value-dropped"] = str(len(rec.value or b"")).encode()
        limit = self.dead_letter_limits.get(effect.dlq_topic)
        key = rec.key
        payload = encode_records([[rec.timestamp_ms, key, b"", {**(rec.headers or {}), **provenance}]])
        if limit is not None and len(payload) > limit and rec.headers:
            provenance["zb-dlq-headers-dropped"] = str(len(rec.headers)).encode()
            payload = encode_records([[rec.timestamp_ms, key, b"", provenance]])
        if limit is not None and len(payload) > limit and key is not None:
            provenance["zb-dlq-key-dropped"] = str(len(key)).encode()
            payload = encode_records([[rec.timestamp_ms, None, b"", provenance]])
        return payload

    def append_dead_letter(self, effect: fx.DeadLetter, rec: Any, failed: Callable) -> None:
        now = runtime.now_ms()
        dlq = self.topics.partitions.get((effect.dlq_topic, 0))
        if dlq is None or dlq.owner is None:
            failed("dead-letter topic has no owner yet")
            return
        payload = self.dead_letter_payload(effect, rec)
        seq_key = (effect.dlq_topic, 0)
        seq = self.dead_letter_seq.get(seq_key, 0)
        self.dead_letter_seq[seq_key] = seq + 1

        def on_appended(env: codec.Envelope | None) -> None:
            if env is None or env.error is not None:
                error = None if env is None else env.error
                if error is not None and error.code is ErrorCode.TOO_LARGE:
                    limit = error.data.get("limit")
                    if isinstance(limit, int):
                        self.dead_letter_limits[effect.dlq_topic] = limit
                    if not effect.drop_value:
                        self.refused_copies[(effect.dead_lettering_id, effect.offset)] = rec
                try:
                    failed("append failed" if error is None else error.message, error, refused=True)
                finally:
                    # Kept only for the copy without value the core asks for at once.
                    self.refused_copies.pop((effect.dead_lettering_id, effect.offset), None)
                return
            self.log.info("dead_letter.appended", group=effect.group, topic=effect.topic,
                          partition=effect.partition, offset=effect.offset, dlq=effect.dlq_topic,
                          dlq_offset=env.msg.base_offset, attempts=effect.attempts,
                          value_dropped=effect.drop_value)
            self.dead_letter_copied(effect)

        self.request(f"partition:{dlq.owner}".encode(),
                     m.Produce(topic=effect.dlq_topic, partition=0, producer_id=self.dead_letter_producer_id,
                               sequence=seq, coordinator_epoch=self.epoch or 0), now, on_appended, (payload,))

    # -- status -----------------------------------------------------------------------------

    def healthy(self, now: int) -> bool:
        seen = self.writer["last_seen_ms"]
        return bool(seen is not None and now - seen < WRITER_SILENT_MS and self.writer["healthy"])

    def status(self, now: int) -> list[dict]:
        seen = self.writer["last_seen_ms"]
        writer = {"kind": "commit-writer", "actor_id": "writer", "pid": self.writer["pid"], "endpoint": None,
                  "healthy": self.healthy(now), "last_seen_ms_ago": None if seen is None else now - seen,
                  "metrics": self.writer["metrics"], "unconfirmed_advances": len(self.unconfirmed)}
        coordinator = {"kind": "group-coordinator", "actor_id": "coordinator", "pid": os.getpid(),
                       "endpoint": self.endpoint, "healthy": True, "offsets_loaded": self.offsets_loaded,
                       "node_id": self.node_id or self.endpoint, "coordinator_epoch": self.epoch,
                       "statistics": self.core.statistics()}
        return [coordinator, writer, *self.topics.actor_status(now)]

    # -- time -------------------------------------------------------------------------------

    def tick(self, now: int) -> None:
        self.lease_outbound.expire(now)
        self.tick_leadership(now)
        if self.parked:
            self.answer_parked(now, expired_only=True)
        if self.epoch is None:
            return
        self.outbound.expire(now)
        self.pump_metadata(now)
        if not self.ready:
            return
        if self.held_resets:
            self.release_resets(now)
        if self.held_deletes:
            self.release_deletes(now)
        self.apply(self.topics.tick(now), now)
        self.apply(self.core.tick(now), now)
        self.pump_writer(now)

    def next_timeout_ms(self, now: int) -> int:
        deadline = self.core.next_deadline()
        timeout = 100  # metadata, lease and writer housekeeping run at least this often
        if deadline is not None:
            timeout = min(timeout, max(0, deadline - now))
        if self.to_send and self.offsets_loaded:
            timeout = min(timeout, max(0, self.last_advance_sent_ms + ADVANCE_COALESCE_MS - now))
        return timeout

    def shutdown(self) -> None:
        """Answer every parked poll instead of leaving clients to time out; hand the writer
        the advances still waiting out their coalescing interval."""
        if self.to_send and self.offsets_loaded:
            self.last_advance_sent_ms = -ADVANCE_COALESCE_MS
            self.pump_writer(runtime.now_ms())
        for key in list(self.open_polls):
            token = self.tokens.pop(key, None)
            self.core.cancel_parked(key)
            if token is not None:
                self.reply_error(token, ShuttingDown("coordinator is stopping; retry"))
        self.open_polls.clear()
        for key in list(self.held_resets):
            self.reply_error(self.tokens.pop(key), ShuttingDown(
                "coordinator is stopping before the reset was durable; retry"))
        self.held_resets.clear()
        for key in list(self.held_deletes):
            self.reply_error(self.tokens.pop(key), ShuttingDown(
                "coordinator is stopping; the topic is deleted, its files and offsets are removed at the "
                "next start", topic=self.held_deletes[key][0].topic))
        self.held_deletes.clear()


def _serve_internal(shell: CoordinatorShell, internal: zmq.Socket, now: int) -> None:
    """What the broker's own actors sent, up to a turn's budget."""
    for _ in range(TURN_BUDGET):
        frames = recv_frames(internal)
        if frames is None:
            break
        if len(frames) >= 2:
            shell.on_internal_message(frames[0], frames[1:], now)


def run(endpoint: str, data_dir: str, *, internal_endpoint: str = "tcp://127.0.0.1:0", log_level: str = "info",
        curve_dir: str | None = None, bound_file: str | None = None, advertise_host: str | None = None,
        unclean_leader_election: bool = False, cluster: bool = False, lease_ms: int = 5000,
        node_id: str | None = None) -> None:
    """Process main for the group coordinator.

    Two ROUTER sockets: ``endpoint`` for clients and ``internal_endpoint`` for
    the broker's own actors, so a client can never pose as one (with
    ``--curve`` the internal one admits only the broker's key). ``bound_file``
    is written (with this pid) once both are bound: the other actors start only
    then, so that they never dial another broker's coordinator on the same ports.
    ``advertise_host`` names this host in the endpoints it reports (``hello``'s
    ``internal_endpoint``, which an actor on another host dials, and ``status``).
    ``unclean_leader_election`` lets a replicated partition whose whole ISR is gone be led
    by a replica outside it: available again, at the price of acknowledged records.
    ``cluster`` (the offsets are in PostgreSQL): lead only while holding the coordinator lease
    of ``lease_ms``, as ``node_id`` (default: the advertised client endpoint); otherwise
    this node is a cluster of one and leads from the start.
    """
    log = runtime.configure_logging(log_level, actor="group-coordinator")
    stop = runtime.StopFlag().install()
    data = Path(data_dir)
    data.mkdir(parents=True, exist_ok=True)
    ctx = zmq.Context()
    keys = security.KeyRing(curve_dir) if curve_dir is not None else None  # "" is refused, not plaintext
    auth = security.start_authenticator(ctx, keys, log) if keys else None
    router = runtime.make_socket(ctx, zmq.ROUTER)
    # No handover on the actors' socket: an actor's identity (`writer`,
    # `partition:<id>`) stays with the connection that holds it, so nobody can
    # take its route; heartbeats free it within seconds when that actor dies.
    internal = runtime.make_socket(ctx, zmq.ROUTER, handover=False)
    if keys is not None:
        keys.make_server(router)
        keys.make_server(internal, internal=True)
    try:
        bound = runtime.advertised_endpoint(runtime.bind_endpoint(router, endpoint), advertise_host)
        bound_internal = runtime.advertised_endpoint(runtime.bind_endpoint(internal, internal_endpoint),
                                                     advertise_host)
        if bound_file is not None:
            tmp = Path(bound_file).with_suffix(".tmp")
            tmp.write_text(str(os.getpid()))
            os.replace(tmp, bound_file)
        shell = CoordinatorShell(router, internal, data, log, keys.acl() if keys else None,
                                 unclean_leader_election=unclean_leader_election, cluster=cluster,
                                 lease_ms=lease_ms, node_id=node_id or bound)
        shell.endpoint, shell.internal_endpoint = bound, bound_internal
        log.info("actor.started", endpoint=bound, internal_endpoint=bound_internal, data_dir=str(data),
                 cluster=cluster, node_id=shell.node_id)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(internal, zmq.POLLIN)
        runtime.tune_gc()
        while not stop.stopping:
            now = runtime.now_ms()
            try:
                ready = dict(poller.poll(shell.next_timeout_ms(now)))
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EINTR:
                    continue
                raise
            now = runtime.now_ms()
            if internal in ready:
                _serve_internal(shell, internal, now)
            if router in ready:
                for _ in range(TURN_BUDGET):
                    frames = recv_frames(router, copy=keys is None)
                    if frames is None:
                        break
                    if len(frames) < 2:
                        continue
                    # The clock is read after each request is received, not once per turn: a
                    # request that arrived while the turn ran would otherwise start its timers
                    # (a nack's delay, a lease) before the client sent it.
                    now = runtime.now_ms()
                    if keys is None:
                        shell.on_client_message(frames[0], frames[1:], now, None)
                    else:  # frames are zmq.Frame objects carrying the authenticated User-Id
                        shell.on_client_message(frames[0].bytes, [f.bytes for f in frames[1:]], now,
                                                security.user_id(frames[1]))
            shell.tick(now)
        shell.shutdown()
        # The last advances were just handed to the writer, and the socket closes with linger
        # 0: closed at once, it could drop them unsent, and a consumer's flushed acks were
        # lost across a clean stop (CI under load: committed 0 of 100 after Ctrl-C). Wait
        # for the writer's confirmation; the supervisor stops the writer only after us.
        deadline = runtime.now_ms() + SHUTDOWN_DRAIN_MS
        while shell.unconfirmed and (now := runtime.now_ms()) < deadline:
            if internal.poll(max(1, min(50, deadline - now))):
                _serve_internal(shell, internal, runtime.now_ms())
        log.info("actor.stopped", signal=stop.signal, unconfirmed_advances=len(shell.unconfirmed))
    finally:
        router.close(linger=0)
        internal.close(linger=0)
        if auth is not None:
            auth.stop()
        ctx.term()
    runtime.ignore_stop_signals()


__all__ = ["run", "CoordinatorShell", "Unavailable"]
