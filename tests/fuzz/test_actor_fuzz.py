"""Protocol fuzzing of every actor socket on real processes (issue #6).

Each test sends ``ZBROKER_FUZZ_FRAMES`` (100,000 by default) random and mutated
messages to one actor socket, pipelined over several connections, while an
honest client keeps working on another connection. It then checks:

* the actor never died: same pid, present in /proc, no ``actor.died`` in the
  supervisor log;
* every reply it sent is a well-formed protocol reply;
* the honest client was served during the fuzz (no errors, bounded latency)
  and after it;
* the actor's RSS stayed within ``RSS_BOUND`` of its warmed-up baseline.

Sockets fuzzed: the coordinator's ROUTER (clients, plus forged ``partition:``
and ``writer`` routing ids sending internal ops and fake replies), the
partition actor's ROUTER, and the commit writer's coordinator link (the test
plays the coordinator: the writer dials a ROUTER the test binds).

Kept out of these runs, each for a reason named where it is done:

* mutated ``create_topic`` never creates a topic (`frames.coordinator_guard`):
  topic creation is state, not input;
* long polls in the templates wait 10-20 ms (mutations reach 256 ms, rarely more):
  unbounded parking is a limit, tested in tests/limits.

Drop an exclusion when its bug is fixed.
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from typing import Callable

import msgpack
import pytest
import zmq

from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.errors import Fenced, UnknownMember
from tests.fuzz import frames as fz
from tests.fuzz.frames import CoordinatorContext, FrameMutator
from tests.fuzz.harness import (MIB, ActorWatch, FuzzPump, ValidClient, actor_endpoint, alive,
                                supervisor_log_deaths)
from zbroker.client import Admin, Consumer, Producer, fetch
from zbroker.client.sync import Connection

pytestmark = pytest.mark.processes

RSS_BOUND = 64 * MIB
WARMUP = 10_000  # frames before the RSS baseline: allocator arenas, caches, first replies
CORPUS = 400  # Hypothesis-built messages mixed into each live run
MAX_ROUND_S = 10.0  # an honest request may wait behind the fuzz backlog, not longer
# Forged replies carry ids the actor's own outbound requests cannot reach for
# decades; ids that can match a pending request crash the coordinator (see
# test_known_bugs.test_a_malformed_reply_to_a_pending_coordinator_request_does_not_kill_it).
FORGED_REPLY_IDS = (1, 1 << 63)  # any id: the coordinator also checks the peer and the op


def hypothesis_corpus(templates: list[fz.Template], n: int, seed: int,
                      guard: Callable[[dict], dict] | None = None) -> list[list[bytes]]:
    """`n` messages drawn by Hypothesis from the structured/byte/frame strategies."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    corpus: list[list[bytes]] = []

    @hseed(seed)
    @settings(max_examples=n, phases=[Phase.generate], database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(fz.fuzz_messages(templates))
    def collect(message: list[bytes]) -> None:
        if guard is not None:
            try:
                header = msgpack.unpackb(message[0], raw=False)
            except Exception:  # not a map: nothing to guard
                header = None
            if isinstance(header, dict):
                message = [fz.pack(guard(header)), *message[1:]]
        corpus.append(message)

    collect()
    return corpus


def broker_log(tmp_path: Path) -> Path:
    return tmp_path / "broker.log"


def assert_survived(watch: ActorWatch, pids_before: dict[str, int], pids_after: dict[str, int],
                    log_file: Path, seed: int) -> None:
    for name, pid in watch.pids.items():
        assert alive(pid), f"{name} (pid {pid}) is gone; seed {seed}"
        assert pids_after.get(name) == pids_before[name], f"{name} was restarted; seed {seed}"
    deaths = supervisor_log_deaths(log_file)
    assert not deaths, f"seed {seed}: {deaths[:3]}"


def report(name: str, stats, watch: ActorWatch, client: ValidClient | None) -> str:
    line = (f"{name}: {stats.sent} frames in {stats.seconds:.1f}s ({stats.rate:,.0f}/s), "
            f"{stats.replies} replies {dict(stats.codes.most_common(8))}, stalls {stats.stalls}, "
            f"rss {watch.summary()}")
    if stats.requests_received:
        line += f", requests the actor sent the forged peers {dict(stats.requests_received)}"
    if client is not None:
        line += f", valid client {client.summary()}"
    print(line)
    return line


# ==============================================================================================
# Coordinator
# ==============================================================================================

class FuzzMember:
    """A member of the fuzz group that really joined and holds leases, refreshed now and then.

    Its name, generation and lease ids go into the templates, so that forged lease ids and
    generations are compared against live state and valid ranges reach ack/nack/extend/reject.
    """

    def __init__(self, url: str, topic: str, group: str) -> None:
        self.conn = Connection(url, request_timeout=10.0)
        self.producer = Producer(url, linger_ms=0)
        self.ctx = CoordinatorContext(topic=topic, group=group)
        self.topic = topic

    def refresh(self) -> CoordinatorContext:
        """Re-join (the fuzz may have fenced, expired or re-subscribed the member) and lease more."""
        ctx = self.ctx
        try:
            join = self.conn.coordinator(m.Join(group=ctx.group, topics=[self.topic], member_id=ctx.member_id,
                                                session_timeout_ms=60_000))
            ctx.member_id, ctx.generation = join.member_id, join.generation
            deliveries = self.conn.coordinator(m.Poll(group=ctx.group, member_id=ctx.member_id,
                                                      generation=ctx.generation, max_records=40)).deliveries
        except (Fenced, UnknownMember):
            return ctx  # a fuzzed join moved the group on meanwhile: next time

        if deliveries:
            ctx.leases = [d[:5] for d in deliveries]
        else:
            self.producer.produce(self.topic, [b"more"] * 50)
        return ctx

    def close(self) -> None:
        self.producer.close()
        self.conn.close()


def coordinator_round(url: str) -> tuple:
    """An honest consumer: produce 10, poll them, ack them, read metadata."""
    admin = Admin(url, request_timeout=MAX_ROUND_S)
    producer = Producer(url, linger_ms=0, request_timeout=MAX_ROUND_S)
    consumer = Consumer(url, group="valid-g", topics=["valid"], request_timeout=MAX_ROUND_S)
    sent = [0]

    def one_round() -> None:
        n = sent[0]
        producer.produce("valid", [f"v{n + i}".encode() for i in range(10)])
        sent[0] += 10
        got = []
        deadline = time.monotonic() + MAX_ROUND_S
        while len(got) < 10 and time.monotonic() < deadline:
            for rec in consumer.poll(max_records=100, timeout=0.2):
                got.append(rec)
                consumer.ack(rec)
        consumer.flush_acks()
        assert len(got) >= 10, f"consumed {len(got)} of 10 records"
        assert admin.metadata(["valid"])[0]["partitions"][0]["endpoint"]

    def close() -> None:
        consumer.close()
        producer.close()
        admin.close()
    return one_round, close


def test_coordinator_survives_100k_fuzzed_frames(start, tmp_path, rng, fuzz_seed, fuzz_frames):
    broker = start(log_level="warning")
    with Admin(broker.url) as admin:
        admin.create_topic("valid", partitions=1)
        admin.create_topic("fz", partitions=2)
    with Producer(broker.url) as producer:
        producer.produce("fz", [b"r"] * 2000)
    member = FuzzMember(broker.url, "fz", "fz-g")
    ctx = member.refresh()
    forged_id = lambda: rng.randrange(*FORGED_REPLY_IDS)  # noqa: E731
    templates = lambda: (fz.coordinator_templates(ctx)  # noqa: E731
                         + fz.coordinator_reply_templates(forged_id))
    guard = fz.coordinator_guard("fz")
    mutator = FrameMutator(rng, templates(), keep_ids=forged_id, guard=guard, huge_header_every=20_000,
                           corpus=hypothesis_corpus(templates(), CORPUS, fuzz_seed, guard))
    pids = broker.pids()
    watch = ActorWatch({"coordinator": pids["coordinator"]})
    one_round, close_client = coordinator_round(broker.url)
    client = ValidClient("valid-consumer", one_round)
    zctx = zmq.Context()
    # Internal ops and forged replies go to the coordinator's internal endpoint (as actors
    # that are not the broker's) and to the client endpoint (as clients posing as actors).
    # A lane cannot use the identity `writer` there: the real writer holds it, and without
    # ROUTER_HANDOVER an identity in use is never served to anyone else (test_known_bugs, 8).
    internal = actor_endpoint(broker.url)
    pump = FuzzPump.dealers(zctx, [(broker.url, None), (broker.url, None), (broker.url, b"writer"),
                                   (internal, b"partition:fz-2"), (internal, b"partition:fz-3")])
    last_refresh = [time.monotonic()]

    def periodic(sent: int) -> None:
        if not watch.baseline:
            if sent >= min(WARMUP, fuzz_frames // 10):
                watch.set_baseline()
        else:
            watch.sample()
        if time.monotonic() - last_refresh[0] > 1.0:
            last_refresh[0] = time.monotonic()
            member.refresh()
            mutator.templates = templates()

    try:
        client.start()
        pump.run(mutator, fuzz_frames, periodic=periodic)
        stats = pump.settle()
        watch.sample()
        client.stop()
        one_round()  # and still served after the fuzz
    finally:
        client.stop_event.set()
        pump.close()
        zctx.term()
        member.close()
        close_client()
    report("coordinator", stats, watch, client)
    assert_survived(watch, pids, broker.pids(), broker_log(tmp_path), fuzz_seed)
    assert not stats.malformed_replies, "\n".join(str(r)[:1500] for r in stats.malformed_replies[:3])
    assert stats.replies > fuzz_frames // 5  # the rest were tells, or dropped (forged actors get no error)
    assert not client.errors, client.errors[:5]
    assert client.rounds >= 3 and max(client.latencies) < MAX_ROUND_S
    assert watch.peak_growth("coordinator") < RSS_BOUND, watch.summary()


# ==============================================================================================
# Partition actor
# ==============================================================================================

def partition_round(url: str) -> tuple:
    """An honest producer and reader on the same actor: what it wrote comes back intact."""
    producer = Producer(url, linger_ms=0, request_timeout=MAX_ROUND_S)
    conn = Connection(url, request_timeout=MAX_ROUND_S)
    state = {"n": 0}

    def one_round() -> None:
        values = [f"p{state['n'] + i}".encode() for i in range(20)]
        state["n"] += 20
        handles = producer.produce("valid", values)
        records, _start, _end = fetch(conn, "valid", 0, handles[0].offset, max_bytes=1 << 16)
        assert [r.value for r in records[:20]] == values

    def close() -> None:
        conn.close()
        producer.close()
    return one_round, close


def test_partition_actor_survives_100k_fuzzed_frames(start, tmp_path, rng, fuzz_seed, fuzz_frames):
    broker = start(log_level="warning")
    with Admin(broker.url) as admin:
        admin.create_topic("valid", partitions=1)
        admin.create_topic("fz", partitions=1)
        endpoint = admin.metadata(["fz"])[0]["partitions"][0]["endpoint"]
    with Producer(broker.url) as producer:
        producer.produce("fz", [b"r"] * 100)
    conn = Connection(broker.url)
    log_end = [100]
    templates = lambda: fz.partition_templates("fz", log_end[0])  # noqa: E731
    mutator = FrameMutator(rng, templates(), ops=set(m.REQUESTS) - {"assign"} | {"fz_op"},
                           big_payload_bytes=(8 << 20) + 1, big_every=5_000, huge_header_every=20_000,
                           corpus=hypothesis_corpus(templates(), CORPUS, fuzz_seed))
    pids = broker.pids()
    watch = ActorWatch({"partition-0": pids["partition-0"]})
    one_round, close_client = partition_round(broker.url)
    client = ValidClient("valid-producer", one_round)
    zctx = zmq.Context()
    pump = FuzzPump.dealers(zctx, [(endpoint, None)] * 4)
    last_refresh = [time.monotonic()]

    def periodic(sent: int) -> None:
        if not watch.baseline:
            if sent >= min(WARMUP, fuzz_frames // 10):
                watch.set_baseline()
        else:
            watch.sample()
        if time.monotonic() - last_refresh[0] > 1.0:
            last_refresh[0] = time.monotonic()
            _records, _start, log_end[0] = fetch(conn, "fz", 0, 0, max_bytes=1)
            mutator.templates = templates()

    try:
        client.start()
        pump.run(mutator, fuzz_frames, periodic=periodic)
        stats = pump.settle()
        watch.sample()
        client.stop()
        one_round()
    finally:
        client.stop_event.set()
        pump.close()
        zctx.term()
        conn.close()
        close_client()
    report("partition-0", stats, watch, client)
    assert_survived(watch, pids, broker.pids(), broker_log(tmp_path), fuzz_seed)
    assert not stats.malformed_replies, "\n".join(str(r)[:1500] for r in stats.malformed_replies[:3])
    assert stats.replies >= fuzz_frames * 0.99  # everything is answered but messages over 64 MiB
    assert not client.errors, client.errors[:5]
    assert client.rounds >= 3 and max(client.latencies) < MAX_ROUND_S
    assert watch.peak_growth("partition-0") < RSS_BOUND, watch.summary()


# ==============================================================================================
# Commit writer: the test plays the coordinator
# ==============================================================================================

def _run_writer(endpoint: str, url: str, log_file: str) -> None:
    import os

    from zbroker.actors.commit_writer.shell import run
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)  # one warning per rejected frame: keep them out of the test output
    os.close(fd)
    run(endpoint, url, log_level="warning")


def test_commit_writer_survives_100k_fuzzed_frames(tmp_path, rng, fuzz_seed, fuzz_frames):
    zctx = zmq.Context()
    router = zctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue to the writer is backpressure, not a drop
    router.setsockopt(zmq.RCVHWM, 0)
    router.bind("tcp://127.0.0.1:*")
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    writer = multiprocessing.get_context("spawn").Process(
        target=_run_writer, args=(endpoint, f"sqlite:///{tmp_path / 'offsets.sqlite3'}", str(tmp_path / "writer.log")),
        daemon=True)
    writer.start()
    durable: dict[int, list] = {}
    valid_sent: dict[int, float] = {}

    def on_reply(env: codec.Envelope) -> None:
        if isinstance(env.corr_id, int) and env.corr_id in valid_sent and env.msg is not None:
            durable[env.corr_id] = env.msg.durable

    pump = FuzzPump(zctx, [(router, [b"writer"])], on_reply=on_reply)
    try:
        deadline = time.monotonic() + 30
        while pump.stats.requests_received["writer_status"] == 0:
            assert time.monotonic() < deadline, "the commit writer never reported"
            pump.drain(100)
        watch = ActorWatch({"commit-writer": writer.pid})
        templates = fz.writer_templates()
        mutator = FrameMutator(rng, templates, corpus=hypothesis_corpus(templates, CORPUS, fuzz_seed),
                               huge_header_every=20_000)
        valid_ids = iter(range(1 << 50, (1 << 50) + 1_000_000))

        def send_valid_advance(committed: int) -> None:
            corr = next(valid_ids)
            valid_sent[corr] = time.monotonic()
            pump.send(router, [b"writer", *codec.encode_request(
                m.Advance(advances=[["valid-g", "valid-t", 0, committed, [], 1, 0]]), corr)])

        def periodic(sent: int) -> None:
            if not watch.baseline:
                if sent >= WARMUP:
                    watch.set_baseline()
            else:
                watch.sample()
            send_valid_advance(sent)

        pump.run(mutator, fuzz_frames, periodic=periodic)
        send_valid_advance(fuzz_frames)
        stats = pump.settle(quiet_ms=1500)
        watch.sample()
        corr = next(valid_ids)
        pump.send(router, [b"writer", *codec.encode_request(m.LoadOffsets(), corr)])
        rows: list = []

        def on_rows(env: codec.Envelope) -> None:
            if env.corr_id == corr and env.msg is not None:
                rows.extend(env.msg.rows)
        pump.on_reply = on_rows
        deadline = time.monotonic() + 10
        while not rows and time.monotonic() < deadline:
            pump.drain(100)
        report("commit-writer", stats, watch, None)
        assert writer.is_alive() and alive(writer.pid), f"the commit writer died; seed {fuzz_seed}"
        assert not stats.malformed_replies, "\n".join(str(r)[:1500] for r in stats.malformed_replies[:3])
        assert stats.replies >= fuzz_frames * 0.9  # all but tells and replies sent to the writer
        answered = [c for c in valid_sent if c in durable]
        assert len(answered) == len(valid_sent), f"{len(valid_sent) - len(answered)} valid advances unanswered"
        assert ["valid-g", "valid-t", 0, fuzz_frames, [], 1, 0] in rows
        assert watch.peak_growth("commit-writer") < RSS_BOUND, watch.summary()
    finally:
        pump.close()
        writer.terminate()
        writer.join(10)
        if writer.is_alive():
            writer.kill()
            writer.join(5)
        router.close(linger=0)
        zctx.term()
