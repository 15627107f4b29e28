"""Limits (issue #6): nothing a client does grows an actor's memory without bound.

Each limit is bounded with a clear error or with backpressure:

* an oversize batch is TOO_LARGE and writes nothing; a message over the 64 MiB
  socket limit costs its sender the connection, not the actor memory;
* a member holds at most ``max_in_flight`` leased records: polls then return no
  deliveries (not an error) until it acks;
* many connections are all answered, and their file descriptors are released;
* a consumer that never reads gets its small replies dropped at the send
  high-water mark while everyone else is served;
* a producer faster than the disk is held back by its in-flight window.

Where the broker misses a bound today the test is a strict xfail that says
which, with the numbers measured when it was written (2 cores, loopback):

* replies are bounded in *count* (SNDHWM 10,000 per peer), not bytes: fetch
  replies to a consumer that never reads pile up in the partition actor (15,000
  fetches of ~1 MB batches took it past 3 GB);
* parked long polls have no bound: 100,000 ``fetch`` at the log end with
  ``max_wait_ms`` cost the partition actor ~60 MB, as many ``poll`` cost the
  coordinator ~70 MB, for up to a minute each;
* every ``extend`` adds a timer that lives until its deadline (200,000 extends of
  one lease: 200,000 timers, +32 MB);
* incoming messages are bounded in count (RCVHWM 10,000) not bytes, and the
  Python producer's window counts records, not bytes: pipelining 2,000 x 256 KiB
  (fsync always) put ~470 MB in the client's queue and +166 MB in the actor.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest
import zmq

from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.batch import encode_records
from zbroker.protocol.errors import ErrorCode
from tests.fuzz.harness import MIB, alive, open_fds, rss_bytes
from zbroker.client import Admin, Producer
from zbroker.client.sync import Connection, ProduceError
from zbroker.supervisor import start_broker

pytestmark = pytest.mark.processes

RSS_BOUND = 64 * MIB
MAX_BATCH_BYTES = 8 << 20  # the partition actor's default max_batch_bytes
MAX_MESSAGE_BYTES = 64 << 20  # actors.runtime.MAX_MESSAGE_BYTES


@pytest.fixture(scope="module")
def shared_broker(tmp_path_factory):
    """One broker for the limits that hold today (each test uses its own topic)."""
    data = tmp_path_factory.mktemp("limits")
    handle = start_broker(data / "data", log_level="warning", log_file=data / "broker.log")
    yield handle
    handle.stop()


def dealer(ctx: zmq.Context, endpoint: str, **options: int) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(endpoint)
    return sock


def call(sock: zmq.Socket, msg: m.Message, frames: tuple = (), corr: int = 1, timeout_ms: int = 10_000):
    """One request, one reply. No reply raises TimeoutError: never mistaken for a limit's assertion."""
    sock.send_multipart(codec.encode_request(msg, corr, frames))
    if not sock.poll(timeout_ms):
        raise TimeoutError(f"no reply to {msg.op} within {timeout_ms} ms")
    return codec.decode_reply(sock.recv_multipart())


def make_topic(broker, name: str, partitions: int = 1) -> str:
    """Create the topic and wait until its partition actor serves it; returns partition 0's endpoint."""
    with Admin(broker.url) as admin:
        admin.create_topic(name, partitions=partitions)
        deadline = time.monotonic() + 10
        while True:
            endpoint = admin.metadata([name])[0]["partitions"][0]["endpoint"]
            if endpoint:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} never placed")
            time.sleep(0.02)
    ctx = zmq.Context()
    sock = dealer(ctx, endpoint)
    try:
        while call(sock, m.Fetch(topic=name, partition=0, offset=0)).error is not None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} never opened")
            time.sleep(0.02)
    finally:
        sock.close(linger=0)
        ctx.term()
    return endpoint


def log_end(sock: zmq.Socket, topic: str) -> int:
    return call(sock, m.Fetch(topic=topic, partition=0, offset=0, max_bytes=1), corr=99).msg.log_end


class PeakRss(threading.Thread):
    """Samples a pid's VmRSS every 20 ms until stopped."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.baseline = rss_bytes(pid)
        self.peak = self.baseline
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.02):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def __enter__(self) -> "PeakRss":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self.join(5)
        self.peak = max(self.peak, rss_bytes(self.pid))

    @property
    def growth(self) -> int:
        return self.peak - self.baseline

    def __repr__(self) -> str:
        return f"rss {self.baseline / MIB:.0f} -> peak {self.peak / MIB:.0f} MiB"


# ==============================================================================================
# An oversize record
# ==============================================================================================

def test_an_oversize_batch_is_too_large_and_writes_nothing(shared_broker):
    endpoint = make_topic(shared_broker, "oversize")
    ctx = zmq.Context()
    sock = dealer(ctx, endpoint)
    try:
        payload = b"\x91" + bytes(MAX_BATCH_BYTES)  # one byte over, with a valid array header
        reply = call(sock, m.Produce(topic="oversize", partition=0), (payload,))
        assert reply.error is not None and reply.error.code is ErrorCode.TOO_LARGE
        assert reply.error.data["limit"] == MAX_BATCH_BYTES and reply.error.data["got"] == len(payload)
        assert log_end(sock, "oversize") == 0
        with Producer(shared_broker.url, linger_ms=0) as producer:
            producer.send("oversize", bytes(MAX_BATCH_BYTES + 1))
            with pytest.raises(ProduceError) as info:
                producer.flush()
            assert info.value.code is ErrorCode.TOO_LARGE
            assert [h.offset for h in producer.produce("oversize", [b"fits"])] == [0]
        assert log_end(sock, "oversize") == 1
    finally:
        sock.close(linger=0)
        ctx.term()


def test_a_message_over_the_socket_limit_costs_the_sender_its_connection_not_the_actor_memory(shared_broker):
    endpoint = make_topic(shared_broker, "huge")
    pid = shared_broker.pids()["partition-0"]
    ctx = zmq.Context()
    sock = dealer(ctx, endpoint)
    try:
        assert call(sock, m.Hello(versions=[1])).error is None  # connected
        with PeakRss(pid) as rss:
            sock.send_multipart(codec.encode_request(m.Produce(topic="huge", partition=0), 2,
                                                     [b"\x91" + bytes(MAX_MESSAGE_BYTES)]), copy=False)
            assert not sock.poll(1500), "a message over ZMQ_MAXMSGSIZE was answered"
        assert rss.growth < RSS_BOUND, rss
        # libzmq dropped the connection; the DEALER reconnects by itself and is served again.
        assert call(sock, m.Hello(versions=[1]), corr=3).error is None
        assert log_end(sock, "huge") == 0
        assert alive(pid) and shared_broker.pids()["partition-0"] == pid
    finally:
        sock.close(linger=0)
        ctx.term()


# ==============================================================================================
# Too many in-flight leases
# ==============================================================================================

def test_a_member_never_holds_more_than_max_in_flight_leased_records(shared_broker):
    make_topic(shared_broker, "leases")
    with Producer(shared_broker.url) as producer:
        producer.produce("leases", [b"r"] * 500)
    conn = Connection(shared_broker.url)
    try:
        conn.coordinator(m.ConfigureGroup(group="bounded", max_in_flight=50))
        join = conn.coordinator(m.Join(group="bounded", topics=["leases"]))
        member = dict(group="bounded", member_id=join.member_id, generation=join.generation)
        leased: list = []
        deadline = time.monotonic() + 10
        while sum(d[4] - d[3] for d in leased) < 50 and time.monotonic() < deadline:
            leased += conn.coordinator(m.Poll(**member, max_records=1000, max_wait_ms=200)).deliveries
        assert sum(d[4] - d[3] for d in leased) == 50
        for _ in range(3):  # full: an empty answer, not an error, and no more records
            assert conn.coordinator(m.Poll(**member, max_records=1000)).deliveries == []
        acked = conn.coordinator(m.Ack(**member, ranges=[d[:5] for d in leased]))
        assert acked.applied == 50
        more = conn.coordinator(m.Poll(**member, max_records=1000, max_wait_ms=2000)).deliveries
        assert 0 < sum(d[4] - d[3] for d in more) <= 50
    finally:
        conn.close()


def test_extending_a_lease_again_and_again_keeps_the_coordinators_timers_bounded(shared_broker):
    make_topic(shared_broker, "extend")
    with Producer(shared_broker.url) as producer:
        producer.produce("extend", [b"r"] * 10)
    conn = Connection(shared_broker.url)
    ctx = zmq.Context()
    sock = dealer(ctx, shared_broker.url)
    try:
        join = conn.coordinator(m.Join(group="extender", topics=["extend"]))
        member = dict(group="extender", member_id=join.member_id, generation=join.generation)
        deliveries = conn.coordinator(m.Poll(**member, max_wait_ms=2000)).deliveries
        frames = codec.encode_request(m.Extend(**member, ranges=[deliveries[0][:5]], extend_ms=3_600_000), 1)
        n, answered = 20_000, 0
        for _ in range(n):
            sock.send_multipart(frames)
            while sock.poll(0):
                sock.recv_multipart()
                answered += 1
        while answered < n and sock.poll(5000):
            sock.recv_multipart()
            answered += 1
        stats = conn.coordinator(m.Status()).actors[0]["statistics"]
        # Compacted whenever the heap doubles: about twice what is live (other tests' members
        # share this broker) plus slack, far from one entry per extend.
        assert stats["timers"] < 4000, {k: stats[k] for k in ("timers", "lease_records")}
    finally:
        sock.close(linger=0)
        ctx.term()
        conn.close()


def test_parked_polls_of_one_member_are_bounded(shared_broker):
    make_topic(shared_broker, "parked-polls")
    conn = Connection(shared_broker.url)
    ctx = zmq.Context()
    sock = dealer(ctx, shared_broker.url)  # never reads
    try:
        join = conn.coordinator(m.Join(group="parker", topics=["parked-polls"], session_timeout_ms=60_000))
        frames = codec.encode_request(m.Poll(group="parker", member_id=join.member_id, generation=join.generation,
                                             max_wait_ms=60_000), 1)
        for _ in range(20_000):
            sock.send_multipart(frames)
        deadline = time.monotonic() + 30
        while True:  # until the coordinator has read them all
            stats = conn.coordinator(m.Status()).actors[0]["statistics"]
            if stats["polls"] >= 20_000 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert stats["polls"] >= 20_000, stats
        assert stats["parked_polls"] < 1000, stats["parked_polls"]
    finally:
        sock.close(linger=0)
        ctx.term()
        conn.close()


# ==============================================================================================
# Many connections
# ==============================================================================================

@pytest.mark.parametrize("target", ["coordinator", "partition-0"])
def test_500_connections_are_all_answered_and_their_fds_released(shared_broker, target):
    endpoint = shared_broker.url if target == "coordinator" else make_topic(shared_broker, "conns")
    pid = shared_broker.pids()[target]
    fds_before = open_fds(pid)
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 2048)
    socks = [dealer(ctx, endpoint) for _ in range(500)]
    try:
        with PeakRss(pid) as rss:
            for i, sock in enumerate(socks):
                sock.send_multipart(codec.encode_request(m.Hello(versions=[1], client=f"c{i}"), i))
            poller = zmq.Poller()
            for sock in socks:
                poller.register(sock, zmq.POLLIN)
            answered: set[int] = set()
            deadline = time.monotonic() + 20
            while len(answered) < len(socks) and time.monotonic() < deadline:
                for sock, _ in poller.poll(200):
                    env = codec.decode_reply(sock.recv_multipart())
                    assert env.error is None
                    answered.add(env.corr_id)
            fds_during = open_fds(pid)
        assert len(answered) == 500
        assert fds_during >= fds_before + 450
        assert rss.growth < RSS_BOUND, rss
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()
    deadline = time.monotonic() + 10
    while open_fds(pid) > fds_before + 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert open_fds(pid) <= fds_before + 5, (fds_before, open_fds(pid))
    assert shared_broker.pids()[target] == pid


# ==============================================================================================
# A consumer that never reads
# ==============================================================================================

def test_a_consumer_that_never_reads_small_replies_costs_bounded_memory_and_others_are_served(shared_broker):
    endpoint = make_topic(shared_broker, "deaf")
    pid = shared_broker.pids()["partition-0"]
    ctx = zmq.Context()
    deaf = dealer(ctx, endpoint, SNDHWM=0)  # queues everything; never calls recv
    other = dealer(ctx, endpoint)
    try:
        frames = codec.encode_request(m.Fetch(topic="deaf", partition=0, offset=0), 1)  # empty at the log end
        with PeakRss(pid) as rss:
            for i in range(60_000):
                deaf.send_multipart(frames)
                if i % 10_000 == 0:
                    assert call(other, m.Hello(versions=[1]), corr=i, timeout_ms=5000).error is None
            assert call(other, m.Fetch(topic="deaf", partition=0, offset=0), corr=7).error is None
        assert rss.growth < RSS_BOUND, rss
        assert shared_broker.pids()["partition-0"] == pid
    finally:
        deaf.close(linger=0)
        other.close(linger=0)
        ctx.term()


def test_a_consumer_that_never_reads_fetch_replies_costs_bounded_memory(start):
    broker = start(log_level="warning")
    endpoint = make_topic(broker, "deaf-data")
    with Producer(broker.url, batch_size=16) as producer:  # ~16 KiB batches
        producer.produce("deaf-data", [os.urandom(1000) for _ in range(64)])
    pid = broker.pids()["partition-0"]
    ctx = zmq.Context()
    deaf = dealer(ctx, endpoint, SNDHWM=0)
    try:
        frames = codec.encode_request(m.Fetch(topic="deaf-data", partition=0, offset=0, max_bytes=16_384), 1)
        with PeakRss(pid) as rss:
            for _ in range(12_000):
                deaf.send_multipart(frames)
            time.sleep(2)
        assert rss.growth < RSS_BOUND, rss
    finally:
        deaf.close(linger=0)
        ctx.term()


def test_parked_fetches_of_a_consumer_that_never_reads_are_bounded(start):
    broker = start(log_level="warning")
    endpoint = make_topic(broker, "parked")
    pid = broker.pids()["partition-0"]
    ctx = zmq.Context()
    deaf = dealer(ctx, endpoint, SNDHWM=0)
    try:
        frames = codec.encode_request(m.Fetch(topic="parked", partition=0, offset=0, max_wait_ms=60_000), 1)
        other = dealer(ctx, endpoint)
        try:
            with PeakRss(pid) as rss:
                for _ in range(100_000):
                    deaf.send_multipart(frames)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:  # until the actor has read them all
                    counters = call(other, m.Status()).msg.actors[0]["counters"]
                    if counters["fetch_requests"] >= 100_000:
                        break
                    time.sleep(0.1)
        finally:
            other.close(linger=0)
        # Past the cap every new fetch answers the oldest: that must stay cheap, or a
        # flood of parked fetches makes the actor crawl (it once cost the whole set each).
        assert counters["fetch_requests"] >= 100_000, counters
        assert rss.growth < RSS_BOUND // 2, rss
    finally:
        deaf.close(linger=0)
        ctx.term()


# ==============================================================================================
# A producer faster than the disk
# ==============================================================================================

@pytest.fixture(scope="module")
def fsync_broker(tmp_path_factory):
    data = tmp_path_factory.mktemp("fsync")
    handle = start_broker(data / "data", fsync="always", log_level="warning", log_file=data / "broker.log")
    yield handle
    handle.stop()
    shutil.rmtree(data / "data", ignore_errors=True)


def test_a_producer_of_small_records_faster_than_the_disk_is_held_back_by_its_window(fsync_broker):
    make_topic(fsync_broker, "fast-small")
    pid = fsync_broker.pids()["partition-0"]
    value = os.urandom(1024)
    with PeakRss(pid) as rss:
        with Producer(fsync_broker.url, linger_ms=1, request_timeout=30) as producer:
            for _ in range(100_000):
                producer.send("fast-small", value)
                assert producer.in_flight_records <= producer.max_in_flight_records
            producer.flush()
    assert rss.growth < RSS_BOUND, rss


def test_a_producer_of_large_records_keeps_a_bounded_number_of_bytes_in_flight(fsync_broker):
    make_topic(fsync_broker, "fast-large")
    value = os.urandom(256 << 10)
    peak = 0
    with Producer(fsync_broker.url, linger_ms=0, request_timeout=30) as producer:
        for _ in range(1000):
            producer.send("fast-large", value)
            peak = max(peak, sum(len(batch.payload) for batch, _t in producer.in_flight.values()))
        producer.flush()
    assert peak <= RSS_BOUND, f"{peak / MIB:.0f} MiB in flight"


def test_the_partition_actor_holds_a_bounded_number_of_bytes_from_a_pipelining_producer(start, tmp_path):
    broker = start(fsync="always", log_level="warning")
    endpoint = make_topic(broker, "firehose")
    pid = broker.pids()["partition-0"]
    payload = encode_records([[1, None, os.urandom(256 << 10), None]])
    ctx = zmq.Context()
    sock = dealer(ctx, endpoint, SNDHWM=0, RCVHWM=0)
    try:
        with PeakRss(pid) as rss:
            for i in range(2000):
                sock.send_multipart(codec.encode_request(m.Produce(topic="firehose", partition=0), i, [payload]),
                                    copy=False)
            answered = 0
            while answered < 2000 and sock.poll(30_000):
                env = codec.decode_reply(sock.recv_multipart())
                assert env.error is None, env.error
                answered += 1
        assert answered == 2000
    finally:
        sock.close(linger=0)
        ctx.term()
        broker.stop()
        shutil.rmtree(tmp_path / "data", ignore_errors=True)
    assert rss.growth < RSS_BOUND, rss
