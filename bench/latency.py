"""Publish-to-receive latency: the payload stamp, the pacing schedule, the histogram.

The latency workload runs the publisher in another process (so the consumer's
event loop never delays a send) at a fixed rate. Each payload starts with the
publisher's `time.time_ns()` taken right before the publish call; publisher
and consumer share a host, so their clocks agree. The consumer records
`receive_ns - stamp` in an HDR histogram, in microseconds.

The schedule is explicit: record i is due at `start + i / rate`. A publisher
that falls behind sends the overdue records at once and reports how far
behind it got (`max_lag_ms`), so a slow client is visible in the report
instead of silently lowering the rate.
"""

from __future__ import annotations

import multiprocessing
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable

from hdrh.histogram import HdrHistogram

_STAMP = struct.Struct("<q")
# 1 microsecond to 10 minutes, 3 significant digits.
_LOWEST_US, _HIGHEST_US, _DIGITS = 1, 600_000_000, 3

# Points kept for the CDF chart: every percent, then the tail.
CDF_PERCENTILES = [float(p) for p in range(0, 100)] + [99.5, 99.9, 99.95, 99.99, 100.0]


def stamp(size: int, now_ns: int) -> bytes:
    """A payload of `size` bytes (at least 8) that starts with `now_ns`."""
    return _STAMP.pack(now_ns) + b"\x00" * max(0, size - _STAMP.size)


def read_stamp(payload: bytes) -> int:
    return _STAMP.unpack_from(payload)[0]


class Pacer:
    """Which records are due: pure, the caller passes the (monotonic) time."""

    def __init__(self, rate: float, seconds: float, start: float) -> None:
        self.rate = rate
        self.total = max(1, int(rate * seconds))
        self.start = start
        self.sent = 0
        self.max_lag_s = 0.0

    def due(self, now: float) -> int:
        """How many records to send now (and count them as sent)."""
        scheduled = min(self.total, int((now - self.start) * self.rate) + 1)
        n = max(0, scheduled - self.sent)
        if n:
            # The oldest of the `n` was due at start + sent / rate.
            self.max_lag_s = max(self.max_lag_s, now - (self.start + self.sent / self.rate))
            self.sent += n
        return n

    def next_due_at(self) -> float | None:
        if self.sent >= self.total:
            return None
        return self.start + self.sent / self.rate

    @property
    def done(self) -> bool:
        return self.sent >= self.total


def _ms(micros: float) -> float:
    return micros / 1000.0


class LatencyRecorder:
    def __init__(self) -> None:
        self.histogram = HdrHistogram(_LOWEST_US, _HIGHEST_US, _DIGITS)
        self.received = 0

    def record(self, payload: bytes, received_ns: int) -> None:
        micros = (received_ns - read_stamp(payload)) // 1000
        self.histogram.record_value(min(max(micros, _LOWEST_US), _HIGHEST_US))
        self.received += 1

    def summary(self) -> dict[str, Any]:
        h = self.histogram
        if self.received == 0:
            return {"received": 0}
        return {
            "received": self.received,
            "latency_ms": {
                "p50": _ms(h.get_value_at_percentile(50)),
                "p99": _ms(h.get_value_at_percentile(99)),
                "p99_9": _ms(h.get_value_at_percentile(99.9)),
                "max": _ms(h.get_max_value()),
                "mean": _ms(h.get_mean_value()),
            },
            # (latency ms, fraction of records at or below it), for the CDF chart.
            "cdf": [[_ms(h.get_value_at_percentile(p)), p / 100.0] for p in CDF_PERCENTILES],
            # HdrHistogram's own base64 text: `HdrHistogram.decode(hdr)` restores it.
            "hdr": h.encode().decode("ascii"),
        }


@dataclass
class PublisherProcess:
    """A paced publisher in a child process (spawned, so nothing is inherited).

    `target(args, ready, go, results)` must be a module-level function: it
    connects, sets `ready`, waits for `go`, publishes, then puts a dict with
    at least `sent` and `max_lag_ms` (or `error`) on `results`.
    """

    target: Callable[..., None]
    args: dict[str, Any]

    def __post_init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.ready = ctx.Event()
        self.go = ctx.Event()
        self.results = ctx.Queue()
        self.process = ctx.Process(
            target=self.target,
            args=(self.args, self.ready, self.go, self.results),
            name="bench-latency-publisher",
            daemon=True,
        )

    def start(self, ready_timeout_s: float = 30.0) -> None:
        self.process.start()
        deadline = time.monotonic() + ready_timeout_s
        while not self.ready.wait(0.1):
            if not self.process.is_alive():
                raise RuntimeError(f"latency publisher exited early: {self._result_or_none()}")
            if time.monotonic() > deadline:
                raise RuntimeError("latency publisher not ready in time")
        self.go.set()

    def finish(self, timeout_s: float = 30.0) -> dict[str, Any]:
        result = self._result_or_none(timeout_s)
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        if result is None:
            return {"error": f"publisher gave no result (exit code {self.process.exitcode})"}
        return result

    def _result_or_none(self, timeout_s: float = 0.5) -> dict[str, Any] | None:
        try:
            return self.results.get(timeout=timeout_s)
        except Exception:
            return None


def paced_loop(
    pacer: Pacer, publish_n: Callable[[int], None], *, clock=time.monotonic, sleep=time.sleep,
    service: Callable[[], float | None] | None = None,
) -> None:
    """Drive a synchronous publisher: call `publish_n(k)` whenever k records are due.

    `service()`, if given, runs after every wake-up and returns when it next
    needs to run (a lingering producer's deadline) or None; the loop sleeps
    until that or the next due record, whichever is first.
    """
    while not pacer.done:
        n = pacer.due(clock())
        if n:
            publish_n(n)
        service_at = service() if service is not None else None
        if n:
            continue
        wake_at = [t for t in (pacer.next_due_at(), service_at) if t is not None]
        if wake_at:
            sleep(max(0.0, min(wake_at) - clock()))
