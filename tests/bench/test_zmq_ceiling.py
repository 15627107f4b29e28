"""bench.zmq_ceiling's latency floor, run for real at a small rate: every record
arrives, its latency is measured, and the relay is the phase's server."""

from __future__ import annotations

import os

import pytest

from bench.adapter import Phase
from bench.zmq_ceiling import run_latency_ceiling


@pytest.mark.processes  # the relay runs in a multiprocessing child
def test_the_latency_ceiling_delivers_every_record_through_the_relay():
    relay_pids: list[int] = []
    phase = Phase(system="zmq_ceiling", workload="latency", target=400, timeout_s=60,
                  server_pids=lambda: list(relay_pids))
    out = run_latency_ceiling(2000, 0.2, 100, phase, relay_pids)
    result = phase.result()
    assert out["publisher"]["sent"] == 400 and out["received"] == 400
    assert result["records"] == 400 and result["status"] == "ok"
    assert 0 < out["latency_ms"]["p50"] <= out["latency_ms"]["p99"] <= out["latency_ms"]["max"]
    assert relay_pids and relay_pids[0] != os.getpid()
    assert result["server_cpu_us_per_record"] is not None  # measured on the relay, not on this process
