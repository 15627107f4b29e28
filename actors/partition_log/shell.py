"""Partition-log actor process: sockets, clock and signals around `PartitionActorCore`.

One poll loop. Each turn drains up to ``TURN_BUDGET`` messages from the client
ROUTER and the coordinator DEALER, hands them to the core, then calls
``end_turn`` (group commit for ``--fsync always``), sends a log-end report if
anything was appended, and re-registers once a second.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import os
import socket as pysocket
import time
from pathlib import Path
from typing import Any

import zmq

from zbroker.actors import runtime, security
from zbroker.client.wire import recv_frames
from zbroker.actors.partition_log.core import (OUT_OF_FILES, FsyncPolicy, Limits, OpenFailed, OutOfFiles,
                                       PartitionActorCore, Reply, ReplyError, SendToCoordinator, SendToLeader,
                                       detached, partitions_for_open_files)
from zbroker.actors.partition_log.coordinator_link import CoordinatorLink, Move, coordinator_endpoints
from zbroker.actors.partition_log.links import ReplicationLinks
from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.messages import validate_topic_name
from zbroker.protocol.errors import ErrorCode, ProtocolError, ZBrokerError
from zbroker.storage.log.partition_log import LogConfig, PartitionLog, make_directories_durably, run_sync_jobs

TURN_BUDGET = 512
REGISTER_RETRY_MS = 1000


# How long a stopping actor's socket may hold its deregistration for the coordinator:
# it leaves in well under a millisecond when the coordinator is there, and when the
# whole broker stops, the coordinator is often gone first and this is waited in full.
DEREGISTER_LINGER_MS = 50


def partition_dir(data_dir: Path, topic: str, partition: int) -> Path:
    return data_dir / "logs" / topic / str(partition)


def trash_dir(data_dir: Path) -> Path:
    """Where deleted partitions go before they are removed: outside logs/, same filesystem."""
    return data_dir / "deleted-logs"


class LockedLogOpener:
    """Opens partition logs under an exclusive flock on the partition directory.

    Two actors sharing a data directory can never write one log at once: the
    new owner of a moved partition waits until the old owner released it (or
    died, which releases the lock with its file descriptors).
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._locks: dict[tuple[str, int], int] = {}

    def __call__(self, topic: str, partition: int, config: LogConfig, wall_ms: int) -> PartitionLog:
        validate_topic_name(topic)  # never a path outside the data directory
        directory = partition_dir(self.data_dir, topic, partition)
        try:
            make_directories_durably(directory, self.data_dir)
            fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            # Opening is retried; a running log's I/O error is what restarts the actor.
            if exc.errno in OUT_OF_FILES:
                raise OutOfFiles(exc.strerror) from None
            raise OpenFailed(f"cannot open the partition directory: {exc.strerror}") from None
        _lock_or_close(fd)
        try:
            plog = PartitionLog.open(directory, config, now_ms=wall_ms)
        except OSError as exc:
            os.close(fd)
            if exc.errno in OUT_OF_FILES:  # the partition waits; the others keep serving
                raise OutOfFiles(exc.strerror) from None
            raise
        except BaseException:
            os.close(fd)
            raise
        self._locks[(topic, partition)] = fd
        original_close = plog.close

        def close_and_unlock() -> None:
            try:
                original_close()
            finally:  # a close that failed to flush still closed its files: the lock goes too
                lock_fd = self._locks.pop((topic, partition), None)
                if lock_fd is not None:
                    os.close(lock_fd)
        plog.close = close_and_unlock  # type: ignore[method-assign]
        return plog

    def remove(self, topic: str, partition: int) -> None:
        """Delete a closed partition's files (delete_topic), crash-safely: under its lock the
        directory is renamed into the trash (one atomic step, fsynced), so a topic created
        again under the name finds either the whole old log or none of it, never a part;
        the trash is emptied now and again at the next start if this was interrupted."""
        validate_topic_name(topic)
        directory = partition_dir(self.data_dir, topic, partition)
        if (topic, partition) in self._locks:
            raise OpenFailed("the partition is still open here")
        try:
            fd = os.open(directory / ".lock", os.O_RDWR)
        except FileNotFoundError:
            fd = None  # never written here, or already deleted
        if fd is not None:
            _lock_or_close(fd)
            try:
                trash = trash_dir(self.data_dir)
                trash.mkdir(exist_ok=True)
                target = trash / f"{topic}.{partition}.{time.time_ns()}"
                os.rename(directory, target)
                for parent in (directory.parent, trash):
                    _fsync_dir(parent)
            finally:
                os.close(fd)
        try:
            directory.parent.rmdir()  # the topic's directory, once its last partition is gone
        except OSError:
            pass
        empty_trash(self.data_dir)


def _lock_or_close(fd: int) -> None:
    """Take the partition directory's lock, or close `fd` and say another actor holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OpenFailed("partition directory is locked by another actor") from None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def empty_trash(data_dir: Path) -> None:
    import shutil
    trash = trash_dir(data_dir)
    if trash.is_dir():
        for entry in trash.iterdir():
            shutil.rmtree(entry, ignore_errors=True)


def _log_sync_failure(log: Any, failures: list):
    def check(future: concurrent.futures.Future) -> None:
        if future.exception() is not None:
            # After a failed fsync the kernel may have dropped the dirty pages and
            # cleared the error, so a later fsync would "succeed" without them. The
            # loop exits instead (as for an I/O error on its own thread): the restarted
            # actor recovers the log from what is on disk and fsyncs it whole.
            log.error("log.fsync_failed", error=repr(future.exception()))
            failures.append(future.exception())
    return check


def wall_ms() -> int:
    # Only for what is stored: batch append times, on disk, are compared with it for
    # age-based retention across restarts. Timers run on runtime.now_ms (monotonic).
    return time.time_ns() // 1_000_000


def storage_id_for(data_dir: Path) -> str:
    return f"{pysocket.gethostname()}:{data_dir.resolve()}"


def run(actor_id: str, coordinator: str, data_dir: str, *, bind: str = "tcp://127.0.0.1:0",
        advertise_host: str | None = None, fsync: str = "interval:1000", log_level: str = "info",
        max_batch_bytes: int = Limits.max_batch_bytes, curve_dir: str | None = None,
        replica_lag_ms: int = 10_000, rack: str | None = None) -> None:
    """Process main. Runs until SIGTERM/SIGINT, then drains and exits 0. ``rack`` names the
    failure domain this actor is in: replicas of a partition are spread over racks first."""
    log = runtime.configure_logging(log_level, actor="partition-log", actor_id=actor_id)
    open_files = runtime.raise_open_file_limit()
    stop = runtime.StopFlag().install()
    data = Path(data_dir)
    make_directories_durably(data, data)
    empty_trash(data)  # a deletion interrupted after its rename
    # One thread for interval fsyncs: the loop keeps serving while the disk syncs.
    syncer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsync")
    sync_failures: list[BaseException] = []

    def background_sync(jobs: list) -> None:
        syncer.submit(run_sync_jobs, jobs).add_done_callback(_log_sync_failure(log, sync_failures))

    opener = LockedLogOpener(data)
    core = PartitionActorCore(actor_id, open_log=opener, remove_log=opener.remove, fsync=FsyncPolicy.parse(fsync),
                              limits=Limits(max_batch_bytes=max_batch_bytes), background_sync=background_sync,
                              max_open_partitions=None if open_files is None else partitions_for_open_files(open_files),
                              replica_lag_ms=replica_lag_ms)
    ctx = zmq.Context()
    keys = security.KeyRing(curve_dir) if curve_dir is not None else None  # "" is refused, not plaintext
    auth = security.start_authenticator(ctx, keys, log) if keys else None
    router = runtime.make_socket(ctx, zmq.ROUTER)
    # Per peer, at most this many requests wait to be read (a producer faster than
    # the disk is held back by TCP) and replies to be sent (a consumer that never
    # reads costs at most 1000 fetch replies; past that they are dropped, and a
    # client that does read sees a timeout and fetches again). Produce replies are
    # not dropped there: the outbox keeps them until the queue has room.
    router.setsockopt(zmq.RCVHWM, 100)
    router.setsockopt(zmq.SNDHWM, 1000)
    dealer = runtime.make_socket(ctx, zmq.DEALER, identity=f"partition:{actor_id}".encode())
    acl = None
    if keys is not None:
        keys.make_server(router)
        keys.internal_client().apply(dealer)
        acl = keys.acl()
    try:
        # Clients dial the endpoint the coordinator hands out, so it names this host as
        # they reach it, not as it was bound (a wildcard bind needs advertise_host).
        endpoint = runtime.advertised_endpoint(runtime.bind_endpoint(router, bind), advertise_host)
        dealer.connect(coordinator_endpoints(coordinator)[0])  # the others: see coordinator_link
        log.info("actor.started", endpoint=endpoint, coordinator=coordinator, fsync=str(core.fsync),
                 data_dir=str(data), open_file_limit=open_files, max_open_partitions=core.max_open_partitions)
        # No runtime.tune_gc() here: this actor takes frames of up to 64 MiB from
        # clients, and one caught in a reference cycle lives until a collection (as
        # refused frames did through their errors' tracebacks, see core.handle): with
        # the young generation collected every 50,000 allocations, 100,000 fuzzed
        # frames held 100 MiB (tests/fuzz).
        # Followers dial their leaders' client ROUTERs as the broker's own actors do each other.
        link_keys = keys.internal_client().apply if keys is not None else None
        _loop(core, router, dealer, endpoint, storage_id_for(data), stop, log, acl, sync_failures, coordinator,
              rack, link_keys)
        syncer.shutdown(wait=True)  # background fsyncs finish before the final one in close()
        for effect in core.close():
            _apply(effect, router, dealer, log)
        _outbox.flush()
        if _outbox.waiting:
            # Their records are stored and synced (close() above); the producers time out
            # and retry, and the log deduplicates them. Said, not left to be guessed.
            log.warning("produce_reply.unsent_at_shutdown", replies=_outbox.waiting,
                        hint="their peers were not reading; the records are stored")
        # The logs are closed and unlocked: the coordinator may give the partitions to
        # another actor now rather than after the registrations lapse (seconds of
        # UNAVAILABLE for their clients). Given a moment to leave, not waited for.
        runtime.send_reply(dealer, None, codec.encode_request(m.Deregister(actor_id=actor_id, pid=os.getpid()),
                                                              None), what="deregistration")
        dealer.close(linger=DEREGISTER_LINGER_MS)
        log.info("actor.stopped", signal=stop.signal)
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        if auth is not None:
            auth.stop()
        ctx.term()
    runtime.ignore_stop_signals()


def _loop(core: PartitionActorCore, router: zmq.Socket, dealer: zmq.Socket, endpoint: str,
          storage_id: str, stop: runtime.StopFlag, log: Any, acl: security.Acl | None,
          sync_failures: list, coordinator: str = "", rack: str | None = None, link_keys: Any = None) -> None:
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(dealer, zmq.POLLIN)
    global _links
    _links = ReplicationLinks(router.context, poller, log, link_keys)
    link = CoordinatorLink(coordinator) if coordinator else None  # None: a test's dealer, connected by it
    try:
        _turns(core, router, dealer, endpoint, storage_id, stop, log, acl, sync_failures, link, poller, rack)
    finally:
        _links.close()


def _turns(core: PartitionActorCore, router: zmq.Socket, dealer: zmq.Socket, endpoint: str,
           storage_id: str, stop: runtime.StopFlag, log: Any, acl: security.Acl | None,
           sync_failures: list, link: CoordinatorLink | None, poller: zmq.Poller,
           rack: str | None = None) -> None:
    corr = 0
    pid = os.getpid()
    coordinator = link.current if link is not None else ""
    while not stop.stopping:
        if sync_failures:
            raise sync_failures[0]  # see _log_sync_failure
        now = runtime.now_ms()
        due = core.heartbeat_due(now)
        if link is not None:
            _move(link.tick(now), dealer, log)
            due = link.register_due(now) or due
            coordinator = link.current
        if due:
            corr += 1
            # A registration the coordinator's queue refuses is dropped: the next one is a second away.
            runtime.send_reply(dealer, None, codec.encode_request(
                core.registration(endpoint=endpoint, storage_id=storage_id, pid=pid, rack=rack), corr),
                what="registration")
            unanswered_ms = core.registration_sent(now)
            if unanswered_ms is not None:
                log.warning("coordinator.registration_unanswered", unanswered_ms=unanswered_ms, coordinator=coordinator,
                            hint="is another partition actor running with this --actor-id? The coordinator "
                                 "refuses a second connection under one id. Otherwise the coordinator is down.")
            if link is not None:
                link.registration_sent(now)
        deadline = _earliest(core.next_deadline(), link.next_deadline() if link is not None else None)
        timeout = 1000 if deadline is None else max(0, min(1000, deadline - now))
        if _outbox.retrying:
            timeout = min(timeout, 1)  # produce replies wait for room in a peer's queue
        try:
            ready = dict(poller.poll(timeout))
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EINTR:
                continue
            raise
        now, wall = runtime.now_ms(), wall_ms()
        if router in ready:
            for _ in range(TURN_BUDGET):
                # Copied: a zmq.Frame costs 17,400 instructions more per three-frame request
                # than copying its frames does (callgrind), more than copying a 500-record
                # batch. With an ACL the header's Frame is kept for its User-Id.
                frames = recv_frames(router, copy=acl is None)
                if frames is None:
                    break
                if len(frames) < 2:
                    continue
                if acl is None:
                    _handle(core, (router, frames[0]), frames[1:], now, router, dealer, log, wall=wall)
                    continue
                _handle(core, (router, frames[0].bytes), [f.buffer for f in frames[1:]], now, router, dealer, log,
                        acl, security.user_id(frames[1]), wall=wall)
        if dealer in ready:
            for _ in range(TURN_BUDGET):
                frames = recv_frames(dealer)
                if frames is None:
                    break
                _handle_from_coordinator(core, frames, now, router, dealer, log, wall=wall, link=link)
        if core.replicas:
            for effect in _links.on_ready(ready, core, now) + _links.expire(core, now):
                _apply(effect, router, dealer, log)
        for effect in core.tick(now, wall_ms=wall):
            _apply(effect, router, dealer, log)
        for effect in core.end_turn(now):
            _apply(effect, router, dealer, log)
        _outbox.flush()
        report = core.take_report(now)
        if report is not None:
            # Dropped when refused: the registration within a second reports every log end.
            runtime.send_reply(dealer, None, codec.encode_request(report, None), what="report")


def _handle(core: PartitionActorCore, route: tuple, frames: list, now: int, router: zmq.Socket,
            dealer: zmq.Socket, log: Any, acl: security.Acl | None = None, user: str | None = None,
            wall: int | None = None) -> None:
    env, error = runtime.decode_or_error(frames, log)
    if error is not None:
        _send(route, error)
        return
    token = (route, env.corr_id, env.op)
    if acl is not None:
        try:
            acl.check(user, env.op, env.msg)
        except ZBrokerError as err:
            log.warning("auth.denied", op=env.op, reason=err.message, data=err.data)
            _apply(ReplyError(token, env.op, detached(err)), router, dealer, log)
            return
    for effect in _guarded(core, token, env, now, log, wall=wall):
        _apply(effect, router, dealer, log)


def _handle_from_coordinator(core: PartitionActorCore, frames: list, now: int, router: zmq.Socket,
                             dealer: zmq.Socket, log: Any, wall: int | None = None,
                             link: CoordinatorLink | None = None) -> None:
    try:
        is_reply, env = codec.decode_any(frames)
    except ProtocolError as err:
        log.warning("coordinator.bad_frame", reason=err.message)
        return
    if is_reply:
        if env.op == "register" and link is not None:
            if env.error is not None and env.error.code is ErrorCode.NOT_COORDINATOR:
                _move(link.not_coordinator(env.error.data, now), dealer, log)
                return  # a standby's answer: the registration is still to be made, at the leader
            link.answered()
        if env.op == "register":
            core.registration_answered()
        if env.op == "alter_isr":
            for effect in _links.alter_isr_reply(env, core, now):
                _apply(effect, router, dealer, log)
            return
        if env.op == "register" and env.msg is not None:
            try:
                effects = core.accept_assignment(env.msg, now, wall_ms=wall)
            except (ZBrokerError, ValueError, TypeError) as err:
                log.error("coordinator.bad_assignment", reason=str(err))
                return
            for effect in effects:
                _apply(effect, router, dealer, log)
        elif env.error is not None:
            log.warning("coordinator.error", op=env.op, code=env.error.code.value, reason=env.error.message)
        return
    token = ((dealer, None), env.corr_id, env.op)
    for effect in _guarded(core, token, env, now, log, from_coordinator=True, wall=wall):
        _apply(effect, router, dealer, log)


def _earliest(*deadlines: int | None) -> int | None:
    given = [d for d in deadlines if d is not None]
    return min(given) if given else None


def _move(move: Move | None, dealer: zmq.Socket, log: Any) -> None:
    """Register with another coordinator: the one DEALER leaves `old` and dials `new`.
    What was queued towards `old` is dropped; the next registration reports everything."""
    if move is None:
        return
    try:
        dealer.disconnect(move.old)
    except zmq.ZMQError:  # never connected there (a test's dealer): nothing to leave
        pass
    dealer.connect(move.new)
    log.info("coordinator.moved", old=move.old, new=move.new, reason=move.reason, leader=move.leader)


def _guarded(core: PartitionActorCore, token: Any, env: codec.Envelope, now: int, log: Any,
             from_coordinator: bool = False, wall: int | None = None) -> list:
    """No request may take the actor down: a bug becomes an INTERNAL error reply.

    An OSError from the log (disk full, I/O error) is different: the log may be
    inconsistent in memory, so the actor exits and the supervisor restarts it,
    and recovery truncates whatever half-written tail the failure left.
    """
    try:
        return core.handle(token, env, now, wall_ms=wall, from_coordinator=from_coordinator)
    except OSError:
        log.exception("log.io_error", op=env.op)
        raise
    except Exception as exc:
        log.exception("request.internal_error", op=env.op)
        return [ReplyError(token, env.op, ZBrokerError(f"internal error: {type(exc).__name__}",
                                                       code=ErrorCode.INTERNAL))]


def _apply(effect: Any, router: zmq.Socket, dealer: zmq.Socket, log: Any) -> None:
    if isinstance(effect, (SendToLeader, SendToCoordinator)):
        # The links' give-up deadlines are compared with the loop's monotonic `now` (a wall
        # clock here put them ~1.7e12 ms away: a lost fetch reply was never given up, and its
        # follower stopped fetching for good; found by the replicated chaos run).
        _links.send(effect, dealer, runtime.now_ms())
        return
    route, corr_id, op = effect.token
    if effect.nth:  # a followed fetch's later reply: the core checked the id is an int that stays in range
        corr_id += effect.nth
    if isinstance(effect, Reply):
        frames = codec.encode_reply(effect.msg, corr_id, effect.frames)
    elif isinstance(effect, ReplyError):
        frames = codec.encode_error(effect.op or op, corr_id, effect.error)
    else:  # pragma: no cover - the core returns only the two kinds above
        raise TypeError(f"unknown effect {effect!r}")
    _send(route, frames, must_arrive=op in ("produce", "produce_many"))


# Replies wait here for the end of the loop turn (`runtime.Outbox`); one per process.
_outbox = runtime.Outbox()
# The sockets to leaders (a follower's fetches) and the alter_isr bookkeeping; set by _loop.
_links: ReplicationLinks | None = None


def _send(route: tuple, frames: list, must_arrive: bool = False) -> None:
    sock, identity = route
    _outbox.send(sock, identity, frames, must_arrive)
