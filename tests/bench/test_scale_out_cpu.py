"""bench.zbroker_adapter._per_actor_cpu on samples we write: no broker, no processes."""

from __future__ import annotations

from types import SimpleNamespace

from bench import zbroker_adapter
from bench.procstat import CpuSample
from tests.bench.test_procstat import fake_proc, stat_line


class FakeAdmin:
    def __init__(self, url: str) -> None:
        pass

    def describe_topic(self, topic: str) -> dict:
        return {"partitions": [{"actor_id": "p0", "log_start": 0, "log_end": 500_000},
                               {"actor_id": "p1", "log_start": 0, "log_end": 500_000}]}

    def close(self) -> None:
        pass


def test_an_actor_replaced_during_the_phase_has_no_figure_rather_than_zero(tmp_path, monkeypatch):
    monkeypatch.setattr(zbroker_adapter, "_client_api", lambda: (FakeAdmin, None, None, None))
    before = CpuSample.take([11, 12], proc_root=fake_proc(tmp_path / "b", {
        11: stat_line(11, "partition-0", 100, 0, start=5), 12: stat_line(12, "partition-1", 100, 0, start=5)}))
    # partition-1 was restarted: its old pid is gone, the new one was not in the sampled list.
    after = CpuSample.take([11, 12], proc_root=fake_proc(tmp_path / "a", {
        11: stat_line(11, "partition-0", 150, 0, start=5)}))
    out = zbroker_adapter._per_actor_cpu(SimpleNamespace(url="tcp://x"), "t", 1_000_000,
                                         {"partition-0": 11, "partition-1": 12}, before, after)
    assert out["partition-0"]["cpu_s_per_million_records"] > 0
    assert out["partition-1"]["cpu_s"] is None
    assert out["partition-1"]["cpu_s_per_million_records"] is None
