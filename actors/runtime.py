"""What every actor's process shell shares: logging, signals, the clock, sockets.

Shells stay thin: they read the clock once per loop turn, pass it to their
core, and carry out the effects it returns. The helpers here keep the
ZeroMQ details (linger, ROUTER envelopes, error replies for undecodable
frames) in one place.
"""

from __future__ import annotations

import collections
import gc
import logging
import os
import signal
import sys
import time
from typing import Any

import structlog
import zmq

from zbroker.client.wire import send_frames
from zbroker.protocol import codec
from zbroker.protocol.errors import ProtocolError, ZBrokerError

# The largest message a socket accepts. Anything bigger is dropped by libzmq
# before it costs memory (it closes that peer's connection).
MAX_MESSAGE_BYTES = codec.MAX_FRAME_BYTES
# Outgoing queue bound per peer: a consumer that never reads gets its replies
# dropped at this mark instead of growing the actor's memory.
SEND_HWM = 10_000
RECV_HWM = 10_000


# CPython runs its youngest collection every 700 net allocations of container
# objects. An actor allocates a few per thing it handles (decoded frames, rows,
# replies) and frees nearly all of them by reference counting, so those
# collections find little and cost much: a fifth of the commit writer's CPU at
# 70,000 advances/s (bench/PROFILE.md, twelfth pass). Cycles are still
# collected, only less often: so not in the partition actor, whose refused
# client frames (up to 64 MiB) stay in such cycles until a collection.
GC_THRESHOLDS = (50_000, 50, 100)


def tune_gc() -> None:
    """Call once an actor has built its state: what startup made is frozen out of
    every later collection, and the young generation is collected less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def raise_open_file_limit() -> int | None:
    """Lift this process's soft limit on open files to its hard limit; returns the
    soft limit now in force (None: unlimited).

    A partition actor holds 2 descriptors per open partition and up to 8 more per
    partition for reading closed segments; the usual soft default of 1024 runs out
    at a few hundred partitions while the hard limit is often far higher.
    """
    import resource  # POSIX only, like the rest of the actors' process handling

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass  # e.g. an infinite hard limit the kernel caps lower: keep what we have
    return None if soft == resource.RLIM_INFINITY else soft


def now_ms() -> int:
    """Every actor core's clock: monotonic, so that a wall clock stepped by NTP moves no
    deadline (registrations, leases, fetch waits). A time that is stored or sent (a
    batch's append time) is read from the wall clock apart from this, and named so."""
    return time.monotonic_ns() // 1_000_000


def now_ms_fine() -> float:
    """`now_ms`, the same clock, with the fraction kept: the commit writer times flushes
    that take well under a millisecond."""
    return time.monotonic_ns() / 1_000_000


class _StderrLogger(structlog.PrintLogger):
    """Drops a line stderr cannot take instead of raising it into the code that logged.

    stderr is often a pipe: `zbroker up 2>&1 | tee broker.log`, whose reader Ctrl-C
    ends first, or a journal that restarts. Raised, the write's BrokenPipeError cut
    short whatever logged it: the commit writer's SIGTERM handler (it logs before it
    sets its stop event) and so the writer never stopped, not even on PDEATHSIG, and
    the supervisor's stop after its first line, which left it hanging in
    multiprocessing's exit join of that writer.
    """

    def msg(self, message: str) -> None:
        try:
            super().msg(message)
        except OSError:
            pass

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


def configure_logging(level: str = "info", **bind: Any) -> structlog.stdlib.BoundLogger:
    """structlog to stderr: JSON when stderr is not a terminal, readable otherwise."""
    level_no = getattr(logging, level.upper(), logging.INFO)
    renderer: Any
    if sys.stderr.isatty():
        renderer = structlog.dev.ConsoleRenderer(colors=True)
    else:
        renderer = structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=lambda *_args, stream=sys.stderr: _StderrLogger(stream),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(pid=os.getpid(), **bind)
    return structlog.get_logger("zbroker")


class StopFlag:
    """Set by SIGTERM/SIGINT; the loop checks it every turn and drains."""

    def __init__(self) -> None:
        self.stopping = False
        self.signal: int | None = None

    def install(self) -> "StopFlag":
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        return self

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stopping = True
        self.signal = signum


def ignore_stop_signals() -> None:
    """Call once an actor has finished stopping.

    While the interpreter finalizes, CPython resets Python-level signal
    handlers to the default action, so a second SIGTERM from an impatient
    supervisor would end an actor that already stopped cleanly with -15.
    Ignored signals are left ignored.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def make_socket(ctx: zmq.Context, kind: int, *, identity: bytes | None = None,
                handover: bool = True) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.SNDHWM, SEND_HWM)
    sock.setsockopt(zmq.RCVHWM, RECV_HWM)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        # Mandatory: a reply to a full queue raises EAGAIN and one to a peer that went
        # away EHOSTUNREACH (`send_reply` handles both), where ZeroMQ would otherwise
        # drop it without a word. With handover a reconnecting peer reusing its
        # identity takes the old route; without it, an identity in use cannot be
        # taken by anyone else.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1 if handover else 0)
    # ZMTP heartbeats notice a peer that vanished without closing its connection
    # (a host gone, a cable cut) within seconds instead of TCP's minutes.
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    return sock


def bind_endpoint(sock: zmq.Socket, endpoint: str) -> str:
    """Bind and return the concrete endpoint (resolves ``tcp://host:*``/``:0``)."""
    if endpoint.endswith(":0"):
        endpoint = endpoint[:-2] + ":*"
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


# Hosts that bind every interface. Nobody can dial one: a peer told `tcp://0.0.0.0:7402`
# dials itself (and another host's actor, its own machine).
WILDCARD_HOSTS = frozenset({"0.0.0.0", "*"})


def endpoint_host(endpoint: str) -> str:
    """The host of a ``tcp://host:port`` endpoint (IPv6 in brackets, as ZeroMQ writes it)."""
    return endpoint.split("://", 1)[-1].rsplit(":", 1)[0]


def wildcard_error(endpoint: str, flag: str = "--advertise-host") -> str | None:
    """Why peers could not be told `endpoint` as it is, or None when they can."""
    if endpoint_host(endpoint) in WILDCARD_HOSTS:
        return (f"{endpoint} listens on every interface, and no peer can dial that address: give {flag} "
                f"with the name or address clients and other hosts reach this one at")
    return None


def advertised_endpoint(bound: str, advertise_host: str | None) -> str:
    """What peers are told to dial for a socket bound at `bound`: its host replaced by
    `advertise_host` when given (a wildcard bind must have one, see `wildcard_error`)."""
    if not advertise_host:
        problem = wildcard_error(bound)
        if problem:
            raise ValueError(problem)
        return bound
    scheme, rest = bound.split("://", 1)
    port = rest.rsplit(":", 1)[1]
    host = f"[{advertise_host}]" if ":" in advertise_host and not advertise_host.startswith("[") else advertise_host
    return f"{scheme}://{host}:{port}"


class RouterToken:
    """Where a reply to one request goes: the socket, the peer's routing id and the request id."""

    __slots__ = ("identity", "corr_id", "op", "sock")

    def __init__(self, identity: bytes, corr_id: Any, op: str | None, sock: Any = None) -> None:
        self.identity = identity
        self.corr_id = corr_id
        self.op = op
        self.sock = sock


def split_router_message(frames: list) -> tuple[bytes | None, list]:
    """A ROUTER message is [identity, *message]. Returns (None, []) when malformed."""
    if len(frames) < 2:
        return None, []
    return frames[0], frames[1:]


def decode_or_error(frames: list, log: Any) -> tuple[codec.Envelope | None, list | None]:
    """Decode a request; on failure return the error reply frames to send back.

    A frame a peer got wrong is answered and logged, never raised: an actor
    keeps serving everyone else.
    """
    try:
        return codec.decode_request(frames), None
    except ProtocolError as err:
        corr_id = getattr(err, "corr_id", None)
        op = getattr(err, "op", None)
        log.info("request.rejected", code=err.code.value, reason=err.message, op=op)
        return None, codec.encode_error(op, corr_id, err)


_dropped: dict[str, int] = {}  # messages this process dropped at a full queue, by what they were


def _note_dropped(what: str) -> None:
    _dropped[what] = dropped = _dropped.get(what, 0) + 1
    if dropped & (dropped - 1) == 0:  # the 1st, 2nd, 4th, 8th...: a stuck peer cannot flood the log
        structlog.get_logger("zbroker").warning(f"{what}.dropped", reason="peer queue full", dropped_so_far=dropped)


SENT, FULL, GONE = "sent", "full", "gone"


def send_status(sock: zmq.Socket, identity: bytes | None, frames: list) -> str:
    """Send without blocking: SENT; FULL if the peer's queue is full; GONE if the
    peer went away (EHOSTUNREACH under ROUTER_MANDATORY), when nobody waits for it."""
    try:
        send_frames(sock, frames if identity is None else [identity, *frames], copy=False)
    except zmq.Again:
        return FULL
    except zmq.ZMQError as exc:
        if exc.errno != zmq.EHOSTUNREACH:
            raise
        return GONE
    return SENT


def try_send(sock: zmq.Socket, identity: bytes | None, frames: list) -> bool:
    """Send without blocking; False if the peer's queue is full. A reply to a peer
    that went away counts as sent: nobody is waiting for it."""
    return send_status(sock, identity, frames) != FULL


def send_reply(sock: zmq.Socket, identity: bytes | None, frames: list, what: str = "reply") -> None:
    """Send without blocking; a full queue (slow peer) drops the message, logged as `<what>.dropped`."""
    if not try_send(sock, identity, frames):
        _note_dropped(what)


class Outbox:
    """Replies held for the end of a loop turn (or until `limit` are held), then sent together.

    Sending a message whose queue the ZeroMQ I/O thread already drained wakes that
    thread: one reply per request costs a wake-up each (a quarter of a partition
    actor's CPU with one record per request, bench/PROFILE.md, eleventh pass). Sent
    back to back, the replies of a turn share one. `limit` bounds how long the first
    reply of a busy turn waits for the requests after it.

    A reply sent with ``must_arrive`` that finds its peer's queue full waits in that
    peer's line and is tried again at each flush: a dropped produce reply costs its
    producer a request timeout and, once the log no longer remembers that sequence,
    a DUPLICATE_SEQUENCE failure for a record that was stored. A flush tries the
    head of each waiting line only until it finds no room, so a peer that stops
    reading costs one attempt per turn, not one per reply it left waiting (with
    every reply retried, one such client held tens of thousands and slowed every
    other client of the actor a hundredfold). A line holds at most `retry_limit`
    replies, and all lines together at most `total_limit` (many peers that stop
    reading); past either, the oldest of the longest line are dropped and logged. Other replies (a fetch
    can be sent again) are dropped at a full queue, which bounds what a peer that
    never reads costs.
    """

    __slots__ = ("_held", "_waiting", "_waiting_total", "limit", "retry_limit", "total_limit")

    def __init__(self, limit: int = 32, retry_limit: int = 100_000, total_limit: int = 200_000) -> None:
        self._held: list[tuple[zmq.Socket, bytes | None, list, bool]] = []
        # (socket, peer identity) -> replies that must arrive, oldest first
        self._waiting: dict[tuple[zmq.Socket, bytes | None], collections.deque[list]] = {}
        self._waiting_total = 0
        self.limit = limit
        self.retry_limit = retry_limit
        self.total_limit = total_limit

    def send(self, sock: zmq.Socket, identity: bytes | None, frames: list, must_arrive: bool = False) -> None:
        held = self._held
        held.append((sock, identity, frames, must_arrive))
        if len(held) >= self.limit:
            self.flush()

    @property
    def retrying(self) -> bool:
        """Replies are waiting for room: the shell should flush again soon, not sleep."""
        return bool(self._waiting)

    @property
    def waiting(self) -> int:
        """Replies that must arrive and are still waiting for room, all peers."""
        return self._waiting_total

    def flush(self) -> None:
        waiting = self._waiting
        for key in list(waiting):
            self._drain(key, waiting[key])
        held, self._held = self._held, []
        for sock, identity, frames, must_arrive in held:
            line = waiting.get((sock, identity)) if must_arrive else None
            if line is None:  # nothing of this peer's is waiting: this reply may go first
                if try_send(sock, identity, frames):
                    continue
                if not must_arrive:
                    _note_dropped("reply")
                    continue
                line = waiting[(sock, identity)] = collections.deque()
            line.append(frames)  # behind the ones already waiting, in order
            self._waiting_total += 1
            if len(line) > self.retry_limit:
                self._drop_oldest(line)
            elif self._waiting_total > self.total_limit:
                self._drop_oldest(max(waiting.values(), key=len))  # the peer furthest behind

    def _drop_oldest(self, line: collections.deque) -> None:
        line.popleft()  # a line emptied here is removed by the next flush
        self._waiting_total -= 1
        _note_dropped("produce_reply")

    def _drain(self, key: tuple[zmq.Socket, bytes | None], line: collections.deque) -> None:
        sock, identity = key
        while line:
            status = send_status(sock, identity, line[0])
            if status == FULL:
                return  # still no room for this peer: its later replies wait too
            if status == GONE:
                # The peer disconnected: none of its line can arrive. Gone at once, not
                # one failed send each (100,000 of them held a turn for a few hundred ms).
                self._waiting_total -= len(line)
                line.clear()
                break
            line.popleft()
            self._waiting_total -= 1
        del self._waiting[key]


def error_frames(op: str | None, corr_id: Any, err: ZBrokerError) -> list:
    return codec.encode_error(op, corr_id, err)
