"""For stand-in connections of the asyncio producer written as one `call` per request.

The producer sends with `AsyncConnection.send` and files each reply as its future
resolves (`producer_core.ProducerCore` decides what it means). `SendByCall` gives a
stand-in that answers in `call(endpoint, msg, frames)` that `send`: a future per
request, resolved with the call's envelope, its `ZBrokerError` as the envelope's
error, or any other exception as the future's (a broken socket under the request).
"""

from __future__ import annotations

import asyncio
import itertools
import types

from zbroker.protocol import messages as m
from zbroker.protocol.errors import ZBrokerError


class SendByCall:
    _ids = itertools.count(1)

    async def send(self, endpoint, msg, frames=()):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        fut.corr_id, fut.later = next(self._ids), []

        async def answer():
            try:
                env = await self.call(endpoint, msg, frames)
            except ZBrokerError as err:
                env = types.SimpleNamespace(msg=None, error=err)
            except Exception as exc:
                if not fut.done():
                    fut.set_exception(exc)
                return
            if not fut.done():
                fut.set_result(env)

        fut.answering = loop.create_task(answer())  # kept: a task nobody holds may be collected
        return fut

    def abandon(self, fut) -> None:
        fut.cancel()

    async def coordinator(self, msg, timeout=None):
        """`ProducerFlow` asks the coordinator where a retried batch's topic lives now
        (`Metadata`): the stand-in's `refresh` is told, and the answer changes nothing."""
        assert isinstance(msg, m.Metadata), msg
        await self.refresh(msg.topics)
        return m.MetadataReply(topics=[])
