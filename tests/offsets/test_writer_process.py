"""The commit writer as a real process (multiprocessing spawn), with the test as its coordinator.

The test binds a ROUTER on a random loopback port, as the coordinator does,
and speaks protocol v1 to the writer's DEALER. PostgreSQL outages are made
with a `TcpProxy` between the writer and the server, never by touching the
server.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import signal
import threading
import time

import msgpack
import pytest
import zmq

from zbroker.actors.commit_writer import shell
from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.errors import ErrorCode
from zbroker.storage.offsets import OffsetRow, open_offset_store
from tests.support.pg import PgSession, dsn_host_port, dsn_via, pg_execute, pg_fetch, with_schema
from tests.support.tcp_proxy import TcpProxy

pytestmark = pytest.mark.processes


class FakeCoordinator:
    """The coordinator's side of the writer channel: a ROUTER, replies sorted by correlation id."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted writer takes over its identity
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a missing writer fails loudly
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self._ids = itertools.count(1)
        self.replies: dict[int, codec.Envelope] = {}
        self.statuses: list[m.WriterStatus] = []
        self.anonymous_errors: list[codec.Envelope] = []

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def send(self, msg: m.Message) -> int:
        corr_id = next(self._ids)
        self.send_raw(codec.encode_request(msg, corr_id))
        return corr_id

    def send_raw(self, frames: list[bytes]) -> None:
        self.sock.send_multipart([shell.IDENTITY, *frames])

    def pump(self, timeout_s: float) -> bool:
        """Receive and file one message; False on timeout."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return False
        identity, *frames = self.sock.recv_multipart()
        # With ROUTER_HANDOVER a restarted writer takes the identity and the killed
        # writer's old connection is renamed to a generated id (a 0 byte and four
        # more): what the old writer sent before it died still drains from it.
        assert identity == shell.IDENTITY or (len(identity) == 5 and identity[0] == 0), identity
        is_reply, env = codec.decode_any(frames)
        if is_reply:
            if env.corr_id is None:
                self.anonymous_errors.append(env)
            else:
                self.replies[env.corr_id] = env
        elif isinstance(env.msg, m.WriterStatus):
            self.statuses.append(env.msg)
        return True

    def pump_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self.pump(left)

    def load_pages(self, limit: int) -> list:
        return load_pages(self, limit)

    def wait_reply(self, corr_id: int, timeout_s: float = 10.0) -> codec.Envelope:
        end = time.monotonic() + timeout_s
        while corr_id not in self.replies:
            left = end - time.monotonic()
            assert left > 0, f"no reply to request {corr_id} within {timeout_s}s"
            self.pump(left)
        return self.replies.pop(corr_id)

    def wait_status(self, healthy: bool, timeout_s: float = 15.0, pid: int | None = None) -> m.WriterStatus:
        """The latest status says `healthy` (and comes from `pid`: an old writer's may still be queued)."""
        end = time.monotonic() + timeout_s
        while True:
            last = self.statuses[-1] if self.statuses else None
            if last is not None and last.healthy is healthy and pid in (None, last.pid):
                return last
            left = end - time.monotonic()
            assert left > 0, f"writer never reported healthy={healthy}: {self.statuses[-1:]}"
            self.pump(min(left, 0.5))


@pytest.fixture
def coordinator():
    coord = FakeCoordinator()
    yield coord
    coord.close()


class WriterProcess:
    def __init__(self, endpoint: str, url: str, **kwargs) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.proc = ctx.Process(target=shell.run, args=(endpoint, url),
                                kwargs={"log_level": "warning", **kwargs}, daemon=True)
        self.proc.start()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int | None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, sig)
        self.proc.join(timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        code = self.proc.exitcode
        self.proc.close()
        return code


@pytest.fixture
def writers():
    """Start writer processes; all are killed at teardown. Request it after the fixtures that
    give the storage, so that it is torn down first: a writer still starting could otherwise
    migrate (recreate) a schema that pg_schema has just dropped."""
    started: list[WriterProcess] = []

    def start(endpoint: str, url: str, **kwargs) -> WriterProcess:
        w = WriterProcess(endpoint, url, **kwargs)
        started.append(w)
        return w

    yield start
    for w in started:
        try:
            w.stop(signal.SIGKILL, 5)
        except ValueError:  # already stopped and closed by the test
            pass


def advance(partition: int, committed: int, group: str = "g", topic: str = "t", epoch: int = 0) -> list:
    """A deterministic advance: holes follow from the offset, so a torn row would show."""
    return [group, topic, partition, committed, [[committed + 1, committed + 2]], 1, epoch]


def load_rows(url: str) -> list[OffsetRow]:
    async def go():
        store = open_offset_store(url)
        try:
            return await store.load_all()
        finally:
            await store.close()

    return asyncio.run(go())


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def offsets_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/offsets.db"
    return with_schema(request.getfixturevalue("pg_dsn"), request.getfixturevalue("pg_schema"))


# -- tests ------------------------------------------------------------------------------

def test_advances_become_rows_and_bad_frames_get_errors(coordinator, offsets_url, writers):
    writer = writers(coordinator.endpoint, offsets_url)
    status = coordinator.wait_status(healthy=True)
    assert status.pid == writer.proc.pid

    items = [advance(p, 10 + p) for p in range(3)] + [advance(0, 5), advance(1, 99, group="other")]
    reply = coordinator.wait_reply(coordinator.send(m.Advance(advances=items)))
    assert isinstance(reply.msg, m.AdvanceReply)
    assert sorted(reply.msg.durable) == [["g", "t", 0, 10, 0], ["g", "t", 1, 11, 0], ["g", "t", 2, 12, 0],
                                        ["other", "t", 1, 99, 0]]
    rows = load_rows(offsets_url)
    assert [(r.group_id, r.partition, r.committed_offset, r.holes) for r in rows] == [
        ("g", 0, 10, [(11, 12)]), ("g", 1, 11, [(12, 13)]), ("g", 2, 12, [(13, 14)]),
        ("other", 1, 99, [(100, 101)])]

    loaded = coordinator.wait_reply(coordinator.send(m.LoadOffsets()))
    assert loaded.msg.rows == [r.to_wire() for r in rows] and loaded.msg.more is False
    assert load_pages(coordinator, limit=1) == [r.to_wire() for r in rows]  # one row per page

    # Whatever arrives, the writer answers with an error and carries on.
    coordinator.send_raw([b"\xc1not msgpack"])
    bad = coordinator.send(m.Advance(advances=[advance(0, 20), ["g", "t", -1, 5, [], 1, 0]]))
    coordinator.send_raw([msgpack.packb({"v": 1, "op": "advance", "id": 4242, "advances": "nope"})])
    coordinator.send_raw([msgpack.packb({"v": 1, "op": "no_such_op", "id": 4243})])
    other = coordinator.send(m.Status())
    error = coordinator.wait_reply(bad).error
    assert error.code == ErrorCode.BAD_REQUEST and error.data["index"] == 1
    assert coordinator.wait_reply(4242).error.code == ErrorCode.BAD_REQUEST
    assert coordinator.wait_reply(4243).error.code == ErrorCode.UNKNOWN_OP
    assert coordinator.wait_reply(other).error.code == ErrorCode.UNKNOWN_OP
    coordinator.pump_for(0.2)
    assert [e.error.code for e in coordinator.anonymous_errors] == [ErrorCode.BAD_REQUEST]

    reply = coordinator.wait_reply(coordinator.send(m.Advance(advances=[advance(0, 21)])))
    assert reply.msg.durable == [["g", "t", 0, 21, 0]]
    assert writer.stop() == 0


def test_sigterm_flushes_what_is_pending_before_exiting(coordinator, writers, tmp_path):
    url = f"sqlite:///{tmp_path}/offsets.db"
    writer = writers(coordinator.endpoint, url, flush_interval_ms=60_000)
    coordinator.wait_status(healthy=True)
    corr_id = coordinator.send(m.Advance(advances=[advance(3, 7)]))
    coordinator.pump_for(0.3)
    assert corr_id not in coordinator.replies  # the interval is a minute
    os.kill(writer.proc.pid, signal.SIGTERM)
    assert coordinator.wait_reply(corr_id).msg.durable == [["g", "t", 3, 7, 0]]
    assert writer.stop() == 0
    assert [(r.partition, r.committed_offset) for r in load_rows(url)] == [(3, 7)]


class TableWatcher:
    """Samples the offsets table straight from the server (not through the proxy) on a thread,
    and records any key whose offset ever went down."""

    def __init__(self, dsn: str, schema: str) -> None:
        self.session = PgSession(dsn)
        self.sql = f'SELECT partition, committed_offset FROM "{schema}".consumer_group_offsets'
        self.last: dict[int, int] = {}
        self.backwards: list[tuple[int, int, int]] = []
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="table-watcher", daemon=True)
        self._thread.start()

    def snapshot(self) -> dict[int, int]:
        return {r[0]: r[1] for r in self.session.fetch(self.sql)}

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for partition, committed in self.snapshot().items():
                before = self.last.get(partition, -1)
                if committed < before:
                    self.backwards.append((partition, before, committed))
                self.last[partition] = committed
            self.samples += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.session.close()


@pytest.mark.postgres
def test_outage_through_a_cut_proxy_then_catch_up(coordinator, pg_dsn, pg_schema, writers):
    keys = 20
    with TcpProxy(dsn_host_port(pg_dsn)) as proxy:
        url = with_schema(dsn_via(pg_dsn, proxy.port), pg_schema)
        writer = writers(coordinator.endpoint, url)
        coordinator.wait_status(healthy=True)
        watcher = TableWatcher(pg_dsn, pg_schema)
        try:
            sent: dict[int, tuple[int, int]] = {}  # corr_id -> (round, phase)
            answered: dict[int, codec.Envelope] = {}
            rnd = itertools.count(1)

            def send_for(seconds: float, phase: str) -> int:
                end = time.monotonic() + seconds
                last = 0
                while time.monotonic() < end:
                    last = next(rnd)
                    cid = coordinator.send(m.Advance(advances=[advance(p, last) for p in range(keys)]))
                    sent[cid] = (last, phase)
                    coordinator.pump_for(0.005)
                    answered.update(coordinator.replies)
                    coordinator.replies.clear()
                return last

            send_for(0.5, "before")
            proxy.cut()
            send_for(0.3, "cut")
            coordinator.wait_status(healthy=False, timeout_s=5)
            time.sleep(0.2)  # let a statement that was already running on the server finish
            frozen = watcher.snapshot()
            send_for(1.0, "cut")
            load = coordinator.send(m.LoadOffsets())
            error = coordinator.wait_reply(load, timeout_s=5).error
            assert error.code == ErrorCode.UNAVAILABLE and error.retriable
            status = coordinator.statuses[-1]
            assert status.metrics["pending_keys"] <= keys  # bounded by keys, not commits
            assert status.metrics["flush_errors"] >= 1
            # The database did not move during the cut, so every reply received so far must
            # be covered by what it holds now: nothing was reported durable before it was.
            assert watcher.snapshot() == frozen
            answered.update(coordinator.replies)
            coordinator.replies.clear()
            for cid, env in answered.items():
                for _g, _t, partition, committed, _epoch in env.msg.durable:
                    assert committed <= frozen[partition], (cid, sent[cid])

            proxy.restore()
            final_round = send_for(0.5, "after")
            for cid in sent:
                if cid not in answered:
                    answered[cid] = coordinator.wait_reply(cid, timeout_s=15)
            coordinator.wait_status(healthy=True, timeout_s=10)
            assert all(env.ok for env in answered.values())
            rows = load_rows(with_schema(pg_dsn, pg_schema))
            assert {(r.partition, r.committed_offset) for r in rows} == {(p, final_round) for p in range(keys)}
            assert all(r.holes == [(final_round + 1, final_round + 2)] for r in rows)
            assert watcher.samples > 10 and not watcher.backwards
        finally:
            watcher.close()
    assert writer.stop() == 0


@pytest.mark.postgres
def test_sigkill_mid_batch_then_restart_leaves_a_consistent_table(coordinator, pg_dsn, pg_schema, writers):
    keys = 4000  # one flush carries them all: a long enough statement to be caught running
    url = with_schema(pg_dsn, pg_schema)
    writer = writers(coordinator.endpoint, url, batch_size=keys)
    coordinator.wait_status(healthy=True)

    def round_items(r: int) -> list:
        return [advance(p % 100, r, group=f"g{p // 100}") for p in range(keys)]

    durable_round = 0
    caught_running = False
    with PgSession(pg_dsn) as session:
        watch_sql = ("SELECT count(*) FROM pg_stat_activity WHERE state = 'active' "
                     "AND position('INSERT INTO' in query) > 0 AND position($1 in query) > 0")
        deadline = time.monotonic() + 20
        r = 0
        while time.monotonic() < deadline:
            r += 1
            coordinator.send(m.Advance(advances=round_items(r)))
            coordinator.pump_for(0.001)
            for env in coordinator.replies.values():
                durable_round = max(durable_round, max(d[3] for d in env.msg.durable))
            coordinator.replies.clear()
            if durable_round >= 2 and session.fetchval(watch_sql, f'"{pg_schema}"'):
                caught_running = True
                break
        os.kill(writer.proc.pid, signal.SIGKILL)
        assert writer.stop() == -signal.SIGKILL
        assert caught_running, "never saw the writer's INSERT running"
        # The server finishes (and commits) a statement whose client died: wait for it.
        settle = time.monotonic() + 10
        while session.fetchval(watch_sql, f'"{pg_schema}"'):
            assert time.monotonic() < settle, "the orphaned INSERT never finished"
            time.sleep(0.01)

        rows = load_rows(url)
        assert len(rows) == keys
        committed = {r.committed_offset for r in rows}
        assert len(committed) == 1, "a flush is one transaction: all keys or none"
        (table_round,) = committed
        assert table_round >= durable_round  # nothing reported durable was lost
        assert all(r.holes == [(table_round + 1, table_round + 2)] for r in rows)

        # Restart: it serves the table, shrugs off a replay and moves on.
        restarted = writers(coordinator.endpoint, url, batch_size=keys)
        coordinator.wait_status(healthy=True, pid=restarted.proc.pid)
        coordinator.replies.clear()
        assert load_pages(coordinator, limit=1500) == sorted(r.to_wire() for r in rows)
        replay = coordinator.wait_reply(coordinator.send(m.Advance(advances=round_items(1))))
        assert replay.ok and len(replay.msg.durable) == keys
        assert {row.committed_offset for row in load_rows(url)} == {table_round}  # not backwards
        nxt = coordinator.wait_reply(coordinator.send(m.Advance(advances=round_items(r + 1))))
        assert {d[3] for d in nxt.msg.durable} == {r + 1}
        assert {row.committed_offset for row in load_rows(url)} == {r + 1}


@pytest.mark.postgres
def test_sigterm_while_the_database_is_down_answers_and_exits(coordinator, pg_dsn, pg_schema, writers):
    with TcpProxy(dsn_host_port(pg_dsn)) as proxy:
        writer = writers(coordinator.endpoint, with_schema(dsn_via(pg_dsn, proxy.port), pg_schema))
        coordinator.wait_status(healthy=True)
        proxy.cut()
        corr_id = coordinator.send(m.Advance(advances=[advance(0, 5)]))
        coordinator.wait_status(healthy=False, timeout_s=5)
        started = time.monotonic()
        os.kill(writer.proc.pid, signal.SIGTERM)
        error = coordinator.wait_reply(corr_id, timeout_s=10).error
        assert error.code == ErrorCode.SHUTTING_DOWN  # not durable, and not left hanging
        assert writer.stop() == 0
        assert time.monotonic() - started < shell.SHUTDOWN_GRACE_MS / 1000 + 3


def load_pages(coordinator, limit: int) -> list:
    """Page through load_offsets as the coordinator does: ``after`` = the last row's key."""
    rows, after = [], None
    while True:
        reply = coordinator.wait_reply(coordinator.send(m.LoadOffsets(after=after, limit=limit)))
        rows += reply.msg.rows
        if not reply.msg.more:
            return rows
        after = rows[-1][:3]


# -- the cluster ops: lease, metadata, fenced flushes (issues 25, 26) -----------------------

TOPIC = ["orders", 1, {"segment_bytes": 1048576}, 3, 2, 42]
PARTITION = ["orders", 0, ["a", "b", "c"], "a", 0, ["a", "b", "c"]]


def test_the_writer_serves_the_lease_and_metadata_ops(coordinator, offsets_url, writers):
    writers(coordinator.endpoint, offsets_url)
    coordinator.wait_status(healthy=True)  # connected
    lease = coordinator.wait_reply(coordinator.send(
        m.CoordinatorLease(node_id="n1", endpoint="tcp://127.0.0.2:5555", lease_ms=5000))).msg
    assert (lease.holder, lease.holder_endpoint, lease.epoch, lease.held) == ("n1", "tcp://127.0.0.2:5555", 1, True)
    assert 0 < lease.remaining_ms <= 5000
    write = m.WriteMetadata(coordinator_epoch=1, create_topics=[TOPIC], partitions=[[*PARTITION, None]])
    assert coordinator.wait_reply(coordinator.send(write)).msg.applied is True
    assert coordinator.wait_reply(coordinator.send(write)).msg.applied is False  # the topic exists now
    loaded = coordinator.wait_reply(coordinator.send(m.LoadMetadata())).msg
    assert (loaded.topics, loaded.partitions) == ([TOPIC], [PARTITION])
    bad = m.WriteMetadata(coordinator_epoch=1, partitions=[["orders", 0, [], None, 0, [], None]])
    assert coordinator.wait_reply(coordinator.send(bad)).error.code == ErrorCode.BAD_REQUEST
    reply = coordinator.wait_reply(coordinator.send(m.Advance(advances=[advance(0, 3)])))
    assert reply.msg.durable == [["g", "t", 0, 3, 0]]


@pytest.mark.postgres
def test_a_deposed_nodes_writer_changes_nothing_proved_by_a_query(pg_dsn, pg_schema, writers):
    url = with_schema(pg_dsn, pg_schema)
    old, new = FakeCoordinator(), FakeCoordinator()
    try:
        writers(old.endpoint, url)
        writers(new.endpoint, url)
        old.wait_status(healthy=True)
        new.wait_status(healthy=True)

        def ask(coord, node):
            return coord.wait_reply(coord.send(m.CoordinatorLease(node_id=node, endpoint=f"tcp://{node}:1",
                                                                  lease_ms=5000))).msg

        assert ask(old, "old").held and not ask(new, "new").held
        assert old.wait_reply(old.send(m.Advance(advances=[advance(0, 10)]))).msg.durable == [["g", "t", 0, 10, 0]]
        assert old.wait_reply(old.send(m.WriteMetadata(coordinator_epoch=1, create_topics=[TOPIC]))).msg.applied
        # The old leader is paused past its lease (by hand here: its lease ends now) and replaced.
        pg_execute(pg_dsn, f'UPDATE "{pg_schema}".zbroker_coordinator_lease SET expires_at = now()')
        taken = ask(new, "new")
        assert (taken.held, taken.epoch) == (True, 2)
        # It wakes up and carries on as if it still led: the store refuses all of it.
        refused = old.wait_reply(old.send(m.Advance(advances=[advance(0, 99), advance(1, 99)]))).error
        assert refused.code == ErrorCode.STALE_EPOCH and refused.data["epoch"] == 2 and refused.data["got"] == 1
        stale = m.WriteMetadata(coordinator_epoch=1, delete_topics=[["orders", 42]])
        assert old.wait_reply(old.send(stale)).msg.applied is False
        assert new.wait_reply(new.send(m.Advance(advances=[advance(0, 20)]))).msg.durable == [["g", "t", 0, 20, 0]]
        assert new.wait_reply(new.send(m.LoadMetadata())).msg.topics == [TOPIC]
    finally:
        old.close()
        new.close()
    rows = pg_fetch(pg_dsn, f'SELECT partition, committed_offset, coordinator_epoch FROM "{pg_schema}".'
                            "consumer_group_offsets ORDER BY partition")
    assert [tuple(r) for r in rows] == [(0, 20, 2)]
    assert [tuple(r) for r in pg_fetch(pg_dsn, f'SELECT name FROM "{pg_schema}".zbroker_topics')] == [("orders",)]
    # Nothing in the database was written by epoch 1 after epoch 2 was taken.
    late_sql = (f'SELECT count(*) FROM "{pg_schema}".consumer_group_offsets AS o '
                f'JOIN "{pg_schema}".zbroker_coordinator_epochs AS e ON e.epoch > o.coordinator_epoch '
                "WHERE o.coordinator_epoch > 0 AND o.updated_at >= e.taken_at")
    late = pg_fetch(pg_dsn, late_sql)
    assert late[0][0] == 0
    # The same query on a crafted bad history: an unfenced store let epoch 1 write after the takeover.
    pg_execute(pg_dsn, f'UPDATE "{pg_schema}".consumer_group_offsets SET coordinator_epoch = 1, updated_at = now()')
    assert pg_fetch(pg_dsn, late_sql)[0][0] == 1
