"""Broker bugs the protocol fuzzers found, one minimal reproduction each.

They were written as strict xfails while the bugs were open and now guard
against their return; each asserts the correct behaviour.

Crashes (the actor process exits; the supervisor restarts it):

1. The coordinator matches a reply to its own outbound request by correlation id
   alone, from any ``partition:*``/``writer`` routing id, and the callbacks trust
   its shape (`CoordinatorShell.on_offsets_loaded`, `on_advance_reply`, the
   dead-letter callbacks, all run outside `on_request`'s guard).
2. A stored record that is a 4-character str, a 4-byte bin or a 4-entry map passes
   `protocol.batch.decode_fetched`'s shape check (``len(record) == 4``) and then
   raises TypeError, not CorruptBatch. The partition actor stores any payload with
   an array header, so one produced 6-byte payload crashes the coordinator when the
   record is dead-lettered, and every Python consumer's poll.
3. The partition actor serves ``assign`` on its client ROUTER (any client, without
   ``--curve``) and opens ``<data>/logs/<topic>/<partition>`` for whatever topic it
   is told: a ``../`` topic creates files outside the data directory, and a name
   too long for the file system raises OSError, which the actor treats as a disk
   failure and exits.
4. The partition actor applies the assignment in the coordinator's ``register``
   reply outside its request guard: a malformed assignment kills it.

Wrong answers:

5. UNSUPPORTED_VERSION quotes the whole ``v`` value (``repr``): a 300 KB request
   gets a 1.2 MB error reply, above the 1 MiB header limit every client enforces,
   and a log line as large.
6. Inputs the codec accepts and the actors then fail on (INTERNAL instead of
   BAD_REQUEST): ``produce`` with ``producer_id`` 0 and a ``sequence`` outside
   int32 (struct.error when the batch header is built), ``metadata`` with topic
   names that are not strings (unhashable in the registry).
7. `actors.runtime.configure_logging` has no ``format_exc_info``: every
   ``request.internal_error`` and ``log.io_error`` is logged as ``"exc_info": true``
   without the traceback.

Lost links:

8. Routing ids are the only proof of who an internal peer is, and the coordinator's
   ROUTER has ``ROUTER_HANDOVER``: a client that connects once with the routing id
   ``writer`` or ``partition:<id>`` (one frame, any content) takes the route, and the
   real actor's connection is left open but unrouted. It never reconnects, so after
   the impostor leaves the coordinator never hears from it again: no commit becomes
   durable, or the partitions of that actor have no endpoint, until the actor
   process restarts. Anyone who can reach the endpoint the actors dial can do it
   (the client endpoint on HEAD; the internal endpoint, where the coordinator
   advertises one, unless ``--curve`` keeps clients off it).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import msgpack
import pytest
import structlog
import zmq

from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.batch import CorruptBatch, build_batch_header, decode_fetched
from zbroker.protocol.errors import ProtocolError
from tests.fuzz.harness import actor_endpoint, alive
from tests.fuzz.single_actor import bind_router, spawn_actor, stop_actor, wait_for_request
from zbroker.client import Admin
from zbroker.client.sync import Connection
from zbroker.supervisor import free_port_block


def dealer(ctx: zmq.Context, endpoint: str, identity: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(endpoint)
    return sock


def still_alive_after(proc, seconds: float = 1.5) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not proc.is_alive():
            return False
        time.sleep(0.05)
    return proc.is_alive()


# -- 1. coordinator: replies to its outbound requests -------------------------------------------

@pytest.mark.processes
@pytest.mark.parametrize("sender, reply", [
    (b"writer", {"op": "load_offsets", "ok": True, "rows": [1]}),   # TypeError: tuple(1)
    (b"partition:x", {"op": "fetch", "ok": True, "log_start": 0, "log_end": 0}),  # AttributeError: .rows
], ids=["malformed-rows-from-writer", "fetch-reply-from-another-peer"])
def test_a_malformed_reply_to_a_pending_coordinator_request_does_not_kill_it(tmp_path, sender, reply):
    ctx = zmq.Context()
    endpoint = f"tcp://127.0.0.1:{free_port_block(1)}"
    coordinator = spawn_actor("zbroker.actors.group_coordinator.shell:run", endpoint, str(tmp_path / "coord"),
                              log_file=str(tmp_path / "coordinator.log"), log_level="warning")
    writer = other = None
    try:
        internal = actor_endpoint(endpoint)
        writer = dealer(ctx, internal, b"writer")
        other = writer if sender == b"writer" else dealer(ctx, internal, sender)
        # Playing the commit writer: once it reports, the coordinator asks it for the offsets.
        writer.send_multipart(codec.encode_request(m.WriterStatus(pid=1, healthy=True, metrics={}), None))
        # A term starts from the store's metadata (an empty store here), then the offsets.
        _prefix, meta = wait_for_request(writer, "load_metadata")
        writer.send_multipart(codec.encode_reply(m.LoadMetadataReply(topics=[], partitions=[]), meta.corr_id))
        _prefix, load = wait_for_request(writer, "load_offsets")
        other.send_multipart([msgpack.packb({"v": 1, "id": load.corr_id, **reply})])
        assert still_alive_after(coordinator), (tmp_path / "coordinator.log").read_text()[-3000:]
    finally:
        for sock in {id(s): s for s in (writer, other) if s is not None}.values():
            sock.close(linger=0)
        stop_actor(coordinator)
        ctx.term()


# -- 8. impersonating an internal actor's routing id -----------------------------------------------

@pytest.mark.processes
def test_an_impostor_routing_id_does_not_cut_the_real_actor_off(start):
    broker = start(log_level="warning")
    internal = actor_endpoint(broker.url)
    ctx = zmq.Context()
    impostors = [dealer(ctx, internal, identity) for identity in (b"writer", b"partition:p0")]
    try:
        for impostor in impostors:
            impostor.send_multipart([b"\xc1"])  # one frame is enough; its content does not matter
        time.sleep(0.3)
    finally:
        for impostor in impostors:
            impostor.close(linger=0)
        ctx.term()
    time.sleep(3.5)  # both re-announce themselves every second
    with Admin(broker.url) as admin:
        seen = {a["actor_id"]: a.get("last_seen_ms_ago") for a in admin.status()["actors"]}
    assert seen["writer"] < 3000 and seen["p0"] < 3000, seen


# -- 2. stored records that are not arrays ------------------------------------------------------

POISON_PAYLOAD = msgpack.packb(["abcd"])  # one "record": a 4-character string (6 bytes)


@pytest.mark.parametrize("record", ["abcd", b"abcd", {"a": 1, "b": 2, "c": 3, "d": 4}], ids=["str", "bin", "map"])
def test_a_stored_record_that_is_not_an_array_is_corrupt_batch(record):
    payload = msgpack.packb([record], use_bin_type=True)
    blob = build_batch_header(payload, base_offset=0, record_count=1, append_time_ms=1) + payload
    with pytest.raises(CorruptBatch):
        decode_fetched(blob, "t", 0)


@pytest.mark.processes
def test_dead_lettering_a_malformed_stored_record_does_not_kill_the_coordinator(start):
    broker = start(log_level="warning")
    with Admin(broker.url) as admin:
        admin.create_topic("poison", partitions=1)
    before = broker.pids()["coordinator"]
    conn = Connection(broker.url)
    try:
        conn.refresh(["poison"])
        try:
            conn.call(conn.endpoint("poison", 0), m.Produce(topic="poison", partition=0), (POISON_PAYLOAD,))
        except CorruptBatch:
            return  # the partition actor refuses to store it: nothing left to dead-letter
        join = conn.coordinator(m.Join(group="g", topics=["poison"]))
        deadline = time.monotonic() + 10
        deliveries: list = []
        while not deliveries and time.monotonic() < deadline:
            deliveries = conn.coordinator(m.Poll(group="g", member_id=join.member_id, generation=join.generation,
                                                 max_wait_ms=500)).deliveries
        topic, partition, lease, start_, end = deliveries[0][:5]
        conn.coordinator(m.Reject(group="g", member_id=join.member_id, generation=join.generation,
                                  ranges=[[topic, partition, lease, start_, end]], reason="unreadable"))
        time.sleep(1.5)
    finally:
        conn.close()
    assert alive(before) and broker.pids().get("coordinator") == before


# -- 3, 4. partition actor: assignments ----------------------------------------------------------

class LonePartitionActor:
    """A partition actor whose coordinator is the test (a ROUTER it binds)."""

    def __init__(self, tmp_path: Path) -> None:
        self.ctx = zmq.Context()
        self.router, endpoint = bind_router(self.ctx)
        self.data = tmp_path / "partitions"
        self.log_file = tmp_path / "partition.log"
        self.proc = spawn_actor("zbroker.actors.partition_log.shell:run", "p9", endpoint, str(self.data),
                                log_file=str(self.log_file), log_level="warning")
        self.client: zmq.Socket | None = None
        try:
            self.identity, self.register = wait_for_request(self.router, "register")
            self.client = dealer(self.ctx, self.register.msg.endpoint)
        except BaseException:
            self.close()
            raise

    def call(self, msg: m.Message, timeout_ms: int = 3000) -> codec.Envelope | None:
        self.client.send_multipart(codec.encode_request(msg, 1))
        return codec.decode_reply(self.client.recv_multipart()) if self.client.poll(timeout_ms) else None

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")[-3000:] if self.log_file.exists() else ""

    def close(self) -> None:
        if self.client is not None:
            self.client.close(linger=0)
        self.router.close(linger=0)
        stop_actor(self.proc)
        self.ctx.term()


@pytest.fixture
def lone_partition(tmp_path):
    actor = LonePartitionActor(tmp_path)
    yield actor
    actor.close()


@pytest.mark.processes
def test_assign_from_a_client_cannot_create_files_outside_the_data_dir(lone_partition, tmp_path):
    outside = tmp_path / "escaped"
    topic = os.path.relpath(outside, lone_partition.data / "logs")
    lone_partition.call(m.Assign(assignment=[[topic, 0, None]]))
    assert not outside.exists(), sorted(str(p.relative_to(tmp_path)) for p in outside.rglob("*"))


@pytest.mark.processes
def test_assign_with_an_overlong_topic_does_not_kill_the_partition_actor(lone_partition):
    lone_partition.call(m.Assign(assignment=[["x" * 300, 0, None]]))
    assert still_alive_after(lone_partition.proc), lone_partition.log()


@pytest.mark.processes
@pytest.mark.parametrize("assignment", [[[1]], [["t", "zero", None]], [["t", 0, "not a map"]]],
                         ids=["short-item", "partition-not-int", "config-not-map"])
def test_a_malformed_register_reply_does_not_kill_the_partition_actor(lone_partition, assignment):
    reply = {"v": 1, "op": "register", "id": lone_partition.register.corr_id, "ok": True, "assignment": assignment}
    lone_partition.router.send_multipart(lone_partition.identity + [msgpack.packb(reply)])
    assert still_alive_after(lone_partition.proc), lone_partition.log()


# -- 5, 6. wrong answers ---------------------------------------------------------------------------

def test_an_error_reply_to_a_large_header_stays_within_the_header_limit():
    request = msgpack.packb({"v": "\x00" * 300_000, "op": "status", "id": 1})
    with pytest.raises(ProtocolError) as info:
        codec.decode_request([request])
    reply = codec.encode_error(info.value.op, info.value.corr_id, info.value)
    assert len(reply[0]) <= codec.MAX_HEADER_BYTES
    assert codec.decode_reply(reply).error is not None


@pytest.mark.parametrize("msg", [
    m.Produce(topic="t", partition=0, producer_id=0, sequence=1 << 31),
    m.Produce(topic="t", partition=0, producer_id=0, sequence=-(1 << 63)),
    m.Metadata(topics=[["t"]]),
    m.Metadata(topics=[{"t": 1}]),
], ids=["sequence-2^31", "sequence-min-int64", "topic-list", "topic-map"])
def test_inputs_the_actors_cannot_serve_are_bad_requests(msg):
    with pytest.raises(ProtocolError):
        codec.decode_request(codec.encode_request(msg, 1))


# -- 7. logging ------------------------------------------------------------------------------------

@pytest.fixture
def restore_structlog():
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)
    structlog.contextvars.clear_contextvars()


def test_actor_logs_carry_the_traceback_of_an_internal_error(tmp_path, restore_structlog, monkeypatch):
    from zbroker.actors import runtime

    log_path = tmp_path / "actor.log"
    with open(log_path, "w") as stream:
        monkeypatch.setattr(sys, "stderr", stream)
        log = runtime.configure_logging("info", actor="test")
        try:
            {}["missing"]
        except KeyError:
            log.exception("request.internal_error", op="fetch")
    assert "KeyError" in log_path.read_text()
