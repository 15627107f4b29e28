"""The Python client's use of produce_many and fetch_many, in its pure cores (issue #29):
which batches share a request, how one reply settles each, and the fallback to the
single-partition ops for an actor that predates them."""

from zbroker.client.consumer_core import fetch_many_request, plan_fetches
from zbroker.client.core import PendingBatch
from zbroker.client.producer_core import MAX_MANY_BYTES, ProducerCore, SentTogether, produce_many_request
from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.errors import ErrorCode, NotLeader, NotOwner, UnknownOp


def batch(partition, payload=b"p", topic="t", sequence=-1):
    return PendingBatch(topic, partition, payload, 1, 0, sequence, None)


def window(core, *batches):
    for b in batches:
        core.admit(b)
        b.attempts += 1
    return list(batches)


def test_batches_are_grouped_per_actor_in_the_order_first_seen():
    core = ProducerCore()
    a0, b1, a2, a3 = batch(0), batch(1), batch(2), batch(3)
    routed = [("A", a0), ("B", b1), ("A", a2), ("A", a3)]
    assert core.group_by_actor(routed) == [("A", [a0, a2, a3]), ("B", [b1])]
    core.single_only.add("A")
    assert core.group_by_actor(routed) == [("A", [a0]), ("A", [a2]), ("A", [a3]), ("B", [b1])]


def test_a_group_stays_within_the_part_and_byte_limits():
    core = ProducerCore()
    many = [("A", batch(p % 4)) for p in range(m.MAX_PARTS_PER_REQUEST + 1)]
    assert [len(g) for _e, g in core.group_by_actor(many)] == [m.MAX_PARTS_PER_REQUEST, 1]
    big = [("A", batch(p, bytes(MAX_MANY_BYTES // 2))) for p in range(3)]
    assert [len(g) for _e, g in core.group_by_actor(big)] == [2, 1]


def test_the_request_carries_each_batch_as_a_part_of_its_frame():
    msg, frame = produce_many_request([batch(0, b"abc"), batch(5, b"de", topic="u", sequence=4)])
    assert msg.parts == [["t", 0, 0, -1, 3], ["u", 5, 0, 4, 2]] and frame == b"abcde"
    wire = codec.decode_request(codec.encode_request(msg, 1, [frame]))
    assert [bytes(p) for p in m.split_payloads(wire.msg.parts, wire.frames[0])] == [b"abc", b"de"]


def test_one_reply_settles_each_batch_by_its_own_part():
    core = ProducerCore(retries=0)
    core.keep_results = True
    ok, moved, refused = window(core, batch(0), batch(1), batch(2))
    core.sent(7, SentTogether("A", [ok, moved, refused]), 0.0)
    leader = {"endpoint": "tcp://elsewhere:1", "actor_id": "b", "leader_epoch": 3}
    reply = m.ProduceManyReply(results=[
        [10, 1, False, None],
        [0, 0, False, NotLeader("not the leader", topic="t", partition=1, leader=leader).to_wire()],
        [0, 0, False, {"code": "CORRUPT_BATCH", "message": "bad", "retriable": False, "data": {}}]])
    gave_up = core.settle(7, None, reply, 1.0)
    assert core.results == [("t", 0, 10, 1)]
    assert [(b.partition, e.code) for b, e in gave_up] == [(1, ErrorCode.NOT_LEADER), (2, ErrorCode.CORRUPT_BATCH)]
    assert core.take_hints() == [("t", 1, "tcp://elsewhere:1")]  # the new leader, for the metadata
    assert core.in_flight_records == 0 and not core.busy()


def test_a_retriable_part_is_retried_alone():
    core = ProducerCore()
    ok, moved = window(core, batch(0), batch(1))
    core.sent(3, SentTogether("A", [ok, moved]), 0.0)
    reply = m.ProduceManyReply(results=[[0, 1, False, None], [0, 0, False, NotOwner("moved").to_wire()]])
    assert core.settle(3, None, reply, 1.0) == []
    assert core.due(5.0) == [moved] and core.in_flight_records == 1


def test_an_actor_without_produce_many_gets_the_batches_again_as_produce_without_an_attempt():
    core = ProducerCore(retries=0)
    first, second = window(core, batch(0), batch(1))
    core.sent(3, SentTogether("A", [first, second]), 0.0)
    assert core.settle(3, UnknownOp("unknown op 'produce_many'", op="produce_many"), None, 1.0) == []
    assert core.single_only == {"A"} and core.due(1.0) == [first, second]
    assert first.attempts == 0  # retries=0 and still sent again: the op was refused, not the batch
    assert core.group_by_actor([("A", first), ("A", second)]) == [("A", [first]), ("A", [second])]


def test_a_produce_many_that_times_out_retries_each_batch():
    core = ProducerCore(request_timeout=1.0)
    first, second = window(core, batch(0), batch(1))
    core.sent(3, SentTogether("A", [first, second]), 0.0)
    assert core.timed_out(5.0) == []
    assert core.due(10.0) == [first, second]


def test_a_reply_without_one_result_per_part_fails_the_parts_and_is_not_trusted():
    core = ProducerCore(retries=0)
    first, second = window(core, batch(0), batch(1))
    core.sent(3, SentTogether("A", [first, second]), 0.0)
    gave_up = core.settle(3, None, m.ProduceManyReply(results=[[0, 1, False, None]]), 1.0)
    assert [e.code for _b, e in gave_up] == [ErrorCode.BAD_REQUEST] * 2 and core.results == []


def test_consumer_fetches_are_planned_per_actor():
    routed = [("A", "d0"), ("B", "d1"), ("A", "d2")]
    assert plan_fetches(routed, set()) == [("A", ["d0", "d2"]), ("B", ["d1"])]
    assert plan_fetches(routed, {"A"}) == [("A", ["d0"]), ("A", ["d2"]), ("B", ["d1"])]
    request = fetch_many_request([("t", 0, 5, 9), ("t", 3, 0, 10_000)])
    assert request.parts == [["t", 0, 5, 4096], ["t", 3, 0, 10_000 * 256]]
    assert request.max_bytes == 4096 + 10_000 * 256
    # A part is capped as a single fetch is (MAX_FETCH_BYTES), and follows the learnt record size.
    assert fetch_many_request([("t", 0, 0, 100_000)]).parts == [["t", 0, 0, 8 << 20]]
    assert fetch_many_request([("t", 0, 0, 100)], per_record=1000).parts == [["t", 0, 0, 100_000]]
