"""Commit writer process main: sockets, clock, signals and the offset store.

Theory of operation
-------------------
All decisions are in `actors.commit_writer.core`; this module performs its
effects. One asyncio loop runs three kinds of work:

- the receiver: frames from the coordinator (over a DEALER with identity
  ``writer``) are decoded by `protocol.codec` and fed to the core; a bad
  frame gets an error reply and is otherwise ignored;
- the ticker: reads the clock, calls ``core.on_tick`` and sleeps until the
  core's next deadline or until something new arrives;
- store tasks: at most one flush or probe at a time (the core guarantees it),
  plus ``load_offsets`` reads and the cluster ops (``coordinator_lease``,
  ``load_metadata``, ``write_metadata``: docs/PROTOCOL.md section 16); each
  reports its outcome back to the core. The store serialises them on its one
  connection, so a lease renewal may wait behind a flush: the coordinator
  counts its lease from when it asked, which makes that wait safe.

Replies and status go out with ``NOBLOCK`` on a socket with ``IMMEDIATE``
set: when the coordinator is away they are dropped instead of queued for a
coordinator that may restart with new correlation ids. A dropped durability
reply is harmless: the coordinator resends its advances after a restart.

The store connects (and migrates) lazily on the first flush or probe, so the
writer starts, and reports itself unhealthy, even while the database is down.

SIGTERM/SIGINT: stop reading, flush what is pending for at most
``SHUTDOWN_GRACE_MS``, answer whatever is still waiting with SHUTTING_DOWN,
close the store and the socket (linger 0), return (exit code 0).
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import structlog
import zmq
import zmq.asyncio

from zbroker.actors import runtime
from zbroker.actors.security import ClientKeys, KeyRing

from zbroker.actors.commit_writer.core import (
    CommitWriterCore, Effect, Flush, Load, Probe, Reply, ReplyError, Status, WriterConfig,
)
from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.errors import ProtocolError, ShuttingDown, StaleEpoch, UnknownOp, ZBrokerError
from zbroker.storage.offsets import OffsetStoreError, open_offset_store
from zbroker.storage.offsets.metadata import MetadataChanges

IDENTITY = b"writer"
SHUTDOWN_GRACE_MS = 2000.0


def run(coordinator_endpoint: str, offsets_url: str, *, flush_interval_ms: float = 10,
        batch_size: int = 1000, log_level: str = "info", curve_dir: str | None = None) -> None:
    """Process entry point (the supervisor runs it in a multiprocessing spawn child)."""
    runtime.configure_logging(log_level, actor="commit-writer")
    config = WriterConfig(flush_interval_ms=flush_interval_ms, batch_size=batch_size)
    shell = CommitWriterShell(coordinator_endpoint, offsets_url, config)
    if curve_dir is not None:  # "" is refused by KeyRing, not taken as plaintext
        # The writer dials the coordinator as one of the broker's own actors.
        shell.curve = KeyRing(curve_dir).internal_client()
    runtime.tune_gc()
    asyncio.run(shell.main())
    runtime.ignore_stop_signals()


class CommitWriterShell:
    def __init__(self, endpoint: str, offsets_url: str, config: WriterConfig) -> None:
        self.endpoint = endpoint
        self.core = CommitWriterCore(config)
        self.store = open_offset_store(offsets_url)
        self.log = structlog.get_logger().bind(actor="commit-writer", pid=os.getpid())
        self.ctx: zmq.asyncio.Context | None = None
        self.sock: zmq.asyncio.Socket | None = None
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._store_ready = False
        # The first flush, probe and offsets load can start together: one connects and
        # migrates, the others wait for it (it logged "offset store ready" twice, and two
        # migrations at once may collide on the migrations table).
        self._store_lock = asyncio.Lock()
        self._was_healthy: bool | None = None
        self._dropped = 0
        self.curve: ClientKeys | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def main(self) -> None:
        loop = asyncio.get_running_loop()

        def on_signal(signum: int, _frame: Any) -> None:
            # Not loop.add_signal_handler: asyncio.run restores the default action when
            # it closes the loop, and a second SIGTERM during that teardown would kill
            # the writer mid-exit. This handler lives as long as the process.
            try:
                loop.call_soon_threadsafe(self._on_signal, signum)
            except RuntimeError:
                pass  # the loop is already closed: we are exiting anyway
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, IDENTITY)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        if self.curve is not None:
            self.curve.apply(self.sock)
        self.sock.connect(self.endpoint)
        self.log.info("commit writer started", endpoint=self.endpoint, backend=self.store.backend,
                      schema=self.store.schema, flush_interval_ms=self.core.config.flush_interval_ms,
                      batch_size=self.core.config.batch_size)
        receiver = asyncio.create_task(self._receive())
        try:
            while not self._stop.is_set():
                self._turn()
                await self._sleep_until_due(None)
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)
            await self._drain()
        finally:
            receiver.cancel()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(receiver, *self._tasks, return_exceptions=True)
            await self.store.close()
            self.sock.close(linger=0)
            self.ctx.term()
            self.log.info("commit writer stopped", **_brief(self.core.statistics(runtime.now_ms_fine())))

    def _on_signal(self, sig: signal.Signals) -> None:
        self.log.info("stopping", signal=signal.Signals(sig).name)
        self._stop.set()
        self._wake.set()

    async def _drain(self) -> None:
        start = runtime.now_ms_fine()
        self._apply(self.core.begin_shutdown(start))
        while not self.core.drained and runtime.now_ms_fine() - start < SHUTDOWN_GRACE_MS:
            self._turn()
            await self._sleep_until_due(start + SHUTDOWN_GRACE_MS)
        if not self.core.drained:
            self.log.warning("stopping with offsets not yet durable",
                             pending_keys=self.core.statistics(runtime.now_ms_fine())["pending_keys"])
        self._apply(self.core.abort(runtime.now_ms_fine()))

    def _turn(self) -> None:
        self._apply(self.core.on_tick(runtime.now_ms_fine()))

    async def _sleep_until_due(self, cap_ms: float | None) -> None:
        deadline = self.core.next_deadline()
        if cap_ms is not None:
            deadline = cap_ms if deadline is None else min(deadline, cap_ms)
        timeout = None if deadline is None else max(0.0, deadline - runtime.now_ms_fine()) / 1000.0
        self._wake.clear()
        if timeout == 0.0:
            await asyncio.sleep(0)  # due now: still let the receiver and store tasks run
            return
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            pass

    # -- inbound ---------------------------------------------------------------------------

    async def _receive(self) -> None:
        assert self.sock is not None
        while True:
            frames = await self.sock.recv_multipart()
            try:
                self._on_frames(frames)
            except Exception:  # a bug here must not take the writer (and durability) down
                self.log.exception("failed to handle a message")
            self._wake.set()
            # recv_multipart completes without suspending while messages are queued, so under
            # a steady stream this loop would starve the flush and the ticker: yield each turn.
            await asyncio.sleep(0)

    def _on_frames(self, frames: list[bytes]) -> None:
        now = runtime.now_ms_fine()
        try:
            is_reply, env = codec.decode_any(frames)
        except ProtocolError as exc:
            self.log.warning("bad frame from coordinator", **{**exc.data, "error": exc.message, "op": exc.op})
            # An error reply whose op is nil cannot be decoded by codec.decode_reply, so "" stands in.
            self._send(codec.encode_error(exc.op or "", exc.corr_id, exc))
            return
        if is_reply or env.is_tell:
            return  # nothing the writer asked for; writer_status is a tell
        token = (env.op, env.corr_id)
        if isinstance(env.msg, m.Advance):
            self._apply(self.core.on_advance(token, env.msg.advances, now))
        elif isinstance(env.msg, m.LoadOffsets):
            # The page wanted rides in the (opaque to the core) token.
            page = (env.op, env.corr_id, env.msg.after, env.msg.limit)
            self._apply(self.core.on_load_offsets(page, now))
        elif isinstance(env.msg, (m.CoordinatorLease, m.LoadMetadata, m.WriteMetadata)):
            if self.core.closing:
                self._send(codec.encode_error(env.op, env.corr_id, ShuttingDown("commit writer is stopping")))
            else:
                self._spawn(self._cluster_op(env.op, env.corr_id, env.msg))
        else:
            self._send(codec.encode_error(env.op, env.corr_id, UnknownOp(
                f"the commit writer does not serve {env.op!r}", op=env.op)))

    # -- effects ---------------------------------------------------------------------------

    def _apply(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, Reply):
                op, corr_id = effect.token
                self._send(codec.encode_reply(m.AdvanceReply(durable=effect.durable), corr_id))
            elif isinstance(effect, ReplyError):
                op, corr_id = effect.token[:2]
                self._send(codec.encode_error(op, corr_id, effect.error))
            elif isinstance(effect, Flush):
                self._spawn(self._flush(effect))
            elif isinstance(effect, Probe):
                self._spawn(self._probe(effect))
            elif isinstance(effect, Load):
                self._spawn(self._load(effect.token))
            elif isinstance(effect, Status):
                self._on_status(effect)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _send(self, frames: list) -> None:
        assert self.sock is not None
        if self.sock.closed:
            return
        fut = self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
        # NOBLOCK sends complete at once; reading the exception also marks it retrieved.
        if fut.exception() is not None:
            self._dropped += 1

    def _on_status(self, status: Status) -> None:
        if status.healthy != self._was_healthy:
            if self._was_healthy is not None or status.healthy:  # not "unhealthy" before the first probe
                level = self.log.info if status.healthy else self.log.warning
                level("health changed", healthy=status.healthy, **_brief(status.metrics))
            self._was_healthy = status.healthy
        metrics = dict(status.metrics, replies_dropped=self._dropped, store=self.store.statistics())
        self._send(codec.encode_request(
            m.WriterStatus(pid=os.getpid(), healthy=status.healthy, metrics=metrics), None))

    # -- store work ------------------------------------------------------------------------

    async def _ensure_store(self) -> None:
        if self._store_ready:
            return
        async with self._store_lock:
            if self._store_ready:  # made ready by the task that held the lock before
                return
            await self.store.connect()
            applied = await self.store.migrate()
            self._store_ready = True
        self.log.info("offset store ready", backend=self.store.backend, schema=self.store.schema,
                      migrations_applied=applied)

    async def _flush(self, flush: Flush) -> None:
        try:
            await self._ensure_store()
            await self.store.upsert(flush.rows, coordinator_epoch=flush.coordinator_epoch)
        except StaleEpoch as exc:
            effects = self.core.on_flush_fenced(flush.flush_id, runtime.now_ms_fine(), exc)
            self.log.warning("flush refused: the coordinator epoch is over", **exc.data, rows=len(flush.rows))
        except OffsetStoreError as exc:
            effects = self.core.on_flush_failed(flush.flush_id, runtime.now_ms_fine(), error=exc.message)
            self._store_failed("flush failed", exc, rows=len(flush.rows))
        else:
            effects = self.core.on_flush_done(flush.flush_id, runtime.now_ms_fine())
        self._apply(effects)
        self._wake.set()

    async def _probe(self, probe: Probe) -> None:
        try:
            await self._ensure_store()
            await self.store.ping()
        except OffsetStoreError as exc:
            effects = self.core.on_flush_failed(probe.flush_id, runtime.now_ms_fine(), error=exc.message)
            self._store_failed("store probe failed", exc)
        else:
            effects = self.core.on_flush_done(probe.flush_id, runtime.now_ms_fine())
        self._apply(effects)
        self._wake.set()

    async def _load(self, token: tuple) -> None:
        op, corr_id, after, limit = token
        try:
            await self._ensure_store()
            # One row more than asked for tells whether another page follows.
            rows = await self.store.load_page(None if after is None else tuple(after), limit + 1)
        except OffsetStoreError as exc:
            self._store_failed("load_offsets failed", exc)
            self._send(codec.encode_error(op, corr_id, exc))
            return
        except asyncio.CancelledError:
            self._send(codec.encode_error(op, corr_id, ShuttingDown("commit writer is stopping")))
            raise
        page, more = rows[:limit], len(rows) > limit
        # A page over the header limit is answered TOO_LARGE (by encode_reply); rows carry up
        # to 1000 hole ranges each, and the coordinator asks again with a smaller limit.
        self._send(codec.encode_reply(m.LoadOffsetsReply(rows=[r.to_wire() for r in page], more=more), corr_id))

    async def _cluster_op(self, op: str, corr_id: Any, msg: m.Message) -> None:
        """coordinator_lease, load_metadata, write_metadata: one store call, answered as it ends."""
        try:
            if isinstance(msg, m.WriteMetadata):  # checked before the store is touched
                changes = MetadataChanges.from_wire(msg.create_topics, msg.update_topics, msg.delete_topics,
                                                    msg.partitions, msg.group_configs)
            await self._ensure_store()
            if isinstance(msg, m.CoordinatorLease):
                lease = await self.store.acquire_or_renew_lease(msg.node_id, msg.endpoint, msg.lease_ms)
                self._apply(self.core.on_lease(lease, runtime.now_ms_fine()))
                reply: m.Message = m.CoordinatorLeaseReply(**lease.to_wire())
            elif isinstance(msg, m.LoadMetadata):
                meta = await self.store.load_metadata()
                reply = m.LoadMetadataReply(topics=[t.to_wire() for t in meta.topics.values()],
                                            partitions=[p.to_wire() for p in meta.partitions.values()],
                                            group_configs=[[g, c] for g, c in meta.group_configs.items()])
            else:
                applied = await self.store.write_metadata(changes, msg.coordinator_epoch)
                if not applied:
                    self.log.info("metadata change refused: a condition failed",
                                  coordinator_epoch=msg.coordinator_epoch)
                reply = m.WriteMetadataReply(applied=applied)
        except ZBrokerError as exc:  # a malformed change set, or the store failing
            if isinstance(exc, OffsetStoreError):
                self._store_failed(f"{op} failed", exc)
            self._send(codec.encode_error(op, corr_id, exc))
        except asyncio.CancelledError:
            self._send(codec.encode_error(op, corr_id, ShuttingDown("commit writer is stopping")))
            raise
        except Exception as exc:  # a bug: the coordinator still gets an answer, not a timeout
            self.log.exception(f"{op} failed unexpectedly")
            self._send(codec.encode_error(op, corr_id, ZBrokerError(f"{op} failed: {type(exc).__name__}", op=op)))
        else:
            self._send(codec.encode_reply(reply, corr_id))
        self._wake.set()

    def _store_failed(self, event: str, exc: ZBrokerError, **extra: Any) -> None:
        stats = self.core.statistics(runtime.now_ms_fine())
        self.log.warning(event, **{**exc.data, **extra, "error": exc.message,
                                   "consecutive_failures": stats["consecutive_failures"],
                                   "retry_in_ms": stats["backoff_ms"], "pending_keys": stats["pending_keys"]})


def _brief(metrics: dict) -> dict:
    keys = ("advances_received", "rows_flushed", "flushes", "flush_errors", "pending_keys",
            "waiting_requests", "ms_since_last_good_flush")
    return {k: metrics.get(k) for k in keys}
