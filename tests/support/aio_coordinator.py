"""An in-process stand-in for the coordinator, for unit tests of the asyncio consumer.

An `AsyncConnection` whose requests never touch a socket. Each request is decided
when it arrives (`answer`, which subclasses write) and its reply comes one round
trip later, as the reader task would file it (`Correlation`, or the future of a
caller waiting), so two tasks' requests interleave as they would over the wire. An
answer of None parks the request: the test resolves it with `reply_to_parked`.
"""

from __future__ import annotations

import asyncio

from zbroker.protocol import messages as m
from zbroker.protocol.codec import Envelope
from zbroker.protocol.errors import ZBrokerError
from zbroker.client.aio import AsyncConnection, AsyncConsumer
from zbroker.client.core import MetadataCache
from zbroker.client.transport import Correlation


class ScriptedCoordinator(AsyncConnection):
    round_trip_s = 0.02

    def __init__(self) -> None:  # no ZeroMQ context: nothing here opens a socket
        self.url = "coordinator"
        self.request_timeout = 5.0
        self.waiting: dict = {}
        self.correlation = Correlation()
        self._arrived = asyncio.Event()
        self.metadata = MetadataCache()
        self.sent: list[m.Message] = []
        self.parked: list[int] = []
        self.closed = False

    def answer(self, msg: m.Message) -> m.Message | ZBrokerError | None:
        raise NotImplementedError

    async def send_request(self, endpoint: str, msg: m.Message) -> int:
        self.sent.append(msg)
        corr = self.correlation.allocate(1 + (getattr(msg, "follow", 0) or 0))
        outcome = self.answer(msg)
        if outcome is None:
            self.parked.append(corr)
        else:
            asyncio.get_running_loop().call_later(self.round_trip_s, self._resolve, corr, outcome)
        return corr

    async def send(self, endpoint: str, msg: m.Message, frames: tuple = ()) -> asyncio.Future:
        corr = await self.send_request(endpoint, msg)
        fut = asyncio.get_running_loop().create_future()
        fut.corr_id, fut.later = corr, []  # as AsyncConnection.send's: one reply, then no more
        self.waiting[corr] = fut
        return fut

    def reply_to_parked(self, outcome: m.Message | ZBrokerError | tuple) -> None:
        self._resolve(self.parked.pop(0), outcome)

    def _resolve(self, corr: int, outcome: m.Message | ZBrokerError | tuple) -> None:
        """`outcome`: a reply, an error, or (reply, payload frames) for a fetch; filed as the
        reader task files a reply."""
        if isinstance(outcome, ZBrokerError):
            env = Envelope(op="reply", corr_id=corr, error=outcome)
        elif isinstance(outcome, tuple):
            env = Envelope(op="reply", corr_id=corr, msg=outcome[0], frames=list(outcome[1]))
        else:
            env = Envelope(op="reply", corr_id=corr, msg=outcome)
        fut = self.waiting.pop(corr, None)
        if fut is not None:
            if not fut.done():
                fut.set_result(env)
        elif self.correlation.file(env):
            self._arrived.set()

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
