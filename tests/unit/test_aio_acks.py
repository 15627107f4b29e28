"""The asyncio consumer's acks: what could not be sent is held and goes with the next request."""

from __future__ import annotations

import asyncio

import pytest

from zbroker.client.transport import Coordinators
from zbroker.protocol.codec import Envelope
from zbroker.protocol.errors import StaleLease, Unavailable
from zbroker.protocol.messages import Ack, AckReply, NackReply, Poll, PollReply
from tests.support.aio_coordinator import ScriptedCoordinator, offline_consumer
from zbroker.client.aio import AsyncConsumer
from zbroker.client.core import RANGES_PER_REQUEST, ConsumedRecord


class OutcomeCoordinator(ScriptedCoordinator):
    """Answers each group request with the next of ``outcomes``: a reply, an error, or PARK
    (never answered)."""

    def __init__(self, outcomes: list) -> None:
        super().__init__()
        self.outcomes = outcomes

    def answer(self, msg):
        outcome = self.outcomes.pop(0)
        return None if outcome is PARK else outcome


PARK = object()


def bare_consumer(outcomes: list) -> tuple[AsyncConsumer, list]:
    """A consumer whose group requests are answered as `outcomes` says; returns what each sent."""
    conn = OutcomeCoordinator(outcomes)
    return offline_consumer(conn), conn.sent


def test_acks_refused_as_retriable_or_cancelled_are_sent_again():
    consumer, sent = bare_consumer([Unavailable("coordinator away"), PARK, AckReply(applied=5)])
    consumer.acks.add_range(["t", 0, 7, 0, 5])

    async def run():
        with pytest.raises(Unavailable):
            await consumer.flush_acks()
        flushing = asyncio.create_task(consumer.flush_acks())
        await asyncio.sleep(0.05)  # sent, and waiting for the reply that never comes
        flushing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await flushing
        await consumer.flush_acks()

    asyncio.run(run())
    assert [msg.ranges for msg in sent] == [[["t", 0, 7, 0, 5]]] * 3
    assert not consumer.acks


def test_acks_the_coordinator_calls_stale_are_not_sent_again():
    consumer, sent = bare_consumer([StaleLease("expired", stale=[["t", 0, 7, 0, 5]], applied=0),
                                    AckReply(applied=2)])
    consumer.acks.add_range(["t", 0, 7, 0, 5])

    async def run():
        await consumer.flush_acks()  # the lease is gone: sending them again cannot help
        assert not consumer.acks
        consumer.acks.add_range(["t", 0, 8, 0, 2])
        await consumer.flush_acks()

    asyncio.run(run())
    assert [msg.ranges for msg in sent] == [[["t", 0, 7, 0, 5]], [["t", 0, 8, 0, 2]]]


class _AwayConn(ScriptedCoordinator):
    """A coordinator that cannot be reached: every send fails."""

    async def send_request(self, endpoint, msg):
        self.sent.append(type(msg).__name__)
        raise Unavailable("coordinator away")


def _bare_member(conn) -> AsyncConsumer:
    return offline_consumer(conn, session_timeout_ms=300)


def test_close_raises_when_the_held_acks_could_not_be_sent():
    # As the sync consumer does: an application that closes must learn its acks were not applied.
    c = _bare_member(_AwayConn())
    c.acks.add_range(["t", 0, 7, 0, 5])
    with pytest.raises(Unavailable):
        asyncio.run(c.close())
    assert c.acks and c.conn.closed and c.conn.sent == ["Ack"]


def test_a_long_poll_timeout_asks_for_at_most_the_longest_wait():
    from zbroker.protocol import messages as m

    class AwayCoordinator(ScriptedCoordinator):
        def answer(self, msg):
            msg.check()  # what the coordinator does on decode: a wait over 60 s was BAD_REQUEST
            return Unavailable("away")

    c = _bare_member(AwayCoordinator())
    with pytest.raises(Unavailable):
        asyncio.run(c.poll(timeout=90))
    assert c.conn.sent[0].max_wait_ms == m.MAX_WAIT_MS


def test_the_heartbeat_goes_on_when_a_re_join_fails():
    from zbroker.protocol import messages as m
    from zbroker.protocol.errors import Fenced, RequestTimeout
    c = offline_consumer(None, session_timeout_ms=150)  # a beat every 50 ms
    calls = []

    class Coordinator:
        url = "coord"
        coordinators = Coordinators(url)
        request_timeout = 5.0

        async def coordinator(self, msg, timeout=None):
            calls.append(type(msg).__name__)
            if isinstance(msg, m.Heartbeat):
                raise Fenced("fenced", generation=2)
            raise RequestTimeout("join timed out")  # the coordinator is slow for a moment
    c.conn = Coordinator()

    async def main():
        task = asyncio.create_task(c._heartbeat())
        await asyncio.sleep(0.4)
        alive = not task.done()
        task.cancel()
        return alive
    assert asyncio.run(main())
    assert calls.count("Heartbeat") >= 2 and calls.count("Join") >= 2


def gapped_ranges(count: int) -> list[list]:
    """Every other offset of one lease: ``count`` ranges that cannot merge."""
    return [["t", 0, 7, 2 * i, 2 * i + 1] for i in range(count)]


def applied(n: int, reply_type: type = AckReply):
    return reply_type(applied=n)


def test_more_ranges_than_one_request_holds_go_in_several_acks_and_lease_calls():
    ranges = gapped_ranges(RANGES_PER_REQUEST + 1000)
    consumer, sent = bare_consumer([applied(RANGES_PER_REQUEST), applied(1000),
                                    applied(RANGES_PER_REQUEST, NackReply), applied(1000, NackReply)])
    for r in ranges:
        consumer.acks.add_range(r)
    records = [ConsumedRecord("t", 0, r[3], 0, None, b"", None, 7, 1, "new") for r in ranges]

    async def run():
        await consumer.flush_acks()
        return await consumer.nack(records)

    assert asyncio.run(run()) == len(ranges)
    assert [(type(msg).__name__, len(msg.ranges)) for msg in sent] == [
        ("Ack", RANGES_PER_REQUEST), ("Ack", 1000), ("Nack", RANGES_PER_REQUEST), ("Nack", 1000)]
    assert [r for msg in sent[:2] for r in msg.ranges] == ranges


def test_only_the_acks_of_a_request_that_failed_are_held_again():
    consumer, sent = bare_consumer([applied(RANGES_PER_REQUEST), Unavailable("coordinator away")])
    ranges = gapped_ranges(RANGES_PER_REQUEST + 10)
    for r in ranges:
        consumer.acks.add_range(r)
    with pytest.raises(Unavailable):
        asyncio.run(consumer.flush_acks())
    assert consumer.acks.take() == ranges[RANGES_PER_REQUEST:]


def test_a_poll_carries_the_acks_one_request_holds_and_the_rest_go_first():
    class Coordinator(ScriptedCoordinator):
        def answer(self, msg):
            if isinstance(msg, Ack):
                return AckReply(applied=len(msg.ranges))
            return PollReply(generation=1, deliveries=[], ack_timeout_ms=30_000, acked=len(msg.acks), stale=[])

    c = _bare_member(Coordinator())
    ranges = gapped_ranges(RANGES_PER_REQUEST + 10)
    for r in ranges:
        c.acks.add_range(r)
    assert asyncio.run(c.poll(timeout=0.0)) == []
    assert [(type(msg).__name__, len(msg.acks if isinstance(msg, Poll) else msg.ranges)) for msg in c.conn.sent] == [
        ("Ack", 10), ("Poll", RANGES_PER_REQUEST)]
    assert not c.acks
