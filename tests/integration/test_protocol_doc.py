"""Numbers docs/PROTOCOL.md gives a client author, checked against a real broker.

A client written from the document alone sends what the document allows: where the
document and the broker disagree, such a client fails in production.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgpack
import pytest
import zmq

from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.client import Admin

pytestmark = pytest.mark.processes

PROTOCOL_MD = Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md"


def _doc_number(pattern: str) -> int:
    match = re.search(pattern, PROTOCOL_MD.read_text())
    assert match, f"PROTOCOL.md no longer says {pattern!r}"
    return int(match.group(1).replace(" ", "").replace(",", ""))


def _request(sock: zmq.Socket, msg: m.Message, corr_id: int) -> dict:
    sock.send_multipart(codec.encode_request(msg, corr_id))
    assert sock.poll(10_000), f"no reply to {msg.op}"
    return msgpack.unpackb(sock.recv_multipart()[0], raw=False)


@pytest.mark.parametrize("where, pattern", [
    ("ack", r"ranges, req, at most ([\d ,]+)[,)]"),
    ("poll", r"exactly as `ack\.ranges` \(at most ([\d ,]+)[,)]"),
], ids=["ack", "poll"])
def test_a_range_list_as_long_as_the_document_allows_is_accepted(broker, where, pattern):
    """s.8.4 gives the longest `ack.ranges` and `poll.acks`: the broker must take that many
    (here all stale: a STALE_LEASE or a reply, never a BAD_REQUEST or an unreadable header)."""
    limit = _doc_number(pattern)
    with Admin(broker.url) as admin:
        admin.create_topic("doc-ranges", partitions=1)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(broker.url)
    try:
        joined = _request(sock, m.Join(group="doc-g", topics=["doc-ranges"]), 1)
        assert joined["ok"], joined
        member, generation = joined["member_id"], joined["generation"]
        # Lease ids no lease has: every range is stale, none is applied.
        ranges = [["doc-ranges", 0, 1 + i, i, i + 1] for i in range(limit)]
        if where == "ack":
            msg = m.Ack(group="doc-g", member_id=member, generation=generation, ranges=ranges)
        else:
            msg = m.Poll(group="doc-g", member_id=member, generation=generation, acks=ranges)
        reply = _request(sock, msg, 2)
        assert reply["id"] == 2, f"{where} with {limit} ranges, as PROTOCOL.md allows, was refused: {reply}"
        if where == "ack":
            assert reply["error"]["code"] == "STALE_LEASE", reply["error"]
            data = reply["error"]["data"]
        else:
            assert reply["ok"], reply
            data = reply
        assert len(data["stale"]) + data.get("stale_omitted", 0) == limit
        # One more is refused, naming the limit the document gives.
        ranges.append(["doc-ranges", 0, 1 + limit, limit, limit + 1])
        too_many = _request(sock, m.Ack(group="doc-g", member_id=member, generation=generation, ranges=ranges), 3)
        assert too_many["error"]["code"] == "BAD_REQUEST" and too_many["error"]["data"]["limit"] == limit
    finally:
        sock.close(linger=0)
        ctx.term()


def test_a_nacked_record_never_comes_back_before_delay_ms_after_the_client_sent_the_nack(broker):
    """s.14 Timers: `nack.delay_ms` counts from when the client sent the nack, by its own
    clock. Measured here with the client's monotonic clock, over many short delays (an
    older coordinator redelivered up to a millisecond early: it started the delay from
    its clock's last whole millisecond, and from the start of its loop turn)."""
    import time

    from zbroker.client import Producer

    delay_ms, rounds = 3, 40
    with Admin(broker.url) as admin:
        admin.create_topic("doc-nack", partitions=1)
    with Producer(broker.url) as producer:
        producer.send("doc-nack", b"x", partition=0)
        producer.flush()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(broker.url)
    ids = iter(range(1, 1 << 20))
    try:
        # One record, nacked again and again: each poll after a nack can only be its redelivery.
        assert _request(sock, m.ConfigureGroup(group="doc-nack-g", max_deliveries=1000), next(ids))["ok"]
        joined = _request(sock, m.Join(group="doc-nack-g", topics=["doc-nack"]), next(ids))
        member, generation = joined["member_id"], joined["generation"]
        poll = m.Poll(group="doc-nack-g", member_id=member, generation=generation, max_wait_ms=5_000)
        polled = _request(sock, poll, next(ids))
        assert polled["ok"] and polled["deliveries"][0][6] == "new", polled
        lease_range = polled["deliveries"][0][:5]
        early = []
        for _ in range(rounds):
            nack = m.Nack(group="doc-nack-g", member_id=member, generation=generation, ranges=[lease_range],
                          delay_ms=delay_ms)
            sent = time.monotonic()
            assert _request(sock, nack, next(ids))["ok"]
            back = _request(sock, poll, next(ids))  # waits (max_wait_ms) for the redelivery
            arrived = time.monotonic()
            assert back["ok"] and back["deliveries"][0][6] == "nack", back
            if (arrived - sent) * 1000 < delay_ms:
                early.append(round((arrived - sent) * 1000, 3))
            lease_range = back["deliveries"][0][:5]
        assert early == [], f"redeliveries before delay_ms after the nack was sent: {early} ms"
    finally:
        sock.close(linger=0)
        ctx.term()
