"""The console's line to the broker: raw DEALER sockets and the protocol codec, asyncio.

Deliberately thin and independent of zbroker.client: the console asks what any
admin client asks (status, describe_topic, describe_group, reset_group, fetch),
encoded with `zbroker.protocol.codec`, so a rewrite of the client library leaves
it alone. Requests to one endpoint go out together and their replies are matched
by correlation id: a snapshot of N groups is one round trip, not N.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import zmq
import zmq.asyncio

from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.batch import decode_fetched
from zbroker.protocol.errors import RequestTimeout, Unavailable, ZBrokerError


class BrokerLink:
    def __init__(self, url: str, *, timeout_s: float = 5.0, curve: Any = None) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.curve = curve
        self.ctx = zmq.asyncio.Context()
        self._socks: dict[str, zmq.asyncio.Socket] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._ids = itertools.count(1)

    def _sock(self, endpoint: str) -> zmq.asyncio.Socket:
        sock = self._socks.get(endpoint)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            if self.curve is not None:
                self.curve.apply(sock)
            sock.connect(endpoint)
            self._socks[endpoint] = sock
        return sock

    def _drop(self, endpoint: str) -> None:
        """After a timeout the socket may still get the late replies: a new one does not."""
        sock = self._socks.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    async def calls(self, msgs: list[m.Message], endpoint: str | None = None) -> list:
        """Send every request, then wait for all replies. Each result is the reply
        envelope, or the ZBrokerError it carried (one failure does not hide the rest)."""
        endpoint = endpoint or self.url
        lock = self._locks.setdefault(endpoint, asyncio.Lock())
        async with lock:
            sock = self._sock(endpoint)
            ids = [next(self._ids) for _ in msgs]
            try:
                for corr, msg in zip(ids, msgs):
                    await asyncio.wait_for(sock.send_multipart(codec.encode_request(msg, corr)), self.timeout_s)
                got: dict = {}
                async with asyncio.timeout(self.timeout_s):
                    while len(got) < len(ids):
                        env = codec.decode_reply(await sock.recv_multipart())
                        if env.corr_id in ids:
                            got[env.corr_id] = env
            except (TimeoutError, asyncio.TimeoutError):
                self._drop(endpoint)
                raise RequestTimeout(f"no reply from {endpoint} within {self.timeout_s}s", endpoint=endpoint) from None
            except zmq.ZMQError as err:
                self._drop(endpoint)
                raise Unavailable(f"cannot reach {endpoint}: {err}", endpoint=endpoint) from None
        return [got[c].error if got[c].error is not None else got[c] for c in ids]

    async def call(self, msg: m.Message, endpoint: str | None = None) -> m.Message:
        (result,) = await self.calls([msg], endpoint)
        if isinstance(result, ZBrokerError):
            raise result
        return result.msg

    # -- what the console asks ---------------------------------------------------------------

    async def gather(self) -> tuple[dict, dict, dict, list]:
        """status, {topic: describe}, {group: describe}, errors: two round trips."""
        status, topics, groups = await self.calls([m.Status(), m.ListTopics(), m.ListGroups()])
        errors = [str(r) for r in (status, topics, groups) if isinstance(r, ZBrokerError)]
        names = [] if isinstance(topics, ZBrokerError) else list(topics.msg.topics)
        gnames = [] if isinstance(groups, ZBrokerError) else [g["group"] for g in groups.msg.groups]
        described = await self.calls([m.DescribeTopic(topic=t) for t in names] +
                                     [m.DescribeGroup(group=g) for g in gnames]) if names or gnames else []
        topic_desc, group_desc = {}, {}
        for name, r in zip(names + gnames, described):
            if isinstance(r, ZBrokerError):
                errors.append(f"{name}: {r}")  # deleted meanwhile, say: shown, the rest still is
            elif isinstance(r.msg, m.DescribeTopicReply):
                topic_desc[name] = r.msg.to_fields()
            else:
                group_desc[name] = r.msg.group
        status_fields = {} if isinstance(status, ZBrokerError) else status.msg.to_fields()
        return status_fields, topic_desc, group_desc, errors

    async def reset_group(self, group: str, topic: str, to: str | int) -> dict:
        return (await self.call(m.ResetGroup(group=group, topic=topic, to=to))).to_fields()

    async def fetch(self, topic: str, partition: int, offset: int, limit: int,
                    max_bytes: int = 1 << 20) -> tuple[list, int, int]:
        """Up to `limit` records from `offset`: (records, log_start, log_end)."""
        desc = await self.call(m.DescribeTopic(topic=topic))
        endpoint = next((p.get("endpoint") for p in desc.partitions if p.get("partition") == partition), None)
        if endpoint is None:
            raise Unavailable(f"partition {topic}/{partition} has no live owner", topic=topic, partition=partition)
        (env,) = await self.calls([m.Fetch(topic=topic, partition=partition, offset=offset, max_bytes=max_bytes)],
                                  endpoint)
        if isinstance(env, ZBrokerError):
            raise env
        records = decode_fetched(env.frames[0] if env.frames else b"", topic, partition, from_offset=offset,
                                 until_offset=offset + limit)
        return records, env.msg.log_start, env.msg.log_end

    def close(self) -> None:
        for endpoint in list(self._socks):
            self._drop(endpoint)
        self.ctx.term()
