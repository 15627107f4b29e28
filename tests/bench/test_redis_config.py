"""The Redis adapter turns AOF on for the run and puts the old settings back, even when a phase fails."""

from __future__ import annotations

import os
import signal

import pytest

from bench import harness
from bench.adapter import Skipped
from bench.peers import redis_streams


class FakeRedis:
    """Just enough of redis.Redis for setup/teardown; pipelines fail like a dropped connection."""

    def __init__(self, config: dict[str, str]) -> None:
        self.config = config
        self.set_calls: list[tuple[str, str]] = []
        self.deleted: list[str] = []
        self.keys: dict[str, bytes] = {}

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

    def set(self, key: str, value: str, nx: bool = False, ex: int | None = None) -> bool:
        if nx and key in self.keys:
            return False
        self.keys[key] = value.encode()
        return True

    def get(self, key: str) -> bytes | None:
        return self.keys.get(key)

    def delete(self, *keys: str) -> None:
        self.deleted.extend(keys)
        for key in keys:
            self.keys.pop(key, None)

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


def test_a_second_run_while_the_first_holds_the_settings_is_skipped_and_changes_nothing(fake_redis):
    """Two runs at once: the second would save the first's AOF settings as "the old values"
    and put them back at its end, leaving AOF on for good."""
    first, second = redis_streams.RedisStreams(), redis_streams.RedisStreams()
    first.setup()
    changes = len(fake_redis.set_calls)
    with pytest.raises(Skipped, match="another benchmark run"):
        second.setup()
    assert len(fake_redis.set_calls) == changes, "the second run touched the server's settings"
    first.teardown()
    assert fake_redis.config["appendonly"] == "no" and fake_redis.config["appendfsync"] == "always"
    assert redis_streams.CONFIG_LOCK_KEY not in fake_redis.keys
    second.setup()  # free again
    second.teardown()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT])
def test_signals_that_end_a_run_let_the_teardowns_run(signum):
    """A closed terminal (SIGHUP) or SIGQUIT used to kill the run without its teardowns,
    leaving the shared Redis with AOF on; now each becomes KeyboardInterrupt."""
    import bench.__main__ as entry

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    try:
        entry.install_signal_handlers()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signum)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
