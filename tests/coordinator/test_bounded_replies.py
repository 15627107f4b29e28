"""Replies the coordinator sends stay readable: under the 1 MiB header limit a client
reads (PROTOCOL.md s.6), however a request or the state it meets is shaped.

A reply over the limit is dropped unread by the client, which cannot even tell which
request it answered: a poll's records then expire unseen again and again until they
are dead-lettered; a small ack could also make the coordinator build a huge reply.
"""

import pytest

from zbroker.actors.group_coordinator.core import MAX_REASON_BYTES, STALE_REPORT_LIMIT, GroupConfig
from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.errors import ZBrokerError
from tests.coordinator import Driver


def test_a_small_ack_naming_a_fragmented_lease_many_times_gets_a_small_reply():
    d = Driver()
    d.log_range("t", 0, 0, 1000)
    a = d.join()
    lease = d.poll(a, max_records=1000).deliveries[0][2]
    # Every even offset goes back (a delayed nack): the lease is fragmented into 500 pieces.
    d.settle("nack", a, [["t", 0, lease, o, o + 1] for o in range(0, 1000, 2)], delay_ms=60_000)
    ranges = [["t", 0, lease, 0, 1000]] * 2000  # each names the whole lease
    request = codec.encode_request(m.Ack(group="g", member_id=a.member_id, generation=a.generation,
                                         ranges=ranges), 1)
    assert len(request[0]) < 64 * 1024
    err = d.settle("ack", a, ranges)
    assert err.code.value == "STALE_LEASE"
    assert err.data["applied"] == 500, "the odd offsets, each acked once however often named"
    assert len(err.data["stale"]) == 500, "the ranges were merged before being settled"
    assert len(codec.encode_error("ack", 1, err)[0]) <= codec.MAX_HEADER_BYTES


def test_stale_ranges_past_the_report_limit_are_counted_not_listed():
    d = Driver()
    a = d.join()
    unknown = [["t", 0, 10**9 + i, 2 * i, 2 * i + 1] for i in range(STALE_REPORT_LIMIT + 250)]
    err = d.settle("ack", a, unknown)
    assert len(err.data["stale"]) == STALE_REPORT_LIMIT
    assert err.data["stale_omitted"] == 250


def test_a_poll_over_thousands_of_fragments_is_answered_in_parts_the_client_can_read():
    d = Driver(config=GroupConfig(max_in_flight=100_000, max_deliveries=3, ack_timeout_ms=1_000))
    d.log_range("t", 0, 0, 100_000)
    a = d.join()
    lease = d.poll(a, max_records=100_000).deliveries[0][2]
    # Every other record processed, then the consumer stalled: 50,000 ranges expire one by one.
    d.settle("ack", a, [["t", 0, lease, o, o + 1] for o in range(0, 100_000, 2)])
    d.advance(1_000)
    a = d.resync(a)
    seen = set()
    while len(seen) < 50_000:
        reply = d.poll(a, max_records=100_000)
        assert reply.deliveries, "records left undelivered"
        frame = codec.encode_reply(reply, 7)[0]
        assert codec.decode_reply([frame]).msg.deliveries == reply.deliveries  # readable
        for _t, _p, lease_id, start, end, _attempt, _reason in reply.deliveries:
            seen.update(range(start, end))
        d.settle("ack", a, [["t", 0, lease_id, start, end] for _t, _p, lease_id, start, end, _a, _r
                            in reply.deliveries])
    assert seen == set(range(1, 100_000, 2))
    assert not d.dead_letters()


def test_a_long_nack_reason_is_cut_and_every_redelivery_stays_readable():
    d = Driver(config=GroupConfig(max_in_flight=10_000))
    d.log_range("t", 0, 0, 2_000)
    a = d.join()
    lease = d.poll(a, max_records=2_000).deliveries[0][2]
    reason = "é" * 200_000  # 400 KB of reason, within the request limit
    d.settle("nack", a, [["t", 0, lease, o, o + 1] for o in range(0, 2_000, 2)], reason=reason)
    reply = d.poll(a, max_records=2_000)
    assert reply.deliveries
    for *_, got_reason in reply.deliveries:
        assert got_reason.startswith("nack:é") and len(got_reason.encode()) <= MAX_REASON_BYTES
    assert len(codec.encode_reply(reply, 1)[0]) <= codec.MAX_HEADER_BYTES


def test_a_reply_over_the_header_limit_is_a_too_large_error_that_names_the_request():
    topic = "orders-" + "x" * 100
    d = Driver({topic: 10_000})
    reply = d.join(topics=[topic])
    frames = codec.encode_reply(reply, 41)
    assert len(frames[0]) <= codec.MAX_HEADER_BYTES
    envelope = codec.decode_reply(frames)
    assert envelope.corr_id == 41
    assert isinstance(envelope.error, ZBrokerError) and envelope.error.code.value == "TOO_LARGE"
    assert envelope.error.data["got"] > codec.MAX_HEADER_BYTES


def test_a_poll_carrying_stale_acks_still_fits_beside_the_records_it_leases():
    """The acks riding on a poll are echoed back when stale. Their topics are bounded by
    the longest topic name (a longer one is BAD_REQUEST), which the poll reply's budget
    for deliveries leaves room for."""
    from zbroker.protocol.errors import ProtocolError

    d = Driver(config=GroupConfig(max_in_flight=100_000, ack_timeout_ms=60_000))
    d.log_range("t", 0, 0, 4000)
    a = d.join()
    lease = d.poll(a, max_records=4000).deliveries[0][2]
    # Every other record nacked with a long reason: 2000 fragments ready.
    d.settle("nack", a, [["t", 0, lease, o, o + 1] for o in range(0, 4000, 2)], reason="r" * 300)

    def poll_with_stale_acks(topic: str) -> m.Poll:
        acks = [[topic, 0, 10**12 + i, 0, 1] for i in range(STALE_REPORT_LIMIT)]
        return m.Poll(group="g", member_id=a.member_id, generation=a.generation, max_records=100_000, acks=acks)

    too_long = codec.encode_request(poll_with_stale_acks("z" * 700), 1)
    assert len(too_long[0]) < codec.MAX_HEADER_BYTES
    with pytest.raises(ProtocolError, match="names no topic"):
        codec.decode_request(too_long)
    reply = d.call("poll", poll_with_stale_acks("z" * 200))
    assert reply.deliveries and len(reply.stale) == STALE_REPORT_LIMIT
    assert codec.decode_reply(codec.encode_reply(reply, 1)).error is None


def test_a_poll_counts_the_stale_acks_it_does_not_list():
    # A reviewer's point: an ack said how many stale ranges it left out of its reply,
    # a poll carrying the same acks cut the list at 1,000 and said nothing.
    d = Driver()
    d.log_range("t", 0, 0, 10)
    a = d.join()
    unknown = [["t", 0, 10**9 + i, 2 * i, 2 * i + 1] for i in range(STALE_REPORT_LIMIT + 250)]
    reply = d.call("poll", m.Poll(group="g", member_id=a.member_id, generation=a.generation, max_records=10,
                                  acks=unknown))
    assert len(reply.stale) == STALE_REPORT_LIMIT and reply.stale_omitted == 250
    assert reply.deliveries  # the stale acks did not fail the poll
    assert codec.decode_reply(codec.encode_reply(reply, 1)).msg.stale_omitted == 250
