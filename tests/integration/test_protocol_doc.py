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
