"""Redis Streams through redis-py: XADD in pipelines of 1,000, XREADGROUP + XACK, AOF on.

Redis keeps nothing on disk unless told to, so for the run the adapter turns
the append-only file on (`appendonly yes`, `appendfsync everysec`; the
`produce_fsync_always` phase switches to `appendfsync always`) and puts back
the values it found in `teardown`, which the harness calls in a `finally`.
If the AOF directory did not exist before, the adapter removes the one Redis
created, so the server is left as it was found.

XADD takes one entry per command, so a pipeline of 1,000 XADDs is the
1,000-record window. XACK names every id it acknowledges: one XACK per
fetched batch acknowledges each record individually, batched on the wire.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from typing import Any

from bench.adapter import Adapter, Phase, ProduceSpec, Skipped
from bench.latency import LatencyRecorder, Pacer, PublisherProcess, paced_loop, stamp
from bench.procstat import pids_by_name

HOST, PORT = "127.0.0.1", 6379
READ_COUNT = 1000
# Held while a run has the server's AOF settings changed (see setup); it expires on its own
# should a run die without its teardown (SIGKILL).
CONFIG_LOCK_KEY = "zbench:config-lock"
CONFIG_LOCK_TTL_S = 2 * 3600
GROUP = "bench"


def _client():
    import redis

    return redis.Redis(host=HOST, port=PORT, socket_connect_timeout=3, socket_timeout=60)


def _wait_aof_idle(client, timeout_s: float = 60.0) -> None:
    """After `appendonly yes` Redis rewrites the AOF in the background; measure after it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = client.info("persistence")
        if not info.get("aof_rewrite_in_progress") and not info.get("aof_rewrite_scheduled"):
            return
        time.sleep(0.05)
    raise RuntimeError("Redis AOF rewrite still running after enabling appendonly")


def _xadd_window(client, key: str, count: int, payload: bytes, window: int, phase: Phase) -> None:
    phase.begin()
    sent = 0
    while sent < count and not phase.expired:
        n = min(window, count - sent)
        pipe = client.pipeline(transaction=False)
        for _ in range(n):
            pipe.xadd(key, {"v": payload})
        pipe.execute()
        sent += n
        phase.advance(n)
    phase.end()


class RedisStreams(Adapter):
    name = "redis"

    def __init__(self) -> None:
        super().__init__()
        self.run_id = uuid.uuid4().hex[:8]
        self.main_key = f"zbench:{self.run_id}:main"
        self._keys: set[str] = set()
        self._saved_config: dict[str, str] | None = None
        self._holds_lock = False
        self._aof_path: str | None = None
        self._aof_existed = True
        self.client = None

    def check(self) -> None:
        try:
            import redis  # noqa: F401
        except ImportError as exc:
            raise Skipped(f"redis-py not installed ({exc})") from exc
        try:
            client = _client()
            self.version = client.info("server")["redis_version"]
            client.close()
        except Exception as exc:
            raise Skipped(f"Redis not reachable at {HOST}:{PORT} ({type(exc).__name__}: {exc})")
        if tuple(int(x) for x in self.version.split(".")[:1]) < (5,):
            raise Skipped(f"Redis {self.version} has no streams (needs 5.0+)")
        self.durability = {
            "produce": "AOF appendfsync everysec (set for the run, restored after); XADD pipelines of 1,000",
            "produce_1k": "AOF appendfsync everysec; XADD pipelines of 1,000",
            "produce_fsync_always": "AOF appendfsync always (this phase only); XADD pipelines of 1,000",
            "consume_ack": f"XREADGROUP COUNT {READ_COUNT}, one XACK naming every id of the batch",
            "latency": "paced XADD (one pipeline per tick); XREADGROUP BLOCK, XACK per batch",
        }

    def setup(self) -> None:
        self.client = _client()
        # One run at a time changes the server's AOF settings: a second run would save the
        # first one's changes as "the old values" and restore them, leaving AOF on for good.
        if not self.client.set(CONFIG_LOCK_KEY, self.run_id, nx=True, ex=CONFIG_LOCK_TTL_S):
            holder = (self.client.get(CONFIG_LOCK_KEY) or b"").decode()
            self.client.close()
            self.client = None
            raise Skipped(f"another benchmark run ({holder!r}) has Redis's AOF settings changed; "
                          f"it puts them back when it ends (the lock {CONFIG_LOCK_KEY} expires after "
                          f"{CONFIG_LOCK_TTL_S // 60} min)")
        self._holds_lock = True
        saved = {}
        for name in ("appendonly", "appendfsync"):
            saved.update(self.client.config_get(name))
        self._saved_config = saved
        aof_dir = self.client.config_get("dir").get("dir")
        aof_name = self.client.config_get("appenddirname").get("appenddirname")  # Redis 7+
        if aof_dir and aof_name:
            self._aof_path = os.path.join(aof_dir, aof_name)
            self._aof_existed = os.path.exists(self._aof_path)
        self.client.config_set("appendfsync", "everysec")
        self.client.config_set("appendonly", "yes")
        _wait_aof_idle(self.client)
        self.durability["server_config_before"] = ", ".join(f"{k}={v}" for k, v in sorted(saved.items()))

    def teardown(self) -> None:
        client = self.client or _client()
        try:
            if self._keys:
                client.delete(*self._keys)
                self._keys.clear()
        finally:
            if self._saved_config is not None:
                # appendonly first: switching it off stops the AOF before fsync policy changes.
                client.config_set("appendonly", self._saved_config.get("appendonly", "no"))
                client.config_set("appendfsync", self._saved_config.get("appendfsync", "everysec"))
                self._saved_config = None
                if (self._aof_path and not self._aof_existed and os.path.isdir(self._aof_path)
                        and client.config_get("appendonly").get("appendonly") == "no"):
                    shutil.rmtree(self._aof_path, ignore_errors=True)
            if self._holds_lock and (client.get(CONFIG_LOCK_KEY) or b"").decode() == self.run_id:
                client.delete(CONFIG_LOCK_KEY)
            self._holds_lock = False
            client.close()
            self.client = None

    def server_pids(self) -> list[int]:
        return pids_by_name("redis-server")

    def _key(self, name: str) -> str:
        key = f"zbench:{self.run_id}:{name}"
        self._keys.add(key)
        return key

    def produce(self, spec: ProduceSpec, phase: Phase) -> None:
        if not spec.batched:
            raise Skipped("XADD takes one entry per command: the produce row is already one record per request")
        key = self._key("main" if spec.workload == "produce" else spec.workload)
        previous_fsync = None
        if spec.fsync == "always":
            previous_fsync = self.client.config_get("appendfsync")["appendfsync"]
            self.client.config_set("appendfsync", "always")
        try:
            _xadd_window(self.client, key, spec.count, os.urandom(spec.size), spec.window, phase)
        finally:
            if previous_fsync is not None:
                self.client.config_set("appendfsync", previous_fsync)
            if key != self.main_key:
                self.client.delete(key)
                self._keys.discard(key)

    def prefill(self, count: int, size: int) -> None:
        phase = Phase(system=self.name, workload="prefill", target=count, timeout_s=600, server_pids=list)
        _xadd_window(self.client, self._key("main"), count, os.urandom(size), 1000, phase)

    def consume_ack(self, count: int, phase: Phase) -> None:
        self.client.xgroup_create(self.main_key, GROUP, id="0", mkstream=True)
        phase.begin()
        while phase.records < count and not phase.expired:
            reply = self.client.xreadgroup(GROUP, "c1", {self.main_key: ">"}, count=READ_COUNT, block=1000)
            if not reply:
                continue
            ids = [entry_id for entry_id, _fields in reply[0][1]]
            self.client.xack(self.main_key, GROUP, *ids)
            phase.advance(len(ids))
        phase.end()

    def latency(self, rate: float, seconds: float, size: int, phase: Phase) -> dict[str, Any]:
        key = self._key("latency")
        self.client.xgroup_create(key, GROUP, id="0", mkstream=True)
        recorder = LatencyRecorder()
        publisher = PublisherProcess(paced_publisher, {"key": key, "rate": rate, "seconds": seconds, "size": size})
        expected = Pacer(rate, seconds, 0.0).total
        phase.begin()  # before the publisher, as for every system
        publisher.start()
        while phase.records < expected and not phase.expired:
            reply = self.client.xreadgroup(GROUP, "c1", {key: ">"}, count=READ_COUNT, block=100)
            if not reply:
                continue
            now = time.time_ns()
            entries = reply[0][1]
            for _entry_id, fields in entries:
                recorder.record(fields[b"v"], now)
            self.client.xack(key, GROUP, *[entry_id for entry_id, _ in entries])
            phase.advance(len(entries))
        phase.end()
        self.client.delete(key)
        self._keys.discard(key)
        return {**recorder.summary(), "publisher": publisher.finish()}


def paced_publisher(args: dict, ready, go, results) -> None:
    """Child process: XADD stamped entries at `rate` per second for `seconds`."""
    try:
        client = _client()
        client.ping()
        ready.set()
        go.wait()
        pacer = Pacer(args["rate"], args["seconds"], time.monotonic())

        def publish(n: int) -> None:
            pipe = client.pipeline(transaction=False)
            for _ in range(n):
                pipe.xadd(args["key"], {"v": stamp(args["size"], time.time_ns())})
            pipe.execute()

        paced_loop(pacer, publish)
        results.put({"sent": pacer.sent, "max_lag_ms": pacer.max_lag_s * 1000})
        client.close()
    except Exception as exc:
        results.put({"error": f"{type(exc).__name__}: {exc}"})
