"""Live fuzzing against real actor processes: pipelined senders, memory and liveness probes.

Theory of operation
-------------------
`FuzzPump` owns a few DEALER sockets (some with forged routing ids) connected
to one actor socket and pushes mutated messages through them in bursts,
round-robin over the sockets. It never waits for a particular reply: after
each burst it drains whatever replies arrived without blocking, checks that
each one is a well-formed reply (`protocol.codec.decode_reply` accepts it) and
counts them by error code. A full send queue (the actor is busy) is waited
out with a short poll: that is ZeroMQ's backpressure, not a failure.

`ActorWatch` samples VmRSS of each watched actor from /proc and checks that
its pid is still alive and unchanged. `ValidClient` runs real traffic on its
own connection in a thread while the fuzz runs, and records how long each
round took and any error, so a test can assert that honest clients kept being
served during the fuzz, not only after it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from pathlib import Path
from typing import Any, Callable

import msgpack
import zmq

from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.errors import ProtocolError
from tests.fuzz.frames import FrameMutator

MIB = 1 << 20
PROBE_IDS = (1 << 62) + 12345  # correlation ids of the pump's own hello probes


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def alive(pid: int) -> bool:
    """Present in /proc and not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def open_fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def actor_endpoint(url: str) -> str:
    """Where the broker's own actors reach the coordinator: its internal endpoint when it has one."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    try:
        sock.send_multipart(codec.encode_request(m.Hello(versions=[1]), 1))
        if not sock.poll(10_000):
            raise TimeoutError(f"no hello reply from {url}")
        reply = codec.decode_reply(sock.recv_multipart()).msg
        return getattr(reply, "internal_endpoint", None) or url
    finally:
        sock.close(linger=0)
        ctx.term()


class ActorWatch:
    """RSS samples and liveness of named actor pids."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = dict(pids)
        self.samples: dict[str, list[int]] = {name: [] for name in pids}
        self.baseline: dict[str, int] = {}

    def sample(self) -> None:
        for name, pid in self.pids.items():
            assert alive(pid), f"actor {name} (pid {pid}) died during the fuzz"
            self.samples[name].append(rss_bytes(pid))

    def set_baseline(self) -> None:
        self.sample()
        self.baseline = {name: s[-1] for name, s in self.samples.items()}

    def peak_growth(self, name: str) -> int:
        return max(self.samples[name]) - self.baseline[name]

    def summary(self) -> dict[str, dict[str, float]]:
        return {name: {"baseline_mib": round(self.baseline.get(name, s[0]) / MIB, 1),
                       "peak_mib": round(max(s) / MIB, 1), "last_mib": round(s[-1] / MIB, 1)}
                for name, s in self.samples.items()}


@dataclasses.dataclass
class PumpStats:
    sent: int = 0
    replies: int = 0
    malformed_replies: list = dataclasses.field(default_factory=list)
    codes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    requests_received: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    stalls: int = 0
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.sent / self.seconds if self.seconds else 0.0


def describe_malformed(frames: list[bytes], exc: ProtocolError) -> dict:
    """What an actor sent that its peer cannot decode, without the protocol's size limit."""
    summary: dict[str, Any] = {"error": repr(exc), "bytes": [len(f) for f in frames]}
    try:
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    except Exception:  # not even msgpack: the first bytes will do
        summary["head"] = frames[0][:100] if frames else b""
        return summary
    if isinstance(header, dict):
        error = header.get("error") if isinstance(header.get("error"), dict) else {}
        summary.update(op=str(header.get("op"))[:80], code=error.get("code"),
                       message=str(error.get("message"))[:200],
                       data={k: str(v)[:80] for k, v in (error.get("data") or {}).items()},
                       field_bytes={k: len(msgpack.packb(v)) for k, v in header.items()},
                       sample=str(header)[:300])
    return summary


class FuzzPump:
    """Bursts of fuzz messages out over several lanes, replies in without blocking.

    A lane is a socket plus the frames that address a message on it: nothing for
    a DEALER, ``[peer identity]`` for a ROUTER playing an actor's peer (the
    commit writer's coordinator). Replies are checked and counted; `on_reply`
    sees every decoded envelope (a test uses it to follow its own requests).
    """

    STALL_LIMIT_S = 30.0

    def __init__(self, ctx: zmq.Context, lanes: list[tuple[zmq.Socket, list[bytes]]],
                 on_reply: Callable[[codec.Envelope], None] | None = None) -> None:
        self.lanes = lanes
        self.on_reply = on_reply
        self.poller = zmq.Poller()
        for sock in {id(s): s for s, _ in lanes}.values():
            self.poller.register(sock, zmq.POLLIN)
        self.routers = {s for s, prefix in lanes if prefix}
        self.stats = PumpStats()
        self._started = time.monotonic()
        self._probe_ids = itertools.count(PROBE_IDS)
        self._probe_lane: dict[int, int] = {}
        self._probes_out: list[set[int]] = [set() for _ in lanes]

    @classmethod
    def dealers(cls, ctx: zmq.Context, peers: list[tuple[str, bytes | None]], **kw: Any) -> "FuzzPump":
        """One DEALER lane per (endpoint, routing id or None)."""
        lanes = []
        for endpoint, identity in peers:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)  # we read as we go; never lose a reply on our side
            if identity is not None:
                sock.setsockopt(zmq.IDENTITY, identity)
            sock.connect(endpoint)
            lanes.append((sock, []))
        return cls(ctx, lanes, **kw)

    def close(self) -> None:
        for sock in {id(s): s for s, _ in self.lanes}.values():
            if not sock.closed:
                sock.close(linger=0)

    def run(self, mutator: FrameMutator, frames: int, *, burst: int = 128, window: int = 3,
            periodic: Callable[[int], None] | None = None, period_s: float = 0.25) -> PumpStats:
        """Send `frames` messages; call `periodic(sent)` every `period_s` (samples, refreshes).

        After each burst a lane sends a *probe* (a valid ``hello``, answered at once and in
        order), and at most `window` probes may be unanswered per lane. So the actor is
        kept busy, but its input queues never hold more than about `window * burst`
        messages per connection: memory growth measured then is the actor's own.
        """
        stats = self.stats
        started = self._started = time.monotonic()
        next_tick = started
        i = 0
        while stats.sent < frames:
            lane = i % len(self.lanes)
            sock, prefix = self.lanes[lane]
            i += 1
            for _ in range(min(burst, frames - stats.sent)):
                self.send(sock, prefix + mutator.next())
            self._probe(lane)
            deadline = time.monotonic() + self.STALL_LIMIT_S
            while len(self._probes_out[lane]) > window:
                assert time.monotonic() < deadline, f"lane {lane}: no probe answered for 30 s"
                self.drain(10)
            self.drain()
            now = time.monotonic()
            if periodic is not None and now >= next_tick:
                periodic(stats.sent)
                next_tick = time.monotonic() + period_s
        stats.seconds = time.monotonic() - started
        return stats

    def _probe(self, lane: int) -> None:
        corr = next(self._probe_ids)
        self._probe_lane[corr] = lane
        self._probes_out[lane].add(corr)
        sock, prefix = self.lanes[lane]
        self.send(sock, prefix + codec.encode_request(m.Hello(versions=[1], client="probe"), corr), count=False)

    def send(self, sock: zmq.Socket, frames: list[bytes], *, count: bool = True) -> None:
        """Send, waiting out a full queue (backpressure) while reading replies."""
        deadline = time.monotonic() + self.STALL_LIMIT_S
        while True:
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=len(frames[-1]) < 65536)
                self.stats.sent += count
                return
            except zmq.Again:
                self.stats.stalls += 1
                assert time.monotonic() < deadline, "the actor stopped reading for 30 s"
                self.drain()
                sock.poll(50, zmq.POLLOUT)

    def drain(self, timeout_ms: int = 0) -> int:
        """Read what arrived; returns how many replies (not requests sent to a forged identity)."""
        replies = 0
        for sock, _ in self.poller.poll(timeout_ms):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                replies += self._count(frames[1:] if sock in self.routers else frames)
        return replies

    def settle(self, quiet_ms: int = 500, limit_s: float = 20.0) -> PumpStats:
        """Read replies until none arrived for `quiet_ms`: the actor worked through its backlog.

        `stats.seconds` then runs from the first send to the last reply, so `stats.rate`
        is what the actor processed, not what the socket buffers absorbed.
        """
        deadline = time.monotonic() + limit_s
        last = time.monotonic()
        while time.monotonic() < deadline:
            if self.drain(quiet_ms):
                last = time.monotonic()
            elif time.monotonic() - last >= quiet_ms / 1000:
                break
        self.stats.seconds = last - self._started
        return self.stats

    def _count(self, frames: list[bytes]) -> int:
        try:
            is_reply, env = codec.decode_any(frames)
        except ProtocolError as exc:
            self.stats.replies += 1
            if len(self.stats.malformed_replies) < 20:
                self.stats.malformed_replies.append(describe_malformed(frames, exc))
            return 1
        if not is_reply:  # a forged internal identity is sent the actor's own requests and tells
            self.stats.requests_received[env.op] += 1
            return 0
        lane = self._probe_lane.pop(env.corr_id, None) if env.op == "hello" else None
        if lane is not None:
            self._probes_out[lane].discard(env.corr_id)
            return 1
        self.stats.replies += 1
        if env.error is not None:
            self.stats.codes[env.error.code.value] += 1
        else:
            self.stats.codes["ok"] += 1
        if self.on_reply is not None:
            self.on_reply(env)
        return 1


class ValidClient(threading.Thread):
    """Runs `round_fn()` repeatedly on its own connection until stopped; records latency and errors."""

    def __init__(self, name: str, round_fn: Callable[[], None], *, pause_s: float = 0.02) -> None:
        super().__init__(name=name, daemon=True)
        self.round_fn = round_fn
        self.pause_s = pause_s
        self.stop_event = threading.Event()
        self.rounds = 0
        self.latencies: list[float] = []
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stop_event.is_set():
            started = time.monotonic()
            try:
                self.round_fn()
            except Exception as exc:  # recorded and asserted on by the test
                self.errors.append(f"{type(exc).__name__}: {exc}")
                if len(self.errors) > 20:
                    return
            else:
                self.rounds += 1
                self.latencies.append(time.monotonic() - started)
            self.stop_event.wait(self.pause_s)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(30)
        assert not self.is_alive(), f"{self.name} did not stop"

    def summary(self) -> dict:
        lat = sorted(self.latencies) or [0.0]
        return {"rounds": self.rounds, "errors": len(self.errors), "p50_s": round(lat[len(lat) // 2], 3),
                "max_s": round(lat[-1], 3)}


def supervisor_log_deaths(log_file: Path) -> list[str]:
    if not log_file.exists():
        return []
    return [line for line in log_file.read_text(errors="replace").splitlines() if "actor.died" in line]
