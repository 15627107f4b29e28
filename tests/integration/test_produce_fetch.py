"""The foundation on real processes and sockets: produce, fetch, crash recovery, bad input."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Iterator

import msgpack
import pytest
import zmq

from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.batch import decode_fetched, encode_records
from zbroker.protocol.errors import ErrorCode, UnknownTopic
from zbroker.client import Admin, Connection, Producer, fetch
from zbroker.client.sync import ProduceError
from zbroker.supervisor import wait_ready
from tests.support.waiting import wait_for

pytestmark = pytest.mark.processes


def wait_until_owned(sock: zmq.Socket, topic: str, partition: int = 0, timeout: float = 10.0) -> None:
    """A new partition answers NOT_OWNER (retriable) until its actor has opened it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.send_multipart(codec.encode_request(m.Fetch(topic=topic, partition=partition, offset=0), 0))
        assert sock.poll(5000)
        env = codec.decode_reply(sock.recv_multipart())
        if env.error is None:
            return
        assert env.error.code is ErrorCode.NOT_OWNER
        time.sleep(0.02)
    raise AssertionError(f"{topic}/{partition} never opened")


def fetch_all(conn: Connection, topic: str, partition: int, end: int) -> list:
    out, offset = [], 0
    while offset < end:
        records, _start, _end = fetch(conn, topic, partition, offset, max_bytes=1 << 20)
        assert records, f"no records at {topic}/{partition}@{offset} though log end is {end}"
        out.extend(records)
        offset = records[-1].offset + 1
    return out


def test_100k_records_over_4_partitions_come_back_complete_and_in_order(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("orders", partitions=4)
    sent: dict[int, list[bytes]] = {p: [] for p in range(4)}
    with Producer(broker.url, linger_ms=2, batch_size=500) as producer:
        for i in range(100_000):
            key = f"customer-{i % 977}".encode()
            value = f"order-{i}".encode()
            handle = producer.send("orders", value, key=key)
            sent[handle.partition].append(value)
        producer.flush()
    conn = Connection(broker.url)
    try:
        conn.refresh()
        for p in range(4):
            records = fetch_all(conn, "orders", p, len(sent[p]))
            assert [r.offset for r in records] == list(range(len(sent[p])))
            assert [r.value for r in records] == sent[p]
        assert sum(len(v) for v in sent.values()) == 100_000
    finally:
        conn.close()
    with Admin(broker.url) as admin:
        described = admin.describe_topic("orders")
    assert sum(p["log_end"] for p in described["partitions"]) == 100_000


def test_assigned_offsets_are_returned_to_the_producer(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("t", partitions=1)
    with Producer(broker.url) as producer:
        handles = producer.produce("t", [b"a", b"b", (b"k", b"c", {"h": b"1"})])
    assert [h.offset for h in handles] == [0, 1, 2]


def test_key_less_key_ed_and_stamped_records_keep_their_order_and_fields(broker):
    """Key-less records take the producer's fast path, the rest the general one:
    one partition's records come back in the order sent, each with its own fields."""
    with Admin(broker.url) as admin:
        admin.create_topic("mixed", partitions=1)
    sent = []
    with Producer(broker.url, linger_ms=50, batch_size=7) as producer:
        for i in range(40):
            value = b"v%d" % i
            if i % 5 == 1:
                record = (b"key-%d" % i, value, None, None)
            elif i % 5 == 2:
                record = (None, value, {"trace": b"%d" % i}, None)
            elif i % 5 == 3:
                record = (None, value, None, 1_000_000 + i)
            else:
                record = (None, value, None, None)
            before = time.time_ns() // 1_000_000
            handle = producer.send("mixed", value, key=record[0], headers=record[2], timestamp_ms=record[3])
            after = time.time_ns() // 1_000_000
            sent.append((record, handle, before, after))
            if i % 9 == 0:
                time.sleep(0.003)  # let the clock move on between records of one batch
        with pytest.raises(TypeError, match="value must be bytes"):
            producer.send("mixed", "not bytes")
        producer.flush()
    conn = Connection(broker.url)
    try:
        conn.refresh()
        fetched = fetch_all(conn, "mixed", 0, len(sent))
    finally:
        conn.close()
    assert [h.offset for _r, h, _b, _a in sent] == list(range(40))
    for got, ((key, value, headers, stamp), handle, before, after) in zip(fetched, sent):
        assert (got.offset, got.key, got.value, got.headers) == (handle.offset, key, value, headers)
        if stamp is not None:
            assert got.timestamp_ms == stamp
        else:
            assert before <= got.timestamp_ms <= after


def test_a_wrong_type_fails_its_own_send_and_loses_no_other_record(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("typed", partitions=1)
    with Producer(broker.url, linger_ms=50) as producer:
        good = [producer.send("typed", b"before")]
        for bad in ("text", None, 12):
            with pytest.raises(TypeError):
                producer.send("typed", bad)
        with pytest.raises(TypeError):
            producer.send("typed", b"v", key="text-key")
        with pytest.raises(TypeError, match="timestamp_ms must be an int"):
            producer.send("typed", b"v", timestamp_ms=1.7e12)
        with pytest.raises(ValueError, match="fit in 64 bits"):
            producer.send("typed", b"v", timestamp_ms=1 << 64)
        good.append(producer.send("typed", b"after", headers={"h": bytearray(b"1")}))
        producer.flush()
    assert [h.offset for h in good] == [0, 1] and all(h.error is None for h in good)
    conn = Connection(broker.url)
    try:
        conn.refresh()
        assert [(r.value, r.headers) for r in fetch_all(conn, "typed", 0, 2)] == [(b"before", None),
                                                                                 (b"after", {"h": b"1"})]
    finally:
        conn.close()


def test_a_record_too_large_for_the_broker_fails_alone(broker):
    """A record that fits the actor's max_batch_bytes (8 MiB) only on its own, sent
    after smaller ones, goes in a batch of its own: its neighbours are stored."""
    with Admin(broker.url) as admin:
        admin.create_topic("big", partitions=1)
    with Producer(broker.url, linger_ms=50) as producer:
        before = producer.send("big", b"s" * 500_000)
        large = producer.send("big", b"L" * 7_900_000)  # fits alone; with `before` it would not
        after = producer.send("big", b"after")
        too_large = producer.send("big", b"T" * (9 << 20))  # over the limit whatever shares its batch
        last = producer.send("big", b"last")
        with pytest.raises(ProduceError):
            producer.flush()
    assert [before.offset, large.offset, after.offset, last.offset] == [0, 1, 2, 3]
    assert too_large.offset is None and too_large.error.code is ErrorCode.TOO_LARGE


def test_poll_sends_a_lingering_batch_without_another_send(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("linger", partitions=1)
    # A linger long enough that a stalled CI machine still polls before it runs out.
    with Producer(broker.url, linger_ms=1000) as producer:
        assert producer.linger_deadline() is None
        before = time.monotonic()
        handle = producer.send("linger", b"alone")
        deadline = producer.linger_deadline()
        assert deadline is not None and before + 1.0 <= deadline <= time.monotonic() + 1.0
        producer.poll()  # too early: the record stays buffered
        assert producer.in_flight_records == 0 and producer.linger_deadline() == deadline
        time.sleep(max(0.0, deadline - time.monotonic()))  # to the deadline itself: due then
        producer.poll()
        # Sent: in flight, or already acknowledged if the reply beat poll()'s own look
        # for replies (a descheduled test process gives it time to).
        assert producer.linger_deadline() is None
        assert producer.in_flight_records == 1 or (handle.offset == 0 and producer.in_flight_records == 0)
        give_up = time.monotonic() + 10
        while handle.offset is None and time.monotonic() < give_up:
            producer.poll(timeout=0.05)
        assert handle.offset == 0 and producer.in_flight_records == 0


def test_unknown_topic_is_a_clear_error(broker):
    with Producer(broker.url) as producer:
        with pytest.raises(UnknownTopic) as info:
            producer.send("nope", b"x")
    assert info.value.data["topic"] == "nope"


def test_sigkill_of_a_partition_actor_loses_no_acknowledged_record_and_reuses_no_offset(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("crash", partitions=1)
    acked: list[tuple[int, bytes]] = []
    killed = False
    with Producer(broker.url, linger_ms=1, batch_size=100, request_timeout=2.0) as producer:
        pending = []
        for i in range(30_000):
            value = f"v{i}".encode()
            pending.append((producer.send("crash", value), value))
            if i == 12_000 and not killed:
                broker.kill("partition-0", signal.SIGKILL)
                killed = True
        producer.flush()
        acked = [(h.offset, v) for h, v in pending if h.offset is not None]
    assert killed
    assert len(acked) == 30_000  # the producer retried through the restart
    conn = Connection(broker.url)
    try:
        wait_ready(broker.url)
        conn.refresh()
        records = fetch_all(conn, "crash", 0, max(o for o, _ in acked) + 1)
        by_offset = {r.offset: r.value for r in records}
        for offset, value in acked:
            assert by_offset[offset] == value, f"acknowledged record at {offset} lost or changed"
        assert len({o for o, _ in acked}) == len(acked)  # no offset handed out twice
        assert sorted(by_offset) == list(range(len(by_offset)))
    finally:
        conn.close()


def test_a_torn_tail_is_recovered_on_restart(start, tmp_path):
    data = tmp_path / "data"
    broker = start(data)
    with Admin(broker.url) as admin:
        admin.create_topic("torn", partitions=1)
    with Producer(broker.url, batch_size=50) as producer:
        handles = producer.produce("torn", [f"r{i}".encode() for i in range(500)])
    assert handles[-1].offset == 499
    broker.stop()
    segment = sorted((data / "partitions" / "logs" / "torn" / "0").glob("*.log"))[-1]
    size = segment.stat().st_size
    with open(segment, "r+b") as f:
        f.truncate(size - 7)  # tear the last batch
    broker = start(data, port=broker.config.port)
    conn = Connection(broker.url)
    try:
        conn.refresh()
        records, start_offset, end = fetch(conn, "torn", 0, 0, max_bytes=1 << 22)
        assert end == 450  # the last batch of 50 was torn and dropped, all before it kept
        assert [r.value for r in records] == [f"r{i}".encode() for i in range(450)]
        with Producer(broker.url) as producer:
            [h] = producer.produce("torn", [b"after"])
        assert h.offset == 450
    finally:
        conn.close()
    assert "log.truncated" in (tmp_path / "broker.log").read_text()


@contextlib.contextmanager
def actor_socket(broker, topic: str) -> Iterator[zmq.Socket]:
    """A bare DEALER to the partition actor of a new one-partition `topic`, once it serves it."""
    with Admin(broker.url) as admin:
        admin.create_topic(topic, partitions=1)
        endpoint = admin.metadata([topic])[0]["partitions"][0]["endpoint"]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        wait_until_owned(sock, topic)
        yield sock
    finally:
        sock.close(linger=0)
        ctx.term()


def test_a_retried_produce_is_not_duplicated(broker):
    with actor_socket(broker, "idem") as sock:
        payload = encode_records([[1, None, b"once", None], [1, None, b"twice?", None]])
        request = m.Produce(topic="idem", partition=0, producer_id=4242, sequence=0)
        replies = []
        for corr in (1, 2, 3):  # the same batch, sent as a client would retry it
            sock.send_multipart(codec.encode_request(request, corr, [payload]))
            assert sock.poll(5000)
            replies.append(codec.decode_reply(sock.recv_multipart()).msg)
        assert [r.base_offset for r in replies] == [0, 0, 0]
        assert [r.duplicate for r in replies] == [False, True, True]
    with Admin(broker.url) as admin:
        assert admin.describe_topic("idem")["partitions"][0]["log_end"] == 2


@pytest.mark.parametrize("target", ["coordinator", "partition"])
def test_malformed_frames_get_error_replies_while_the_actor_keeps_serving(broker, target):
    with Admin(broker.url) as admin:
        admin.create_topic("bad", partitions=1)
        endpoint = broker.url if target == "coordinator" else admin.metadata(["bad"])[0]["partitions"][0]["endpoint"]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    if target == "partition":
        wait_until_owned(sock, "bad")
    garbage = [
        [b"\xc1"],
        [b"not msgpack at all"],
        [msgpack.packb([1, 2, 3])],
        [msgpack.packb({"v": 1, "op": "fetch", "id": 7, "topic": 5, "partition": "x", "offset": -1})],
        [msgpack.packb({"v": 1, "op": "no_such_op", "id": 8})],
        [msgpack.packb({"v": 99, "op": "status", "id": 9})],
        [msgpack.packb({"v": 1, "op": "produce", "id": 10, "topic": "bad", "partition": 0}), b"\x01\x02\x03"],
        [b"\x81\xa1v\xc6\xff\xff\xff\xff"],
    ]
    try:
        codes = []
        for frames in garbage:
            sock.send_multipart(frames)
            assert sock.poll(5000), f"no reply to {frames!r}"
            env = codec.decode_reply(sock.recv_multipart())
            assert env.error is not None
            codes.append(env.error.code)
        assert ErrorCode.UNKNOWN_OP in codes and ErrorCode.UNSUPPORTED_VERSION in codes
        assert ErrorCode.BAD_REQUEST in codes
        if target == "partition":
            assert ErrorCode.CORRUPT_BATCH in codes
        # ...and a valid client is still served.
        with Producer(broker.url) as producer:
            [h] = producer.produce("bad", [b"fine"])
        assert h.offset == 0
    finally:
        sock.close(linger=0)
        ctx.term()


def test_a_followed_fetch_gets_a_reply_per_append_with_consecutive_ids(broker):
    # What a client in any language sees on the wire (PROTOCOL.md, `fetch`, `follow`).
    with actor_socket(broker, "follow") as sock:
        sock.send_multipart(codec.encode_request(
            m.Fetch(topic="follow", partition=0, offset=0, max_wait_ms=10_000, follow=2), 500))
        replies = []
        with Producer(broker.url, linger_ms=0) as producer:
            for value in (b"one", b"two", b"three", b"four"):
                producer.produce("follow", [value])  # acknowledged: stored before the next
                if sock.poll(1000 if len(replies) < 3 else 300):
                    replies.append(codec.decode_reply(sock.recv_multipart()))
        assert [(r.corr_id, r.msg.more) for r in replies] == [(500, True), (501, True), (502, False)]
        assert [[rec.value for rec in decode_fetched(r.frames[0], "follow", 0)] for r in replies] == [
            [b"one"], [b"two"], [b"three"]]  # "four" came after the fetch ended: nothing more



def test_a_followed_fetch_sent_through_connection_reserves_the_ids_of_its_later_replies(broker):
    # Connection.send is public: a Fetch with `follow` must move the id counter past id + follow
    # by itself, or the next request on the connection gets the fetch's next push as its reply.
    with Admin(broker.url) as admin:
        admin.create_topic("reserved", partitions=1)
    with Producer(broker.url, linger_ms=0) as producer:
        producer.produce("reserved", [b"a"])
    conn = Connection(broker.url)
    try:
        endpoint = conn.endpoint("reserved", 0)
        first = conn.call(endpoint, m.Fetch(topic="reserved", partition=0, offset=0, max_wait_ms=5000, follow=3))
        assert first.msg.more
        with Producer(broker.url, linger_ms=0) as producer:
            producer.produce("reserved", [b"b"])  # pushed to the fetch under first.corr_id + 1
        time.sleep(0.2)
        reply = conn.call(conn.url, m.Metadata(topics=["reserved"]))
        assert reply.op == "metadata"
        assert reply.corr_id > first.corr_id + 3
    finally:
        conn.close()


def test_async_connection_reserves_the_ids_of_a_followed_fetchs_later_replies(broker):
    # As the test above, through the asyncio client: its replies of all sockets share one map.
    from zbroker.client.aio import AsyncConnection

    with Admin(broker.url) as admin:
        admin.create_topic("reserved", partitions=1)
        admin.create_topic("other", partitions=1)
    with Producer(broker.url, linger_ms=0) as producer:
        producer.produce("reserved", [b"a"])

    async def main():
        conn = AsyncConnection(broker.url)
        try:
            endpoint = await conn.endpoint("reserved", 0)
            other = await conn.endpoint("other", 0)
            first = await conn.call(endpoint, m.Fetch(topic="reserved", partition=0, offset=0, max_wait_ms=5000,
                                                      follow=3))
            assert first.msg.more
            # The next request: a fetch of another, empty topic that waits for records.
            waiting = await conn.send(other,
                                      m.Fetch(topic="other", partition=0, offset=0, max_wait_ms=2000))
            with Producer(broker.url, linger_ms=0) as producer:
                producer.produce("reserved", [b"b"])  # pushed to the followed fetch under first.corr_id + 1
            reply = await conn.wait(waiting, 5)
            assert reply.msg.log_end == 0, f"the fetch of 'other' got the push of 'reserved': {reply}"
            assert waiting.corr_id > first.corr_id + 3, (waiting.corr_id, first.corr_id)
        finally:
            await conn.close()

    asyncio.run(main())

def test_sigterm_stops_everything_cleanly_and_loses_nothing(start, tmp_path):
    data = tmp_path / "data"
    broker = start(data, fsync="always")
    with Admin(broker.url) as admin:
        admin.create_topic("calm", partitions=2)
    with Producer(broker.url) as producer:
        handles = producer.produce("calm", [f"c{i}".encode() for i in range(1000)])
    pids = broker.actor_pids()
    assert broker.stop() == 0
    for pid in pids:
        assert not _alive(pid)
    broker = start(data, port=broker.config.port)
    with Admin(broker.url) as admin:
        # Each actor reports its log ends when it registers: a describe straight after a
        # restart can come first (0 + 0 under a load of 13). A lost record never comes.
        def log_ends() -> list[int]:
            return [p["log_end"] for p in admin.describe_topic("calm")["partitions"]]
        wait_for(lambda: sum(log_ends()) >= 1000, 30, "the restarted actors to report 1,000 records")
        ends = log_ends()
    assert sum(ends) == len(handles) == 1000


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
