"""The asyncio consumer's acks: what could not be sent is held and goes with the next request."""

from __future__ import annotations

import asyncio

import pytest

from protocol.errors import StaleLease, Unavailable
from zbroker.client.aio import AsyncConsumer
from zbroker.client.core import AckAccumulator


def bare_consumer(outcomes: list) -> tuple[AsyncConsumer, list]:
    """A consumer whose group calls fail or succeed as `outcomes` says; returns what each call sent."""
    consumer = AsyncConsumer.__new__(AsyncConsumer)
    consumer.group, consumer.member_id, consumer.generation = "g", "m", 1
    consumer.acks = AckAccumulator()
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
