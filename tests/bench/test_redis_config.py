"""The Redis adapter turns AOF on for the run and puts the old settings back, even when a phase fails."""

from __future__ import annotations

import pytest

from bench import harness
from bench.peers import redis_streams


class FakeRedis:
    """Just enough of redis.Redis for setup/teardown; pipelines fail like a dropped connection."""

    def __init__(self, config: dict[str, str]) -> None:
        self.config = config
        self.set_calls: list[tuple[str, str]] = []
        self.deleted: list[str] = []

    def info(self, section: str = "") -> dict:
        return {"redis_version": "7.0.15"} if section == "server" else {"aof_rewrite_in_progress": 0}

    def config_get(self, name: str) -> dict:
        return {name: self.config[name]} if name in self.config else {}

    def config_set(self, name: str, value: str) -> None:
        self.set_calls.append((name, value))
        self.config[name] = value

    def pipeline(self, transaction: bool = True):
        raise ConnectionError("connection reset by peer")

    def xgroup_create(self, *args, **kwargs) -> None:
        raise ConnectionError("connection reset by peer")

    def delete(self, *keys: str) -> None:
        self.deleted.extend(keys)

    def close(self) -> None:
        pass


@pytest.fixture
def fake_redis(monkeypatch, tmp_path):
    server = FakeRedis({"appendonly": "no", "appendfsync": "always", "dir": str(tmp_path),
                        "appenddirname": "appendonlydir"})
    monkeypatch.setattr(redis_streams, "_client", lambda: server)
    monkeypatch.setattr(redis_streams, "pids_by_name", lambda *names: [])
    return server


def test_config_is_restored_after_failing_phases(fake_redis, tmp_path):
    adapter = redis_streams.RedisStreams()
    config = harness.Config(scale=0.001, workloads=("produce", "produce_fsync_always", "latency"), ceiling=False,
                            progress=False, include_zbroker=False, peers=("redis",))
    results = harness.Harness(config, {"redis": lambda: adapter}).run()
    phases = results["systems"]["redis"]["phases"]
    assert phases["produce"]["status"] == "failed"
    assert phases["produce_fsync_always"]["status"] == "failed"
    # During the run: AOF on, everysec; the fsync-always phase switched and switched back.
    assert ("appendonly", "yes") in fake_redis.set_calls
    assert ("appendfsync", "everysec") in fake_redis.set_calls
    assert fake_redis.set_calls[-2:] == [("appendonly", "no"), ("appendfsync", "always")]
    assert fake_redis.config["appendonly"] == "no" and fake_redis.config["appendfsync"] == "always"
    assert "appendfsync=always, appendonly=no" in results["systems"]["redis"]["durability"]["server_config_before"]


def test_aof_directory_created_by_the_run_is_removed(fake_redis, tmp_path):
    adapter = redis_streams.RedisStreams()
    adapter.check = lambda: None
    adapter.setup()
    (tmp_path / "appendonlydir").mkdir()  # what Redis would create once appendonly is on
    adapter.teardown()
    assert not (tmp_path / "appendonlydir").exists()


def test_aof_directory_that_existed_before_is_kept(fake_redis, tmp_path):
    (tmp_path / "appendonlydir").mkdir()
    adapter = redis_streams.RedisStreams()
    adapter.setup()
    adapter.teardown()
    assert (tmp_path / "appendonlydir").exists()
