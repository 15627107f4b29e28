"""The asyncio consumer's acks: what could not be sent is held and goes with the next request."""

from __future__ import annotations

import asyncio

import pytest

from protocol.errors import StaleLease, Unavailable
from tests.support.aio_coordinator import ScriptedCoordinator, offline_consumer
from zbroker.client.aio import AsyncConsumer


def bare_consumer(outcomes: list) -> tuple[AsyncConsumer, list]:
    """A consumer whose group calls fail or succeed as `outcomes` says; returns what each call sent."""
    consumer = offline_consumer(None)
    sent: list = []

    async def group_call(make, timeout=None):
        msg = make()
        sent.append(msg)
        outcome = outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    consumer._group_call = group_call
    return consumer, sent


def test_acks_refused_as_retriable_or_cancelled_are_sent_again():
    consumer, sent = bare_consumer([Unavailable("coordinator away"), asyncio.CancelledError(), None])
    consumer.acks.add_range(["t", 0, 7, 0, 5])

    async def run():
        with pytest.raises(Unavailable):
            await consumer.flush_acks()
        with pytest.raises(asyncio.CancelledError):
            await consumer.flush_acks()
        await consumer.flush_acks()

    asyncio.run(run())
    assert [msg.ranges for msg in sent] == [[["t", 0, 7, 0, 5]]] * 3
    assert not consumer.acks


def test_acks_the_coordinator_calls_stale_are_not_sent_again():
    consumer, sent = bare_consumer([StaleLease("expired", stale=[["t", 0, 7, 0, 5]], applied=0), None])
    consumer.acks.add_range(["t", 0, 7, 0, 5])

    async def run():
        await consumer.flush_acks()  # the lease is gone: sending them again cannot help
        assert not consumer.acks
        consumer.acks.add_range(["t", 0, 8, 0, 2])
        await consumer.flush_acks()

    asyncio.run(run())
    assert [msg.ranges for msg in sent] == [[["t", 0, 7, 0, 5]], [["t", 0, 8, 0, 2]]]


class _AwayConn:
    """A coordinator that cannot be reached."""
    url = "coord"
    request_timeout = 5.0

    def __init__(self):
        self.sent = []
        self.closed = False

    async def call(self, endpoint, msg, frames=(), timeout=None):
        self.sent.append(type(msg).__name__)
        raise Unavailable("coordinator away")

    async def close(self):
        self.closed = True


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
    from protocol import messages as m

    class AwayCoordinator(ScriptedCoordinator):
        def answer(self, msg):
            msg.check()  # what the coordinator does on decode: a wait over 60 s was BAD_REQUEST
            return Unavailable("away")

    c = _bare_member(AwayCoordinator())
    with pytest.raises(Unavailable):
        asyncio.run(c.poll(timeout=90))
    assert c.conn.sent[0].max_wait_ms == m.MAX_WAIT_MS


def test_the_heartbeat_goes_on_when_a_re_join_fails():
    from protocol import messages as m
    from protocol.errors import Fenced, RequestTimeout
    c = _bare_member(None)
    c.session_timeout_ms = 150  # a beat every 50 ms
    calls = []

    class Coordinator:
        url = "coord"
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
