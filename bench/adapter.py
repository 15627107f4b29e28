"""The interface every measured system implements, and the timed phase it reports into.

An adapter knows one system (zbroker, RabbitMQ, NATS JetStream, Redis
Streams) through that system's usual Python client. The harness owns the
order of workloads, progress bars, deadlines and server CPU sampling; the
adapter owns connections, queues/streams/topics and the client loop.

Inside a workload the adapter calls `phase.begin()` right before the first
record goes out and `phase.end()` right after the last acknowledgement, so
queue creation and connection set-up are outside the measured interval (and
outside the CPU sample). `phase.advance(n)` drives the progress bar and the
record count; `phase.expired` tells the adapter to stop at the time bound.

A system that cannot run a workload raises `Skipped(reason)`: the report
prints the reason, it never invents a number.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from bench.procstat import CpuSample, cpu_delta, us_per_record


class Skipped(Exception):
    """This system (or this workload on it) does not run here; str(exc) says why."""


@dataclass(frozen=True)
class ProduceSpec:
    workload: str  # "produce", "produce_1k", "produce_fsync_always", "produce_unbatched"
    count: int
    size: int  # bytes per record
    window: int = 1000  # records sent but not yet acknowledged, at most
    fsync: str = "interval"  # "interval" or "always"
    batched: bool = True  # False: one record per request, still pipelined
    # True: zbroker's bulk call (Producer.send_many, 1,000 values per call). The rows
    # compared with peers call the client once per record, as the peers' rows do.
    bulk: bool = False


class Phase:
    """One measured interval of one workload on one system."""

    def __init__(
        self,
        *,
        system: str,
        workload: str,
        target: int,
        timeout_s: float,
        server_pids: Callable[[], list[int]],
        # Makes a tqdm-like bar (update(n), close()) when the phase begins; None for no bar.
        progress: Callable[[], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.system = system
        self.workload = workload
        self.target = target
        self.timeout_s = timeout_s
        self._server_pids = server_pids
        self._make_progress = progress
        self._progress: Any = None
        self._clock = clock
        self._pending_progress = 0
        self.records = 0
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self.deadline = clock() + timeout_s  # until begin(): bounds set-up too
        self._pids: list[int] = []
        self._cpu_before: CpuSample | None = None
        self._client_cpu_before = 0.0
        self.server_cpu_s: float | None = None
        self.cpu_unmatched = 0
        self.client_cpu_s: float | None = None
        self.extra: dict[str, Any] = {}

    def begin(self) -> None:
        if self.started_at is not None:
            return
        self._pids = list(self._server_pids())
        self._cpu_before = CpuSample.take(self._pids)
        self._client_cpu_before = time.process_time()
        if self._make_progress is not None:
            self._progress = self._make_progress()
        self.started_at = self._clock()
        self.deadline = self.started_at + self.timeout_s

    def advance(self, n: int = 1) -> None:
        self.records += n
        if self._progress is not None:
            self._pending_progress += n
            if self._pending_progress >= 500 or self.records >= self.target:
                self._progress.update(self._pending_progress)
                self._pending_progress = 0

    @property
    def expired(self) -> bool:
        return self._clock() >= self.deadline

    def end(self) -> None:
        if self.ended_at is not None or self.started_at is None:
            return
        self.ended_at = self._clock()
        self.client_cpu_s = time.process_time() - self._client_cpu_before
        if self._cpu_before is not None:
            after = CpuSample.take(self._pids)
            # Then listed again (a psutil scan, after the known processes were read so the
            # scan is not in their figure): a process the server started during the phase
            # (Redis's AOF rewrite child, a restarted actor) counts too; see cpu_delta.
            try:
                started = sorted(set(self._server_pids()) - set(self._pids))
            except Exception:  # the server went away: what was there at the start is all we know
                started = []
            if started:
                after = after.merged(CpuSample.take(started))
            delta = cpu_delta(self._cpu_before, after)
            # No server process read at both ends (none found, or all replaced): no figure,
            # not 0 s, which would read as the cheapest server of the table.
            self.server_cpu_s = delta.seconds if delta.measured else None
            self.cpu_unmatched = delta.unmatched
        if self._progress is not None and self._pending_progress:
            self._progress.update(self._pending_progress)
            self._pending_progress = 0

    def close(self) -> None:
        """Close the progress bar (the harness does this once the workload returns)."""
        if self._progress is not None:
            self._progress.close()

    @property
    def seconds(self) -> float | None:
        if self.started_at is None or self.ended_at is None:
            return None
        return self.ended_at - self.started_at

    def result(self) -> dict[str, Any]:
        """The phase as plain data for the JSON file."""
        seconds = self.seconds
        complete = self.records >= self.target
        return {
            "status": "ok" if complete else "timed_out",
            "target": self.target,
            "records": self.records,
            "seconds": seconds,
            "msgs_s": self.records / seconds if seconds else None,
            "server_pids": self._pids,
            "server_cpu_s": self.server_cpu_s,
            "server_cpu_us_per_record": us_per_record(self.server_cpu_s, self.records),
            "server_cpu_unmatched_pids": self.cpu_unmatched,
            "client_cpu_s": self.client_cpu_s,
            **self.extra,
        }


class Adapter:
    """Base class: the methods every system implements (see module docstring).

    `durability` maps a workload name to the settings that workload ran with,
    for the report's durability table; `version` is the server's, once known.
    """

    name = "system"

    def __init__(self) -> None:
        self.durability: dict[str, str] = {}
        self.version: str | None = None

    def check(self) -> None:
        """Raise Skipped if the system cannot be used here (client missing, server down)."""

    def setup(self) -> None:
        """Connect, create the main queue/stream/topic that `produce` fills and `consume_ack` drains."""

    def teardown(self) -> None:
        """Delete everything setup and the workloads created; restore any server setting changed."""

    def server_pids(self) -> list[int]:
        raise NotImplementedError

    def produce(self, spec: ProduceSpec, phase: Phase) -> None:
        """Send spec.count records; the "produce" workload writes to the main queue."""
        raise NotImplementedError

    def prefill(self, count: int, size: int) -> None:
        """Fill the main queue without measuring (when `consume` runs without `produce`)."""
        raise NotImplementedError

    def consume_ack(self, count: int, phase: Phase) -> None:
        """Receive `count` records from the main queue, acknowledging each."""
        raise NotImplementedError

    def latency(self, rate: float, seconds: float, size: int, phase: Phase) -> dict[str, Any]:
        """Paced publisher in another process, consumer here; returns LatencyRecorder.summary()
        merged with the publisher's report."""
        raise NotImplementedError
