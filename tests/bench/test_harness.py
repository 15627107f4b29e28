"""bench.harness with in-memory adapters: order, statuses, teardown, commits, CLI parsing."""

from __future__ import annotations

import sys

import pytest

from bench import harness
from bench.__main__ import parse_args
from tests.bench.fakes import MemoryQueue


def run(adapters: dict, **config) -> dict:
    config.setdefault("scale", 0.001)  # 200 records
    config.setdefault("ceiling", False)
    config.setdefault("progress", False)
    config.setdefault("workloads", tuple(w for w in harness.WORKLOADS if w not in ("commits", "coordinator_failover")))
    cfg = harness.Config(**config)
    return harness.Harness(cfg, {name: (lambda a=a: a) for name, a in adapters.items()}).run()


def test_every_workload_runs_in_order_and_consume_reads_what_produce_wrote():
    zb = MemoryQueue("zbroker", skip={"scale_out", "redelivery"})
    results = run({"zbroker": zb})
    assert zb.calls == ["setup", "produce", "consume_ack", "produce_1k", "produce_fsync_always",
                        "produce_unbatched", "latency", "latency", "produce_send_many",
                        "latency linger_ms=0.0", "teardown"]
    phases = results["systems"]["zbroker"]["phases"]
    assert phases["latency_linger_0"]["status"] == "ok" and phases["latency_linger_0"]["publisher"]["linger_ms"] == 0.0
    assert phases["produce"]["records"] == phases["consume_ack"]["records"] == 200
    assert all(phases[w]["status"] == "ok" for w in ("produce", "consume_ack", "produce_1k", "latency"))
    assert phases["latency"]["latency_ms"]["p50"] == pytest.approx(0.25, abs=0.06)
    assert phases["latency"]["received"] == 5000  # 5,000/s for at least 1 s
    # The same schedule again at the high rate, for every system.
    assert phases["latency_50k"]["rate"] == 50_000 and phases["latency_50k"]["received"] == 50_000
    assert results["systems"]["zbroker"]["durability"] == {"produce": "kept in a list"}


def test_consume_without_produce_prefills_first():
    zb = MemoryQueue("zbroker")
    results = run({"zbroker": zb}, workloads=("consume",))
    assert zb.calls == ["setup", "prefill 200", "consume_ack", "teardown"]
    assert results["systems"]["zbroker"]["phases"]["consume_ack"]["records"] == 200


def test_unreachable_system_is_skipped_with_its_reason_and_never_set_up():
    peer = MemoryQueue("redis", unreachable="Redis not reachable at 127.0.0.1:6379")
    results = run({"redis": peer})
    assert results["systems"]["redis"] == {"status": "skipped", "reason": "Redis not reachable at 127.0.0.1:6379"}
    assert peer.calls == []


def test_skipped_and_failed_workloads_are_recorded_and_the_rest_still_runs():
    peer = MemoryQueue("nats", skip={"produce_fsync_always"}, fail={"produce_1k"})
    results = run({"nats": peer})
    phases = results["systems"]["nats"]["phases"]
    assert phases["produce_fsync_always"] == {"status": "skipped", "reason": "nats cannot produce_fsync_always"}
    assert phases["produce_1k"]["status"] == "failed"
    assert phases["produce_1k"]["reason"] == "RuntimeError: produce_1k broke"
    assert phases["latency"]["status"] == "ok"
    assert peer.calls[-1] == "teardown"


def test_teardown_runs_even_when_setup_fails():
    peer = MemoryQueue("rabbitmq", fail_setup=True)
    results = run({"rabbitmq": peer})
    assert results["systems"]["rabbitmq"]["status"] == "failed"
    assert "setup exploded" in results["systems"]["rabbitmq"]["reason"]
    assert peer.calls == ["setup", "teardown"]


def test_zbroker_only_workloads_do_not_run_on_peers():
    peer = MemoryQueue("redis")
    results = run({"redis": peer})
    assert "scale_out" not in results["systems"]["redis"]["phases"]
    assert "redelivery" not in results["systems"]["redis"]["phases"]


def test_a_phase_past_its_time_bound_is_timed_out_with_the_rate_it_measured():
    zb = MemoryQueue("zbroker")
    results = run({"zbroker": zb}, workloads=("produce",), phase_timeout_s=0.0)
    produce = results["systems"]["zbroker"]["phases"]["produce"]
    assert produce["status"] == "timed_out"
    assert produce["records"] < produce["target"]
    assert "time bound" in produce["reason"]


def test_expand_workloads():
    assert harness.expand_workloads(["produce"]) == harness.PRODUCE_VARIANTS
    assert harness.expand_workloads(["latency", "consume_ack", "scale-out"]) == ("consume", "latency", "scale_out")
    with pytest.raises(ValueError, match="unknown workload"):
        harness.expand_workloads(["nonsense"])


def test_counts_scale_records_and_the_latency_duration_not_its_rate():
    full, small = harness.Counts.for_scale(1.0), harness.Counts.for_scale(0.02)
    assert (full.records, full.leases, full.latency_rate, full.latency_seconds) == (200_000, 10_000, 5_000, 5.0)
    assert (small.records, small.leases, small.latency_rate, small.latency_seconds) == (4_000, 200, 5_000, 1.0)


def test_commits_missing_module_is_skipped():
    result = harness.run_commits(0.1, 5.0, name="bench.no_such_module_here")
    assert result["status"] == "skipped"


def test_commits_run_function_is_called_with_scale(tmp_path, monkeypatch):
    (tmp_path / "fake_commits_ok.py").write_text("def run(scale):\n    return {'advances_per_flush': 10 * scale}\n")
    (tmp_path / "fake_commits_skip.py").write_text(
        "from bench.adapter import Skipped\ndef run():\n    raise Skipped('needs PostgreSQL')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ok = harness.run_commits(0.5, 5.0, name="fake_commits_ok")
    assert ok["status"] == "ok" and ok["result"] == {"advances_per_flush": 5.0}
    assert harness.run_commits(1.0, 5.0, name="fake_commits_skip") == {"status": "skipped",
                                                                        "reason": "needs PostgreSQL"}
    for name in ("fake_commits_ok", "fake_commits_skip"):
        sys.modules.pop(name, None)


def test_cli_arguments():
    args = parse_args(["--scale", "0.05", "--only", "produce,latency", "--no-peers"])
    assert args.scale == 0.05 and args.peer_list == ()
    assert args.workloads == (*harness.PRODUCE_VARIANTS, "latency")
    assert parse_args(["--peers", "redis"]).peer_list == ("redis",)
    for bad in (["--peers", "kafka"], ["--only", "everything"], ["--scale", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_a_phase_that_ends_short_before_its_time_bound_is_not_called_timed_out():
    """A peer that refused part of the records (RabbitMQ nacks, NATS publishes without a
    PubAck) ends its phase early with fewer acknowledged: that is no time bound reached."""

    class Refusing(MemoryQueue):
        def produce(self, spec, phase):
            phase.begin()
            phase.advance(spec.count // 2)  # the other half nacked
            phase.end()

    results = run({"rabbitmq": Refusing("rabbitmq")}, workloads=("produce",), phase_timeout_s=300.0)
    produce = results["systems"]["rabbitmq"]["phases"]["produce"]
    assert produce["records"] == 100
    assert "time bound" not in produce.get("reason", ""), produce
    assert produce["status"] == "failed" and "100 of the 200" in produce["reason"], produce
