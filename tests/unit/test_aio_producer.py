"""The asyncio producer against a scripted connection: every batch handed over ends
acknowledged or failed, however the calls that handed it over end."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from zbroker.protocol import messages as m
from zbroker.protocol.errors import ErrorCode, Unavailable
from zbroker.client.aio import AsyncProducer
from zbroker.client.sync import ProduceError
from tests.support.aio_call_stand_in import SendByCall


class ScriptedConn(SendByCall):
    """Answers each Produce with the next outcome: an exception to raise, or a base offset."""
    request_timeout = 5.0

    def __init__(self, outcomes: list) -> None:
        self.outcomes = outcomes
        self.produced = 0

    async def refresh(self, topics=None) -> None:
        pass

    async def endpoint(self, topic: str, partition: int) -> str:
        return "partition-actor"

    async def call(self, endpoint, msg, frames=(), timeout=None):
        assert isinstance(msg, m.Produce)
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        self.produced += 1
        return type("Env", (), {"msg": m.ProduceReply(base_offset=outcome, count=1), "error": None})()

    async def close(self) -> None:
        pass


def scripted_producer(outcomes: list) -> AsyncProducer:
    producer = AsyncProducer("tcp://127.0.0.1:1", linger_ms=60_000)
    producer.conn.ctx.term()  # never used: the script answers instead
    producer.conn = ScriptedConn(outcomes)
    return producer


def test_a_delivery_that_dies_of_an_unexpected_error_fails_the_flush():
    producer = scripted_producer([RuntimeError("socket gone")])

    async def main():
        handle = await producer.send("t", b"v", partition=0)
        with pytest.raises(ProduceError, match="socket gone"):
            await producer.flush()
        await producer.close()
        return handle

    handle = asyncio.run(main())
    assert isinstance(handle.error, ProduceError)


def test_a_batch_waiting_out_its_retry_backoff_when_flush_is_cancelled_is_still_sent():
    producer = scripted_producer([Unavailable("actor restarting"), 7])

    async def main():
        handle = await producer.send("t", b"v", partition=0)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(producer.flush(), 0.01)  # the first retry waits 50 ms
        await producer.flush()
        await producer.close()
        return handle

    handle = asyncio.run(main())
    assert (handle.offset, handle.error, producer.conn.produced) == (7, None, 1)


def test_a_batch_over_the_frame_limit_fails_with_too_large_without_being_sent(monkeypatch):
    # An actor's socket drops such a frame without a reply: sent, it would only time out.
    monkeypatch.setattr("zbroker.client.core.MAX_FRAME_BYTES", 1000)
    producer = scripted_producer([])  # any call would fail the test: nothing to answer with

    async def main():
        handle = await producer.send("t", bytes(2000), partition=0)
        with pytest.raises(ProduceError) as info:
            await producer.flush()
        await producer.close()
        return handle, info.value

    handle, err = asyncio.run(main())
    assert err.code == ErrorCode.TOO_LARGE and producer.conn.produced == 0
    assert handle.error.code == ErrorCode.TOO_LARGE and handle.error.data["limit"] == 1000
