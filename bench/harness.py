"""The benchmark run: which workloads, on which systems, in what order.

Theory of operation. Systems run one after another, never at the same time,
each through its adapter (bench/adapter.py): check (reachable? client
installed?), setup, the selected workloads, teardown in a `finally` (queues,
streams and keys deleted; Redis's configuration restored). Per system the
order is:

    produce            100 B, window 1,000, fsync on interval -> fills the main queue
    consume            drains those same records, one ack per record
    produce_1k         1 KiB records              (own queue, deleted after)
    produce_fsync_always                          (own queue, deleted after)
    produce_unbatched  one record per request     (own queue, deleted after)
    latency            paced publisher in another process -> consumer here

then, for zbroker only, scale_out and redelivery; then the raw-ZeroMQ
ceiling for the payload shapes the selected workloads used (and, with latency,
the same paced schedule through a bare relay process); then
bench.commit_absorption if it exists.

Every measured interval is a `Phase`: it carries the progress bar, the time
bound, the wall clock and the server CPU sample. A workload that cannot run
on a system is "skipped" with the adapter's reason; one that raised is
"failed" with the error. Nothing is ever filled in by hand.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import json
import logging
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from bench.adapter import Adapter, Phase, ProduceSpec, Skipped

log = logging.getLogger("bench")

BASE_RECORDS = 200_000
BASE_LEASES = 10_000
LATENCY_RATE = 5_000
# The latency workload runs again at this rate for every system (and the bare relay): at
# 5,000/s nothing is busy, at 50,000/s the per-record cost of each path shows in its tail.
LATENCY_HIGH_RATE = 50_000
LATENCY_HIGH = "latency_50k"
LATENCY_SECONDS = 5.0
WINDOW = 1_000
LATENCY_GRACE_S = 30.0
# zbroker's latency workload again with a publisher that sends each record at once.
LATENCY_NO_LINGER = "latency_linger_0"
PRODUCE_BULK = "produce_send_many"  # zbroker only: the same produce through the bulk call

PRODUCE_VARIANTS = ("produce", "produce_1k", "produce_fsync_always", "produce_unbatched")
WORKLOADS = (*PRODUCE_VARIANTS, "consume", "latency", "capacity", "scale_out", "partitions", "redelivery",
             "key_shared", "commits", "memory", "coordinator_failover", "console_overhead", "replication")
# Workloads that are modules of their own (run_commits), with no adapter and no peers.
STANDALONE = {"commits": "bench.commit_absorption", "memory": "bench.memory",
              "coordinator_failover": "bench.coordinator_failover",
              "console_overhead": "bench.console_overhead", "replication": "bench.replication"}
ZBROKER_ONLY = ("capacity", "scale_out", "partitions", "redelivery", "key_shared")
# Records of the key_shared-against-shared rows at scale 1 (bench.key_shared): each of
# the 2 x 2 rounds consumes them all with 8 consumer processes.
BASE_KEY_SHARED_RECORDS = 50_000
# The broker-capacity rows send this many times the Python rows' records (bench.zbroker_adapter).
CAPACITY_RECORDS_FACTOR = 5
# Records per row of the partition-count table (100,000 at scale 1, as issue #29 measured).
BASE_PARTITION_RECORDS = 100_000
# Which raw-ZeroMQ shape bounds each workload: (mode, record size).
CEILING_FOR = {
    "produce": ("batched", 100),
    "produce_1k": ("batched", 1024),
    "produce_fsync_always": ("batched", 100),
    "produce_unbatched": ("unbatched", 100),
    "consume": ("batched", 100),
}
SYSTEMS = ("zbroker", "rabbitmq", "nats", "redis")


def expand_workloads(names: list[str]) -> tuple[str, ...]:
    """`--only` names -> workloads in run order. "produce" means every produce variant."""
    aliases = {"scale-out": "scale_out", "scaleout": "scale_out", "consume_ack": "consume",
               "commit": "commits"}
    wanted: set[str] = set()
    for raw in names:
        name = aliases.get(raw.strip(), raw.strip())
        if not name:
            continue
        if name == "produce":
            wanted.update(PRODUCE_VARIANTS)
        elif name in WORKLOADS:
            wanted.add(name)
        else:
            raise ValueError(f"unknown workload {raw!r}; choose from produce, {', '.join(WORKLOADS[1:])}")
    return tuple(w for w in WORKLOADS if w in wanted)


@dataclass(frozen=True)
class Counts:
    records: int
    leases: int
    latency_rate: int
    latency_seconds: float
    latency_high_rate: int = LATENCY_HIGH_RATE

    @staticmethod
    def for_scale(scale: float) -> "Counts":
        return Counts(
            records=max(100, round(BASE_RECORDS * scale)),
            leases=max(100, round(BASE_LEASES * scale)),
            latency_rate=LATENCY_RATE,
            # The rate is the point of the workload; scale its length instead (at least 1 s).
            latency_seconds=max(1.0, LATENCY_SECONDS * scale),
        )


@dataclass(frozen=True)
class Config:
    scale: float = 1.0
    workloads: tuple[str, ...] = WORKLOADS
    peers: tuple[str, ...] = ("rabbitmq", "nats", "redis", "pgqueuer", "procrastinate", "pgmq")
    include_zbroker: bool = True
    ceiling: bool = True
    phase_timeout_s: float = 300.0
    progress: bool = True
    command: str = "python -m bench"
    scale_out_actors: tuple[int, ...] = (1, 2, 4)
    scale_out_clients: int = field(default_factory=lambda: max(1, min(4, os.cpu_count() or 1)))

    @property
    def counts(self) -> Counts:
        return Counts.for_scale(self.scale)

    @property
    def full_run(self) -> bool:
        return self.scale == 1.0 and set(self.workloads) == set(WORKLOADS) and self.include_zbroker


class Harness:
    def __init__(self, config: Config, adapters: dict[str, Callable[[], Adapter]]) -> None:
        self.config = config
        self.adapters = adapters  # name -> factory, in run order

    # -- phases --------------------------------------------------------------

    def _phase(self, system: str, workload: str, target: int, server_pids: Callable[[], list[int]],
               timeout_s: float | None = None) -> Phase:
        make_bar = None
        if self.config.progress:
            from tqdm import tqdm

            def make_bar() -> Any:
                return tqdm(total=target, desc=f"{system:>11} {workload}", unit="rec", unit_scale=True,
                            leave=True, dynamic_ncols=True, file=sys.stderr)

        timeout_s = self.config.phase_timeout_s if timeout_s is None else timeout_s
        return Phase(system=system, workload=workload, target=target, timeout_s=timeout_s,
                     server_pids=server_pids, progress=make_bar)

    def _measure(self, system: str, workload: str, target: int, server_pids: Callable[[], list[int]],
                 body: Callable[[Phase], dict[str, Any] | None], timeout_s: float | None = None) -> dict[str, Any]:
        phase = self._phase(system, workload, target, server_pids, timeout_s)
        try:
            extra = body(phase)
        except Skipped as exc:
            return {"status": "skipped", "reason": str(exc)}
        except Exception as exc:
            phase.end()
            log.error("%s %s failed:\n%s", system, workload, traceback.format_exc())
            return {**phase.result(), "status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
        finally:
            phase.close()
        phase.end()
        result = phase.result()
        if extra:
            result.update(extra)
        if result["status"] == "timed_out":
            if phase.ended_at is not None and phase.ended_at < phase.deadline:
                # Ended short with time to spare: records refused or lost, not a time bound.
                result["status"] = "failed"
                result["reason"] = (f"ended with {phase.records:,} of the {phase.target:,} records "
                                    f"acknowledged, with time to spare")
            else:
                result["reason"] = f"time bound {phase.timeout_s:g} s reached"
        return result

    # -- the run -------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        started = time.time()
        results: dict[str, Any] = {
            "started_at": started,
            "scale": self.config.scale,
            "counts": dataclasses.asdict(self.config.counts),
            "workloads_selected": list(self.config.workloads),
            "systems": {},
        }
        peer_workloads = set(self.config.workloads) - set(ZBROKER_ONLY) - set(STANDALONE)
        for name, factory in self.adapters.items():
            if not peer_workloads and (name != "zbroker" or not set(self.config.workloads) - set(STANDALONE)):
                continue  # nothing for this system's adapter to run: the standalone modules start their own
            results["systems"][name] = self._run_system(name, factory)
        if self.config.ceiling:
            results["ceiling"] = self._run_ceiling()
        for workload, module in STANDALONE.items():
            if workload in self.config.workloads:
                results[workload] = run_commits(self.config.scale, self.config.phase_timeout_s, name=module)
        results["finished_at"] = time.time()
        return results

    def _run_system(self, name: str, factory: Callable[[], Adapter]) -> dict[str, Any]:
        try:
            adapter = factory()
            adapter.check()
        except Skipped as exc:
            log.warning("%s skipped: %s", name, exc)
            return {"status": "skipped", "reason": str(exc)}
        except Exception as exc:
            return {"status": "skipped", "reason": f"could not load adapter: {type(exc).__name__}: {exc}"}
        outcome: dict[str, Any] = {"status": "ok", "version": adapter.version, "phases": {}}
        try:
            adapter.setup()
            self._run_workloads(adapter, outcome["phases"])
        except Skipped as exc:  # found out only at setup (e.g. another run holds the server)
            log.warning("%s skipped: %s", name, exc)
            outcome = {"status": "skipped", "reason": str(exc)}
        except Exception as exc:
            log.error("%s: %s", name, traceback.format_exc())
            outcome["status"] = "failed"
            outcome["reason"] = f"{type(exc).__name__}: {exc}"
        finally:
            try:
                adapter.teardown()
            except Exception as exc:
                outcome["teardown_error"] = f"{type(exc).__name__}: {exc}"
                log.error("%s teardown failed: %s", name, traceback.format_exc())
        outcome["durability"] = dict(adapter.durability)
        return outcome

    def _run_workloads(self, adapter: Adapter, phases: dict[str, Any]) -> None:
        counts = self.config.counts
        selected = self.config.workloads
        pids = adapter.server_pids
        stored = 0  # records in the main queue, for consume
        specs = {
            "produce": ProduceSpec("produce", counts.records, 100, WINDOW),
            "produce_1k": ProduceSpec("produce_1k", counts.records, 1024, WINDOW),
            "produce_fsync_always": ProduceSpec("produce_fsync_always", counts.records, 100, WINDOW, fsync="always"),
            "produce_unbatched": ProduceSpec("produce_unbatched", counts.records, 100, WINDOW, batched=False),
        }
        if "produce" in selected:
            phases["produce"] = self._measure(adapter.name, "produce", counts.records, pids,
                                              lambda phase: adapter.produce(specs["produce"], phase))
            if phases["produce"]["status"] in ("ok", "timed_out"):
                stored = phases["produce"]["records"]
        if "consume" in selected:
            def consume(phase: Phase) -> None:
                if stored < counts.records:  # before phase.begin(): not measured
                    adapter.prefill(counts.records - stored, 100)
                adapter.consume_ack(counts.records, phase)

            phases["consume_ack"] = self._measure(adapter.name, "consume_ack", counts.records, pids, consume)
        for workload in PRODUCE_VARIANTS[1:]:
            if workload in selected:
                spec = specs[workload]
                phases[workload] = self._measure(adapter.name, workload, spec.count, pids,
                                                 lambda phase, spec=spec: adapter.produce(spec, phase))
        if "latency" in selected:
            phases["latency"] = self._latency(adapter, "latency", pids)
            phases[LATENCY_HIGH] = self._latency(adapter, LATENCY_HIGH, pids, rate=counts.latency_high_rate)
        if adapter.name != "zbroker":
            return
        if "produce" in selected:
            # What the bulk call adds over one send() per record, beside the compared row.
            bulk = ProduceSpec(PRODUCE_BULK, counts.records, 100, WINDOW, bulk=True)
            phases[PRODUCE_BULK] = self._measure(adapter.name, PRODUCE_BULK, bulk.count, pids,
                                                 lambda phase: adapter.produce(bulk, phase))
        if "latency" in selected:
            # The same workload with a publisher that does not linger: what the
            # 1 ms linger of the main row buys, shown rather than implied.
            phases[LATENCY_NO_LINGER] = self._latency(adapter, LATENCY_NO_LINGER, pids, linger_ms=0.0)
        if "scale_out" in selected:
            phases["scale_out"] = self._scale_out(adapter)
        if "partitions" in selected:
            phases["partitions"] = self._partition_counts(adapter)
        if "capacity" in selected:
            phases["capacity"] = self._zbroker_only(adapter, "capacity", lambda make_phase: adapter.capacity(
                counts.records * CAPACITY_RECORDS_FACTOR, 100, make_phase))
        if "redelivery" in selected:
            phases["redelivery"] = self._measure(adapter.name, "redelivery", counts.leases, pids,
                                                 lambda phase: adapter.redelivery(counts.leases, phase))
        if "key_shared" in selected:
            count = max(2_000, round(BASE_KEY_SHARED_RECORDS * self.config.scale))
            phases["key_shared"] = self._zbroker_only(adapter, "key_shared",
                                                      lambda make_phase: adapter.key_shared(count, make_phase))

    def _latency(self, adapter: Adapter, workload: str, pids: Callable[[], list[int]],
                 rate: int | None = None, **options: Any) -> dict[str, Any]:
        counts = self.config.counts
        rate = rate or counts.latency_rate
        phase = self._measure(
            adapter.name, workload, int(rate * counts.latency_seconds), pids,
            lambda phase: adapter.latency(rate, counts.latency_seconds, 100, phase, **options),
            # A paced run has a known length: wait for stragglers, not for the general bound.
            timeout_s=min(self.config.phase_timeout_s, counts.latency_seconds + LATENCY_GRACE_S))
        # The schedule, beside the measured `seconds` (which it must not overwrite).
        phase.update(rate=rate, paced_seconds=counts.latency_seconds)
        return phase

    def _partition_counts(self, adapter: Adapter) -> dict[str, Any]:
        from bench.zbroker_adapter import PARTITION_COUNTS

        count = max(100, round(BASE_PARTITION_RECORDS * self.config.scale))
        return self._zbroker_only(adapter, "partitions", lambda make_phase: adapter.partition_counts(
            count, 100, list(PARTITION_COUNTS), make_phase))

    def _zbroker_only(self, adapter: Adapter, name: str,
                      body: Callable[[Callable[[str, int], Phase]], dict[str, Any]]) -> dict[str, Any]:
        """A zbroker-only workload of several phases: its status, and what `body` returns."""
        def make_phase(workload: str, target: int) -> Phase:
            return self._phase(adapter.name, workload, target, adapter.server_pids)

        try:
            return {"status": "ok", **body(make_phase)}
        except Skipped as exc:
            return {"status": "skipped", "reason": str(exc)}
        except Exception as exc:
            log.error("%s failed:\n%s", name, traceback.format_exc())
            return {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}

    def _scale_out(self, adapter: Adapter) -> dict[str, Any]:
        counts = self.config.counts

        def make_phase(workload: str, target: int) -> Phase:
            return self._phase(adapter.name, workload, target, adapter.server_pids)

        try:
            return {"status": "ok", **adapter.scale_out(counts.records, 100, list(self.config.scale_out_actors),
                                                       self.config.scale_out_clients, make_phase)}
        except Skipped as exc:
            return {"status": "skipped", "reason": str(exc)}
        except Exception as exc:
            log.error("scale_out failed:\n%s", traceback.format_exc())
            return {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}

    def _run_ceiling(self) -> dict[str, Any]:
        from bench.zmq_ceiling import run_ceiling

        shapes = sorted({CEILING_FOR[w] for w in self.config.workloads if w in CEILING_FOR})
        out = {}
        for mode, size in shapes:
            key = f"{mode}_{size}"
            out[key] = self._measure("zmq_ceiling", key, self.config.counts.records, lambda: [os.getpid()],
                                     lambda phase, mode=mode, size=size: run_ceiling(
                                         mode, self.config.counts.records, size, phase))
        if "latency" in self.config.workloads:
            out["latency"] = self._latency_ceiling("latency", self.config.counts.latency_rate)
            out[LATENCY_HIGH] = self._latency_ceiling(LATENCY_HIGH, self.config.counts.latency_high_rate)
        return out

    def _latency_ceiling(self, workload: str, rate: int) -> dict[str, Any]:
        """The latency workload's schedule through a bare relay: the floor of its p99 here."""
        from bench.zmq_ceiling import run_latency_ceiling

        counts = self.config.counts
        relay_pids: list[int] = []
        phase = self._measure(
            "zmq_ceiling", workload, int(rate * counts.latency_seconds), lambda: list(relay_pids),
            lambda phase: run_latency_ceiling(rate, counts.latency_seconds, 100, phase, relay_pids),
            timeout_s=min(self.config.phase_timeout_s, counts.latency_seconds + LATENCY_GRACE_S))
        phase.update(rate=rate, paced_seconds=counts.latency_seconds)
        return phase


def run_commits(scale: float, timeout_s: float, name: str = "bench.commit_absorption") -> dict[str, Any]:
    """Run bench.commit_absorption (someone else's module) if it exists.

    A module-level `run()` is called in-process (with `scale=` if it takes
    one) and its return value stored; otherwise the module runs as
    `python -m bench.commit_absorption` with BENCH_SCALE in the environment,
    and its exit code and output tail are stored (its last line too, if JSON).
    """
    try:
        if importlib.util.find_spec(name) is None:
            return {"status": "skipped", "reason": f"{name} not present"}
        module = importlib.import_module(name)
    except Skipped as exc:
        return {"status": "skipped", "reason": str(exc)}
    except ImportError as exc:
        return {"status": "skipped", "reason": f"could not import {name}: {exc}"}
    except Exception as exc:
        return {"status": "failed", "reason": f"importing {name}: {type(exc).__name__}: {exc}"}
    run = getattr(module, "run", None)
    if callable(run):
        kwargs = {"scale": scale} if "scale" in inspect.signature(run).parameters else {}
        try:
            value = run(**kwargs)
        except Skipped as exc:
            return {"status": "skipped", "reason": str(exc)}
        except Exception as exc:
            return {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
        try:
            json.dumps(value)
        except TypeError:
            value = repr(value)
        return {"status": "ok", "how": f"{name}.run({', '.join(f'{k}={v}' for k, v in kwargs.items())})",
                "result": value}
    env = {**os.environ, "BENCH_SCALE": str(scale)}
    try:
        proc = subprocess.run([sys.executable, "-m", name], capture_output=True, text=True, env=env,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "reason": f"python -m {name} ran over {timeout_s:g} s"}
    lines = (proc.stdout or "").strip().splitlines()
    parsed = None
    if lines:
        try:
            parsed = json.loads(lines[-1])
        except ValueError:
            parsed = None
    return {"status": "ok" if proc.returncode == 0 else "failed", "how": f"python -m {name}",
            "returncode": proc.returncode, "result": parsed, "stdout_tail": lines[-20:],
            "stderr_tail": (proc.stderr or "").strip().splitlines()[-20:],
            **({} if proc.returncode == 0 else {"reason": f"exit code {proc.returncode}"})}


def default_adapters(config: Config) -> dict[str, Callable[[], Adapter]]:
    from bench.peers import PEERS

    factories: dict[str, Callable[[], Adapter]] = {}
    if config.include_zbroker:
        def zbroker() -> Adapter:
            from bench.zbroker_adapter import ZBroker

            return ZBroker()

        factories["zbroker"] = zbroker
    for name in config.peers:
        factories[name] = PEERS[name]
    return factories


def results_dir_default() -> Path:
    return Path(__file__).resolve().parent / "results"
