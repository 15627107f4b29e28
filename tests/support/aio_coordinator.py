"""An in-process stand-in for the coordinator, for unit tests of the asyncio consumer.

An `AsyncConnection` whose `send` never touches a socket. Each request is decided
when it arrives (`answer`, which subclasses write) and its reply comes one round
trip later, so two tasks' requests interleave as they would over the wire. An
answer of None parks the request: the test resolves it with `reply_to_parked`.
"""

from __future__ import annotations

import asyncio
import itertools

from zbroker.protocol import messages as m
from zbroker.protocol.codec import Envelope
from zbroker.protocol.errors import ZBrokerError
from zbroker.client.aio import AsyncConnection, AsyncConsumer
from zbroker.client.core import MetadataCache


class ScriptedCoordinator(AsyncConnection):
    round_trip_s = 0.02

    def __init__(self) -> None:  # no ZeroMQ context: nothing here opens a socket
        self.url = "coordinator"
        self.request_timeout = 5.0
        self.waiting: dict = {}
        self.metadata = MetadataCache()
        self.sent: list[m.Message] = []
        self.parked: list[asyncio.Future] = []
        self.closed = False
        self._ids = itertools.count(1)

    def answer(self, msg: m.Message) -> m.Message | ZBrokerError | None:
        raise NotImplementedError

    async def send(self, endpoint: str, msg: m.Message, frames: tuple = ()) -> asyncio.Future:
        self.sent.append(msg)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        fut.corr_id, fut.later = next(self._ids), []  # as AsyncConnection.send's: one reply, then no more
        outcome = self.answer(msg)
        if outcome is None:
            self.parked.append(fut)
        else:
            loop.call_later(self.round_trip_s, self._resolve, fut, outcome)
        return fut

    def reply_to_parked(self, outcome: m.Message | ZBrokerError | tuple) -> None:
        self._resolve(self.parked.pop(0), outcome)

    @staticmethod
    def _resolve(fut: asyncio.Future, outcome: m.Message | ZBrokerError | tuple) -> None:
        """`outcome`: a reply, an error, or (reply, payload frames) for a fetch."""
        if fut.done():  # abandoned by the consumer
            return
        if isinstance(outcome, ZBrokerError):
            fut.set_result(Envelope(op="reply", corr_id=0, error=outcome))
        elif isinstance(outcome, tuple):
            fut.set_result(Envelope(op="reply", corr_id=0, msg=outcome[0], frames=list(outcome[1])))
        else:
            fut.set_result(Envelope(op="reply", corr_id=0, msg=outcome))

    async def refresh(self, topics: list[str] | None = None) -> None:
        pass

    async def close(self) -> None:
        self.closed = True


def offline_consumer(conn, **options) -> AsyncConsumer:
    """A consumer that joined as member "m" in generation 1, talking to ``conn`` only."""
    consumer = AsyncConsumer("tcp://127.0.0.1:1", group="g", topics=["t"], **options)
    consumer.conn.ctx.term()  # never used: `conn` answers instead
    consumer.conn = conn
    consumer.member_id, consumer.generation = "m", 1
    return consumer
