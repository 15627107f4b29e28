"""The benchmark's zbroker adapter against real brokers, at a tiny scale.

The harness tests use in-memory adapters; this one runs `bench.zbroker_adapter`
itself (its brokers, client processes and CPU accounting), so a change to the
client or the supervisor that breaks `make bench` fails here. Figures are not
checked, only that every phase ran, counted what it was asked to and measured
a time and a CPU figure for it.
"""

from __future__ import annotations

import pytest

from bench import harness
from bench.zbroker_adapter import ZBroker

pytestmark = pytest.mark.processes


class TwoRoundZBroker(ZBroker):
    """Two scale-out rounds rather than the benchmark's five: each round starts three
    broker trees (1, 2 and 4 actors), and two already show every round and row timed."""
    scale_out_rounds = 2


def _run(workloads: tuple[str, ...], scale: float) -> dict:
    config = harness.Config(scale=scale, workloads=workloads, ceiling=False, progress=False, phase_timeout_s=60.0)
    return harness.Harness(config, {"zbroker": TwoRoundZBroker}).run()["systems"]["zbroker"]


def test_produce_consume_and_latency_phases_run_on_a_real_broker():
    result = _run(("produce", "consume", "latency"), scale=0.005)  # 1,000 records; latency 1 s
    assert result["status"] == "ok", result
    phases = result["phases"]
    for name in ("produce", "consume_ack"):
        phase = phases[name]
        assert phase["status"] == "ok", phase
        assert phase["records"] == phase["target"] == 1000
        assert phase["seconds"] > 0 and phase["server_cpu_s"] > 0
    for name in ("latency", "latency_linger_0"):
        latency = phases[name]
        assert latency["status"] == "ok", latency
        assert latency["received"] == latency["publisher"]["sent"] == 5000
        assert 0 < latency["latency_ms"]["p50"] <= latency["latency_ms"]["p99"] <= latency["latency_ms"]["max"]


def test_scale_out_times_the_work_of_every_round_and_row():
    result = _run(("scale_out",), scale=0.01)  # 2,000 records over 4 partitions
    scale_out = result["phases"]["scale_out"]
    assert scale_out["status"] == "ok", scale_out
    assert set(scale_out["actors"]) == {"1", "2", "4"}
    for actors, row in scale_out["actors"].items():
        for role in ("produce", "consume_ack"):
            summary = row[role]
            assert len(summary["runs"]) == TwoRoundZBroker.scale_out_rounds
            for run in summary["runs"]:
                assert run["status"] == "ok", (actors, role, run)
                assert run["records"] == 2000
                # The clock covers the work, not the clients' start-up or exit.
                assert 0 < run["seconds"] < 10
                stored = sum(a["records"] for a in run["per_actor"].values())
                assert stored == 2000 and len(run["per_actor"]) == int(actors)
            assert summary["msgs_s"] > 0


def test_a_client_that_exits_before_it_is_ready_fails_the_round_at_once():
    import multiprocessing
    import sys
    import time

    from bench.zbroker_adapter import _wait_until_ready

    mp = multiprocessing.get_context("spawn")
    reader, writer = mp.Pipe(duplex=False)
    child = mp.Process(target=sys.exit, args=(3,), daemon=True)  # never says it is ready
    child.start()
    writer.close()  # the parent's copy: the child's exit then reads as EOF
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exited before it was ready.*exit code 3"):
        _wait_until_ready("produce", {reader: child}, timeout_s=60.0)
    assert time.monotonic() - started < 30  # not the whole 60 s
    child.join(5)
