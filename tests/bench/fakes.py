"""In-memory stand-ins for the bench's adapters: no servers, no sockets, no child processes."""

from __future__ import annotations

import os
import time

from bench.adapter import Adapter, Phase, ProduceSpec, Skipped
from bench.latency import LatencyRecorder, Pacer, stamp


class MemoryQueue(Adapter):
    """A "system" that is a Python list. `skip`/`fail` name workloads that raise."""

    def __init__(self, name: str = "zbroker", *, skip=(), fail=(), unreachable: str | None = None,
                 fail_setup: bool = False) -> None:
        super().__init__()
        self.name = name
        self.skip, self.fail = set(skip), set(fail)
        self.unreachable = unreachable
        self.fail_setup = fail_setup
        self.queue: list[bytes] = []
        self.calls: list[str] = []

    def check(self) -> None:
        if self.unreachable:
            raise Skipped(self.unreachable)
        self.version = "0.0-test"
        self.durability = {"produce": "kept in a list"}

    def setup(self) -> None:
        self.calls.append("setup")
        if self.fail_setup:
            raise ConnectionError("setup exploded")

    def teardown(self) -> None:
        self.calls.append("teardown")

    def server_pids(self) -> list[int]:
        return [os.getpid()]

    def _maybe_raise(self, workload: str) -> None:
        if workload in self.skip:
            raise Skipped(f"{self.name} cannot {workload}")
        if workload in self.fail:
            raise RuntimeError(f"{workload} broke")

    def produce(self, spec: ProduceSpec, phase: Phase) -> None:
        self.calls.append(spec.workload)
        self._maybe_raise(spec.workload)
        phase.begin()
        for _ in range(spec.count):
            if phase.expired:
                break
            if spec.workload == "produce":
                self.queue.append(bytes(spec.size))
            phase.advance()
        phase.end()

    def prefill(self, count: int, size: int) -> None:
        self.calls.append(f"prefill {count}")
        self.queue.extend(bytes(size) for _ in range(count))

    def consume_ack(self, count: int, phase: Phase) -> None:
        self.calls.append("consume_ack")
        self._maybe_raise("consume_ack")
        phase.begin()
        while self.queue and phase.records < count:
            self.queue.pop()
            phase.advance()
        phase.end()

    def latency(self, rate: float, seconds: float, size: int, phase: Phase, **options) -> dict:
        self.calls.append(" ".join(["latency", *(f"{k}={v}" for k, v in options.items())]))
        self._maybe_raise("latency")
        recorder = LatencyRecorder()
        total = Pacer(rate, seconds, 0.0).total
        phase.begin()
        now = time.time_ns()
        for i in range(total):
            recorder.record(stamp(size, now), now + (200 + i % 100) * 1000)  # 0.2 .. 0.3 ms
            phase.advance()
        phase.end()
        return {**recorder.summary(), "publisher": {"sent": total, "max_lag_ms": 0.0, **options}}
