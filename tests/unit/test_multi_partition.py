"""produce_many and fetch_many: many partitions of one actor in one request (issue #29).

The protocol's shapes and refusals, then the partition actor core answering them on
real logs: per-part results and errors in one reply, idempotence per part, the group
commit of fsync=always, and replicated parts waiting on their high watermark."""

import pytest

from zbroker.actors.partition_log.core import FsyncPolicy, PartitionActorCore, Reply, ReplyError
from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.batch import decode_fetched
from zbroker.protocol.errors import ErrorCode, ProtocolError
from tests.replication.test_partition_core_replication import pair, pump  # noqa: F401 (a fixture)
from tests.unit.test_partition_actor_core import Opener, env, payload


def produce_many(core, parts, now=1, token="tok"):
    """parts: [(topic, partition, payload, producer_id, sequence)]"""
    header = [[t, p, pid, seq, len(data)] for t, p, data, pid, seq in parts]
    frame = b"".join(data for *_x, data, _pid, _seq in parts)
    return core.handle(token, env(m.ProduceMany(parts=header), [frame]), now)


def part(partition, *values, topic="t", pid=0, seq=-1):
    return (topic, partition, payload(*values), pid, seq)


@pytest.fixture(params=["interval:1000", "always"])
def core(tmp_path, request):
    c = PartitionActorCore("p0", open_log=Opener(tmp_path), fsync=FsyncPolicy.parse(request.param))
    c.on_assign([["t", p, None] for p in range(4)], 0)
    yield c
    c.close()


# -- protocol ------------------------------------------------------------------------------

def test_both_requests_and_replies_round_trip_through_the_codec():
    request = m.ProduceMany(parts=[["t", 0, 0, -1, 3], ["u", 7, 5, 0, 2]])
    decoded = codec.decode_request(codec.encode_request(request, 9, [b"abcde"]))
    assert decoded.msg == request and bytes(decoded.frames[0]) == b"abcde"
    assert [bytes(v) for v in m.split_payloads(request.parts, decoded.frames[0])] == [b"abc", b"de"]
    reply = m.ProduceManyReply(results=[[0, 3, False, None], [0, 0, False, {"code": "NOT_OWNER", "message": "",
                                                                          "retriable": True, "data": {}}]])
    assert codec.decode_reply(codec.encode_reply(reply, 9)).msg == reply
    fetch = m.FetchMany(parts=[["t", 0, 5, 4096], ["t", 1, 0, 1]], max_bytes=100)
    assert codec.decode_request(codec.encode_request(fetch, 3)).msg == fetch
    fetched = m.FetchManyReply(parts=[[0, 9, 2, None], [0, 0, 0, {"code": "NOT_OWNER"}], [1, 4, 3, None]])
    wire = codec.decode_reply(codec.encode_reply(fetched, 3, [b"xxyyy"]))
    assert [None if v is None else bytes(v) for v in m.split_fetched(wire.msg, wire.frames[0])] == [
        b"xx", None, b"yyy"]


@pytest.mark.parametrize("parts, field", [
    ([], "parts"),
    ([["t", 0, 0, -1]], "parts"),  # a short part
    ([["t", "0", 0, -1, 1]], "parts"),
    ([["t", True, 0, -1, 1]], "parts"),  # a bool is no partition
    ([["t", 1 << 31, 0, -1, 1]], "parts.partition"),
    ([["t" * 201, 0, 0, -1, 1]], "parts.topic"),
    ([["t", 0, 1 << 63, 0, 1]], "parts.producer_id"),
    ([["t", 0, 5, -1, 1]], "parts.sequence"),  # an idempotent producer needs a sequence
    ([["t", 0, 0, -2, 1]], "parts.sequence"),
    ([["t", 0, 0, -1, 0]], "parts.length"),
    ([["t", 0, 0, -1, 1]] * (m.MAX_PARTS_PER_REQUEST + 1), "parts"),
])
def test_produce_many_refuses_malformed_parts_with_the_field(parts, field):
    with pytest.raises(ProtocolError) as caught:
        codec.decode_request([codec.pack_value({"v": 1, "op": "produce_many", "id": 4, "parts": parts}), b"x"])
    assert caught.value.data["field"] == field and caught.value.corr_id == 4


def test_fetch_many_refuses_negative_offsets_and_lengths_that_do_not_add_up():
    with pytest.raises(ProtocolError) as caught:
        codec.decode_request([codec.pack_value({"v": 1, "op": "fetch_many", "id": 1, "parts": [["t", 0, -1, 5]]})])
    assert caught.value.data["field"] == "parts"
    with pytest.raises(ProtocolError) as caught:
        m.split_payloads([["t", 0, 0, -1, 3]], b"ab")
    assert caught.value.data == {"op": "produce_many", "field": "parts.length", "expected": 3, "got": 2}
    with pytest.raises(ProtocolError):
        m.split_fetched(m.FetchManyReply(parts=[[0, 1, 4, None]]), b"abc")


# -- the core ------------------------------------------------------------------------------

def settled(core, effects, now=1):
    """The produce_many reply, after end_turn's fsync where the policy holds it."""
    effects = effects + core.end_turn(now)
    [reply] = [e for e in effects if e.token == "tok"]
    return reply


def test_one_reply_carries_every_part_in_request_order(core):
    effects = produce_many(core, [part(2, b"a", b"b"), part(0, b"c"), part(2, b"d")])
    reply = settled(core, effects)
    assert isinstance(reply, Reply) and reply.msg.op == "produce_many"
    assert reply.msg.results == [[0, 2, False, None], [0, 1, False, None], [2, 1, False, None]]
    assert core.logs[("t", 2)].log_end == 3 and core.logs[("t", 0)].log_end == 1
    assert core.counters["produce_many_requests"] == 1 and core.counters["records_appended"] == 4


def test_a_part_refused_is_an_error_inside_the_reply_and_the_others_land(core):
    effects = produce_many(core, [part(9, b"x"), part(1, b"y"), ("t", 3, b"\x01\x02", 0, -1)])
    reply = settled(core, effects)
    [missing, ok, corrupt] = reply.msg.results
    assert missing[:3] == [0, 0, False] and missing[3]["code"] == "NOT_OWNER" and missing[3]["retriable"]
    assert missing[3]["data"]["partition"] == 9
    assert ok == [0, 1, False, None]
    assert corrupt[3]["code"] == "CORRUPT_BATCH" and core.logs[("t", 3)].log_end == 0


def test_a_retried_part_is_stored_once(core):
    first = settled(core, produce_many(core, [part(0, b"a", pid=7, seq=0), part(1, b"b", pid=7, seq=0)]))
    again = settled(core, produce_many(core, [part(0, b"a", pid=7, seq=0), part(1, b"b", pid=7, seq=1)]))
    assert first.msg.results == [[0, 1, False, None], [0, 1, False, None]]
    assert again.msg.results == [[0, 1, True, None], [1, 1, False, None]]
    assert core.logs[("t", 0)].log_end == 1


def test_lengths_that_do_not_cover_the_frame_refuse_the_whole_request(core):
    header = [["t", 0, 0, -1, 3]]
    [err] = core.handle("tok", env(m.ProduceMany(parts=header), [payload(b"abc")]), 1)
    assert isinstance(err, ReplyError) and err.error.code is ErrorCode.BAD_REQUEST
    assert core.logs[("t", 0)].log_end == 0


def test_fetch_many_reads_each_part_and_reports_errors_per_part(core):
    settled(core, produce_many(core, [part(0, b"a", b"b", b"c"), part(1, b"d")]))
    request = m.FetchMany(parts=[["t", 0, 1, 1 << 20], ["t", 9, 0, 100], ["t", 1, 0, 100], ["t", 2, 0, 100],
                                 ["t", 1, 5, 100]])
    [reply] = core.handle("f", env(request), 2) + core.end_turn(2)
    rows = reply.msg.parts
    frames = m.split_fetched(reply.msg, reply.frames[0])
    assert [r.value for r in decode_fetched(frames[0], "t", 0, from_offset=1)] == [b"b", b"c"]
    assert rows[0][:2] == [0, 3] and rows[1][3]["code"] == "NOT_OWNER"
    assert [r.value for r in decode_fetched(frames[2], "t", 1)] == [b"d"]
    assert rows[3] == [0, 0, 0, None] and frames[3] == b""  # at the log end: nothing, no wait
    assert rows[4][3]["code"] == "OFFSET_OUT_OF_RANGE"


def test_fetch_many_stops_reading_once_its_byte_budget_is_used(core):
    settled(core, produce_many(core, [part(p, b"x" * 300) for p in range(3)]))
    [reply] = core.handle("f", env(m.FetchMany(parts=[["t", p, 0, 1 << 20] for p in range(3)], max_bytes=400)), 2)
    lengths = [r[2] for r in reply.msg.parts]
    assert lengths[0] > 300 and lengths[1:] == [0, 0]  # the first batch whole, the rest next time


def test_a_produce_many_wakes_a_fetch_waiting_on_one_of_its_partitions(core):
    assert core.handle("w", env(m.Fetch(topic="t", partition=3, offset=0, max_wait_ms=500)), 1) == []
    effects = produce_many(core, [part(0, b"a"), part(3, b"b")]) + core.end_turn(1)
    [woken] = [e for e in effects if e.token == "w"]
    assert [r.value for r in decode_fetched(woken.frames[0], "t", 3)] == [b"b"]


def test_fsync_always_holds_the_reply_until_end_turn(tmp_path):
    c = PartitionActorCore("p0", open_log=Opener(tmp_path), fsync=FsyncPolicy.parse("always"))
    c.on_assign([["t", 0, None], ["t", 1, None]], 0)
    try:
        assert produce_many(c, [part(0, b"a"), part(1, b"b")]) == []
        [reply] = c.end_turn(1)
        assert reply.msg.results == [[0, 1, False, None], [0, 1, False, None]] and c.counters["fsyncs"] == 2
    finally:
        c.close()


# -- replicated parts (actors/partition_log/replica.py) ------------------------------------

def test_a_replicated_part_waits_for_its_high_watermark_and_a_follower_says_not_leader(pair):
    a, b = pair
    # "t" 0 is replicated (acks=all), "plain" 0 is not: the reply waits for the slower part.
    held = produce_many(a, [part(0, b"r"), part(0, b"p", topic="plain")]) + a.end_turn(1)
    assert [e for e in held if e.token == "tok"] == []
    released = pump(b, a)
    [reply] = [e for e in released if getattr(e, "token", None) == "tok"]
    assert reply.msg.results == [[0, 1, False, None], [0, 1, False, None]]
    [fetched] = a.handle("f", env(m.FetchMany(parts=[["t", 0, 0, 1 << 20]])), 3) + a.end_turn(3)
    assert fetched.msg.parts[0][1] == 1  # the high watermark, as `fetch` reports it
    [refused] = produce_many(b, [part(0, b"x")]) + b.end_turn(1)
    assert refused.msg.results[0][3]["code"] == "NOT_LEADER"
    assert refused.msg.results[0][3]["data"]["leader"]["actor_id"] == "a"
    [fetch_refused] = b.handle("f", env(m.FetchMany(parts=[["t", 0, 0, 100]])), 1)
    assert fetch_refused.msg.parts[0][3]["code"] == "NOT_LEADER"


def test_the_acl_checks_every_topic_a_many_partition_request_names():
    from zbroker.actors.security import Acl, Permissions
    from zbroker.protocol.errors import Unauthorized

    acl = Acl("BROKER", {"K1": Permissions.from_dict({"produce": ["a"], "consume": ["a"]})}, {"K1": "one"})
    acl.check("K1", "produce_many", m.ProduceMany(parts=[["a", 0, 0, -1, 1], ["a", 1, 0, -1, 1]]))
    acl.check("K1", "fetch_many", m.FetchMany(parts=[["a", 0, 0, 10]]))
    for op, msg in [("produce_many", m.ProduceMany(parts=[["a", 0, 0, -1, 1], ["b", 0, 0, -1, 1]])),
                    ("fetch_many", m.FetchMany(parts=[["a", 0, 0, 10], ["b", 3, 0, 10]]))]:
        with pytest.raises(Unauthorized) as info:
            acl.check("K1", op, msg)
        assert info.value.data["topic"] == "b"
