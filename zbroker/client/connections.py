"""The client's connections to the broker: sockets, sending, and matching replies to requests.

`Connection` (blocking, the sync driver's) and `AsyncConnection` (asyncio) hold
one DEALER per actor endpoint, the coordinator's and each partition actor's
(`sockets.client_dealer`), and match replies to requests by correlation id
(`transport.Correlation`: ids, replies kept until their waiter takes them,
replies given up on), so many requests can be in flight at once
(pipelining). They differ only in how they wait: `Connection` polls its
sockets when someone waits; `AsyncConnection` runs a reader task per socket
that files each reply as it comes, resolving the future of a request sent
with `send` or keeping it for `wait_reply`.

Sockets use ``ZMQ_IMMEDIATE``: nothing is queued towards a peer that is not
connected, so a request to a dead actor fails fast and is retried after a
metadata refresh instead of being delivered to its successor minutes later.
``url`` may list several coordinators, comma-separated
(`transport.Coordinators`): coordinator requests follow a NOT_COORDINATOR
answer, or move on after a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import zmq
import zmq.asyncio

from zbroker.client.core import MetadataCache
from zbroker.client.keys import ClientKeys
from zbroker.client.sockets import client_dealer, curve_from_env, poll_timeout_ms
from zbroker.client.transport import DEFAULT_URL, Coordinators, Correlation
from zbroker.client.wire import recv_frames, send_frames
from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.errors import RequestTimeout, Unavailable, ZBrokerError

__all__ = ["AsyncConnection", "Connection"]


class Connection:
    """Sockets to the coordinator and the partition actors, with request/reply matching.

    ``url`` may list several coordinators, comma-separated (`transport.Coordinators`):
    coordinator requests follow a NOT_COORDINATOR answer or move on after a timeout."""

    def __init__(self, url: str = DEFAULT_URL, *, request_timeout: float = 5.0,
                 curve: ClientKeys | None = None) -> None:
        self.coordinators = Coordinators(url)
        self.request_timeout = request_timeout
        self.curve = curve if curve is not None else curve_from_env()
        self.ctx = zmq.Context()
        self.sockets: dict[str, zmq.Socket] = {}
        self.poller = zmq.Poller()
        self.correlation = Correlation()
        self._early = self.correlation.early  # replies kept for their waiters
        self.metadata = MetadataCache()
        self._closed = False

    @property
    def url(self) -> str:
        """The coordinator this connection talks to now."""
        return self.coordinators.current

    def socket(self, endpoint: str) -> zmq.Socket:
        sock = self.sockets.get(endpoint)
        if sock is None:
            sock = client_dealer(self.ctx, endpoint, self.request_timeout, self.curve)
            self.sockets[endpoint] = sock
            self.poller.register(sock, zmq.POLLIN)
        return sock

    def send(self, endpoint: str, msg: m.Message, frames: tuple = (), *, replies: int = 1) -> int:
        """Send a request; returns its correlation id. A request answered more than once
        (a fetch with `follow`) reserves the ids of its later replies: id + 1, id + 2, ..."""
        follow = getattr(msg, "follow", 0)
        corr = self.correlation.allocate(max(replies, 1 + follow) if follow else replies)
        try:
            send_frames(self.socket(endpoint), codec.encode_request(msg, corr, frames), copy=len(frames) == 0,
                        block=True)  # up to SNDTIMEO: a connection still being made
        except zmq.Again:
            raise Unavailable(f"no connection to {endpoint} within {self.request_timeout}s",
                              endpoint=endpoint) from None
        return corr

    def recv(self, timeout_s: float) -> codec.Envelope | None:
        """The next reply from any socket, or None after ``timeout_s``."""
        events = self.poller.poll(poll_timeout_ms(timeout_s))
        for sock, _ in events:
            frames = recv_frames(sock)
            if frames is not None:
                return codec.decode_reply(frames)
        return None

    def recv_nowait_all(self) -> list[codec.Envelope]:
        out = []
        for sock in self.sockets.values():
            while (frames := recv_frames(sock)) is not None:
                out.append(codec.decode_reply(frames))
        return out

    def collect(self) -> None:
        """File every reply that is here now for its waiter (`Correlation.early`), without waiting."""
        keep = self.correlation.keep
        for env in self.recv_nowait_all():
            keep(env)

    def wait_for(self, corr: int, timeout: float | None = None) -> codec.Envelope:
        """Wait for the reply to ``corr``; other replies are kept for their waiters."""
        env = self._early.pop(corr, None)
        if env is not None:
            return env
        deadline = time.monotonic() + (self.request_timeout if timeout is None else timeout)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeout(f"no reply within {self.request_timeout if timeout is None else timeout}s",
                                     corr_id=corr)
            env = self.recv(remaining)
            if env is None:
                continue
            if env.corr_id == corr:
                return env
            self.correlation.keep(env)

    def take_stashed(self) -> list[codec.Envelope]:
        """The replies `wait_for` kept while it waited for another one (a pipelining
        caller that itself calls `wait_for`, say for a metadata refresh, takes its
        own replies back here)."""
        if not self._early:
            return []
        stashed = list(self._early.values())
        self._early.clear()
        return stashed

    def call(self, endpoint: str, msg: m.Message, frames: tuple = (), timeout: float | None = None) -> codec.Envelope:
        env = self.wait_for(self.send(endpoint, msg, frames), timeout)
        if env.error is not None:
            raise env.error
        return env

    def coordinator(self, msg: m.Message, timeout: float | None = None) -> m.Message:
        """A request to the coordinator, following NOT_COORDINATOR (and, with several
        URLs, timeouts) to the next one after a capped backoff."""
        coordinators = self.coordinators
        for attempt in range(coordinators.attempts()):
            try:
                reply = self.call(self.url, msg, timeout=timeout).msg
            except ZBrokerError as err:
                wait = coordinators.retry_in(err, attempt)
                if wait is None:
                    raise
                time.sleep(wait)
                continue
            coordinators.answered()
            return reply
        raise AssertionError("unreachable")

    def refresh(self, topics: list[str] | None = None) -> None:
        self.metadata.update(self.coordinator(m.Metadata(topics=topics)).topics)

    def endpoint(self, topic: str, partition: int) -> str:
        if topic not in self.metadata.topics:
            self.refresh([topic])
        endpoint = self.metadata.endpoint(topic, partition)
        if endpoint is None:
            self.refresh([topic])
            endpoint = self.metadata.endpoint(topic, partition)
        if endpoint is None:
            raise Unavailable(f"partition {topic}/{partition} has no live owner", topic=topic, partition=partition)
        return endpoint

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sock in self.sockets.values():
            sock.close(linger=0)
        self.sockets.clear()
        self.ctx.term()


class AsyncConnection:
    """Sockets to the coordinator and the partition actors; a reader task per socket resolves
    each request's future by correlation id. ``url`` may list several coordinators,
    comma-separated: coordinator requests follow NOT_COORDINATOR as the sync `Connection`'s do."""

    def __init__(self, url: str = DEFAULT_URL, *, request_timeout: float = 5.0,
                 curve: ClientKeys | None = None) -> None:
        self.url = url
        self.request_timeout = request_timeout
        self.curve = curve if curve is not None else curve_from_env()
        self.ctx = zmq.asyncio.Context()
        self.sockets: dict[str, zmq.asyncio.Socket] = {}
        self.readers: list[asyncio.Task] = []
        self.waiting: dict[int, asyncio.Future] = {}  # corr -> the future of someone waiting for it
        self.correlation = Correlation()  # ids, replies nobody waits for yet, replies given up on
        # Set when a reply is kept for a later waiter; cleared by `collect`, when a flow looks at
        # what is in: `wait_any` then wakes for what came after that look.
        self._arrived = asyncio.Event()
        self.metadata = MetadataCache()
        self.closed = False

    @property
    def url(self) -> str:
        """The coordinator this connection talks to now."""
        return self.coordinators.current

    @url.setter
    def url(self, url: str) -> None:
        self.coordinators = Coordinators(url)

    def socket(self, endpoint: str) -> zmq.asyncio.Socket:
        if self.closed:
            raise Unavailable("the connection is closed", endpoint=endpoint)
        sock = self.sockets.get(endpoint)
        if sock is None:
            sock = client_dealer(self.ctx, endpoint, self.request_timeout, self.curve)
            self.sockets[endpoint] = sock
            self.readers.append(asyncio.get_running_loop().create_task(self._read(sock)))
        return sock

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                env = codec.decode_reply(frames)
            except ZBrokerError:
                continue
            if not isinstance(env.corr_id, int):
                continue
            fut = self.waiting.pop(env.corr_id, None)
            if fut is not None:
                if not fut.done():
                    fut.set_result(env)
            elif self.correlation.file(env):
                self._arrived.set()

    async def send(self, endpoint: str, msg: m.Message, frames: tuple = ()) -> asyncio.Future:
        """Send a request; returns the future of its reply. A fetch with `follow` gets its later
        replies under id + 1 .. id + follow (PROTOCOL.md s.4): each has a future of its own, in
        the returned one's ``later`` list, so they match no other request and none is dropped."""
        follow = getattr(msg, "follow", 0) or 0
        corr = self.correlation.allocate(1 + follow)
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(1 + follow)]
        for i, future in enumerate(futures):
            future.corr_id = corr + i  # type: ignore[attr-defined]
            self.waiting[corr + i] = future
        fut = futures[0]
        fut.later = futures[1:]  # type: ignore[attr-defined]
        try:
            await self.socket(endpoint).send_multipart(codec.encode_request(msg, corr, frames))
        except zmq.Again:
            self.abandon(fut)
            raise Unavailable(f"no connection to {endpoint}", endpoint=endpoint) from None
        except BaseException:
            # Cancelled while the send waited for a connection (it is then dropped unsent), or
            # refused: nobody will wait for this id, and nothing else would ever remove it.
            self.abandon(fut)
            raise
        return fut

    async def send_request(self, endpoint: str, msg: m.Message) -> int:
        """Send a request whose replies are kept in `correlation` (``early``) until `wait_reply`
        takes them; returns its id. A followed fetch's later replies come under id + 1, ..."""
        corr = self.correlation.allocate(1 + (getattr(msg, "follow", 0) or 0))
        try:
            await self.socket(endpoint).send_multipart(codec.encode_request(msg, corr))
        except zmq.Again:
            raise Unavailable(f"no connection to {endpoint}", endpoint=endpoint) from None
        return corr

    async def wait_reply(self, corr: int, timeout: float | None = None) -> codec.Envelope:
        """The reply to ``corr`` (a reply that comes after the timeout is kept for a later waiter)."""
        env = self.correlation.early.pop(corr, None)
        if env is not None:
            return env
        if self.closed:
            raise Unavailable("the connection is closed", endpoint=self.url)
        fut = asyncio.get_running_loop().create_future()
        self.waiting[corr] = fut
        try:
            return await asyncio.wait_for(fut, self.request_timeout if timeout is None else timeout)
        except asyncio.TimeoutError:
            raise RequestTimeout(f"no reply within {self.request_timeout if timeout is None else timeout}s",
                                 corr_id=corr) from None
        finally:
            if self.waiting.get(corr) is fut:
                del self.waiting[corr]

    def collect(self) -> None:
        """The reader tasks keep every reply as it comes: this only marks that the caller looked."""
        self._arrived.clear()

    async def wait_any(self, timeout: float) -> None:
        """Until a reply is kept after the last `collect`, or ``timeout``."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._arrived.wait(), timeout)

    async def wait(self, fut: asyncio.Future, timeout: float | None = None) -> codec.Envelope:
        try:
            return await asyncio.wait_for(fut, self.request_timeout if timeout is None else timeout)
        except asyncio.TimeoutError:
            self.abandon(fut)
            raise RequestTimeout("no reply in time") from None
        except asyncio.CancelledError:
            # The caller gave up (asyncio.wait_for, a TaskGroup): forget the request as a timeout
            # does. Left in `waiting`, it would stay there for good if no reply ever comes (the
            # peer died), one entry per call given up on.
            self.abandon(fut)
            raise

    def abandon(self, fut: asyncio.Future) -> None:
        """Stop waiting for the reply (replies) of ``fut``'s request: if it comes, the reader drops it."""
        for future in [fut, *getattr(fut, "later", ())]:
            corr = getattr(future, "corr_id", None)
            if self.waiting.pop(corr, None) is not None:
                self.correlation.orphan(corr)
            future.cancel()

    async def call(self, endpoint: str, msg: m.Message, frames: tuple = (), timeout: float | None = None
                   ) -> codec.Envelope:
        env = await self.wait(await self.send(endpoint, msg, frames), timeout)
        if env.error is not None:
            raise env.error
        return env

    async def coordinator(self, msg: m.Message, timeout: float | None = None) -> m.Message:
        """A request to the coordinator, following NOT_COORDINATOR (and, with several URLs,
        timeouts) to the next one after a capped backoff (`transport.Coordinators`)."""
        coordinators = self.coordinators
        for attempt in range(coordinators.attempts()):
            try:
                reply = (await self.call(self.url, msg, timeout=timeout)).msg
            except ZBrokerError as err:
                wait = coordinators.retry_in(err, attempt)
                if wait is None:
                    raise
                await asyncio.sleep(wait)
                continue
            coordinators.answered()
            return reply
        raise AssertionError("unreachable")

    async def refresh(self, topics: list[str] | None = None) -> None:
        self.metadata.update((await self.coordinator(m.Metadata(topics=topics))).topics)

    async def endpoint(self, topic: str, partition: int) -> str:
        if topic not in self.metadata.topics or self.metadata.endpoint(topic, partition) is None:
            await self.refresh([topic])
        endpoint = self.metadata.endpoint(topic, partition)
        if endpoint is None:
            raise Unavailable(f"partition {topic}/{partition} has no live owner", topic=topic, partition=partition)
        return endpoint

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        readers, self.readers = self.readers, []
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        # Calls still waiting (another task's poll, fetch or admin request) fail with an error
        # they can catch. Cancelled, they raised CancelledError in tasks nobody cancelled: a
        # TaskGroup takes such a task for cancelled and drops it silently, and `await task`
        # passes the cancellation on to whoever awaits it.
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(Unavailable("the connection was closed before the reply came", endpoint=self.url))
        self.waiting.clear()
        for sock in self.sockets.values():
            sock.close(linger=0)
        self.sockets.clear()
        self.ctx.term()
