"""Replication benchmark (issue #25): the cost of R = 3 beside R = 1, in one run.

    python -m bench --only replication --scale 0.05 --no-peers --no-ceiling

One broker, `zbroker up --partition-actors 3 --actor-dirs` (three actors, three
data directories, on this one host), and for each row a fresh topic of one
partition:

* produce and consume+ack rec/s at R = 1 and at R = 3 (M = 2), the same
  client code as the main produce and consume rows (bench.zbroker_adapter),
  side by side, so the ratio is what the issue's goal (R = 3 produce at least
  50 % of R = 1) is judged on. THROUGHPUT_ROUNDS rounds, each an R = 1 row
  then an R = 3 row on fresh topics: a row at half scale lasts 40-250 ms,
  and one pair alone swung from R = 3 consuming at 2.1x R = 1 (01:04 UTC run,
  2026-12-05) to 0.4x. Each row shown is the round of median rec/s, and the
  ratio the median of the rounds' ratios, with their range;
* publish-to-receive latency at R = 3, and at R = 1 beside it: a paced
  publisher in its own process, the consumer here, p50/p99 of receive time
  minus the stamp;
* leader failover: SIGKILL the partition's leader (the supervisor restarts
  it), then time until a produce of one record is acknowledged, by whichever
  replica leads then. Before each kill the ISR is back to all three replicas,
  so every kill is survivable at M = 2. p50 and max over FAILOVER_KILLS kills
  (at least 20, whatever the scale), with the broker's default settings.

Prints one JSON object when run as `python -m bench.replication`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from typing import Any, Iterator

from bench.adapter import Phase, ProduceSpec
from bench.latency import LatencyRecorder, Pacer, PublisherProcess
from bench.zbroker_adapter import _consume, _produce, paced_publisher

BASE_RECORDS = 100_000
RECORD_BYTES = 100
LATENCY_RATE = 2000   # records/s, paced
BASE_LATENCY_S = 5.0
FAILOVER_KILLS = 20
THROUGHPUT_ROUNDS = 5
# Bounds on waiting for a state the broker reports (never what is measured).
WAIT_S = 120.0


@contextlib.contextmanager
def three_actor_broker(prefix: str) -> Iterator[Any]:
    """`zbroker up --partition-actors 3 --actor-dirs` in a temporary data directory, stopped and
    removed afterwards: the layout of every replication row."""
    from zbroker.supervisor import start_broker

    data = tempfile.mkdtemp(prefix=prefix)
    broker = start_broker(data, partition_actors=3, extra_args=("--actor-dirs",))
    try:
        yield broker
    finally:
        broker.stop()
        shutil.rmtree(data, ignore_errors=True)


def _wait(what: str, check, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def _phase(workload: str, target: int, pids) -> Phase:
    return Phase(system="zbroker", workload=workload, target=target, timeout_s=600.0, server_pids=lambda: [*pids().values()])


def _partition(admin, topic: str) -> dict:
    return admin.describe_topic(topic)["partitions"][0]


def _fully_in_sync(admin, topic: str) -> dict | None:
    p = _partition(admin, topic)
    return p if p["leader"] is not None and len(p["isr"]) == len(p["replicas"]) else None


def _actor_pid(admin, actor_id: str) -> int:
    return next(a["pid"] for a in admin.status()["actors"] if a.get("actor_id") == actor_id)


def _throughput(broker, admin, records: int, replication_factor: int, round_no: int) -> dict[str, Any]:
    topic = f"repl-r{replication_factor}-{round_no}"
    admin.create_topic(topic, partitions=1, replication_factor=replication_factor)
    _wait(f"{topic} to be in sync", lambda: _fully_in_sync(admin, topic))
    produce = _phase(f"replication R={replication_factor} produce", records, broker.pids)
    _produce(broker.url, topic, records, bytes(RECORD_BYTES), ProduceSpec("produce", records, RECORD_BYTES), produce)
    consume = _phase(f"replication R={replication_factor} consume_ack", records, broker.pids)
    _consume(broker.url, topic, f"bench-repl-r{replication_factor}-{round_no}", records, consume)
    return {"produce": produce.result(), "consume_ack": consume.result()}


def _latency(broker, admin, seconds: float, replication_factor: int) -> dict[str, Any]:
    topic = f"repl-latency-r{replication_factor}"
    admin.create_topic(topic, partitions=1, replication_factor=replication_factor)
    _wait(f"{topic} to be in sync", lambda: _fully_in_sync(admin, topic))
    recorder = LatencyRecorder()
    publisher = PublisherProcess(paced_publisher, {"url": broker.url, "topic": topic, "rate": LATENCY_RATE,
                                                   "seconds": seconds, "size": RECORD_BYTES, "linger_ms": 1.0})
    expected = Pacer(LATENCY_RATE, seconds, 0.0).total
    phase = _phase(f"replication R={replication_factor} latency", expected, broker.pids)
    _consume(broker.url, topic, f"bench-{topic}", expected, phase, recorder, on_joined=publisher.start)
    summary = recorder.summary()
    summary.pop("hdr", None)
    summary.pop("cdf", None)
    return {**summary, "rate": LATENCY_RATE, "seconds": seconds, "publisher": publisher.finish()}


def _failover(broker, admin, kills: int) -> dict[str, Any]:
    from zbroker.client import Producer

    topic = "repl-failover"
    admin.create_topic(topic, partitions=1, replication_factor=3)
    times: list[float] = []
    with Producer(broker.url, linger_ms=0, batch_size=1) as producer:
        for i in range(kills):
            before = _wait("the ISR to be whole again", lambda: _fully_in_sync(admin, topic))
            producer.send(topic, b"warm-%d" % i, partition=0)
            producer.flush()  # connected to the leader, nothing in flight
            pid = _actor_pid(admin, before["leader"])
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            handle = producer.send(topic, b"after-%d" % i, partition=0)
            producer.flush()  # retried (NOT_LEADER, TIMEOUT) until a leader acknowledges it
            times.append(time.monotonic() - killed_at)
            assert handle.error is None, handle.error
            _wait("a new leader epoch", lambda: _partition(admin, topic)["leader_epoch"] > before["leader_epoch"])
    ordered = sorted(times)
    return {"kills": kills, "p50_s": round(statistics.median(ordered), 3), "max_s": round(ordered[-1], 3),
            "min_s": round(ordered[0], 3), "all_s": [round(t, 3) for t in times]}


def _medians(rounds: list[dict]) -> tuple[dict, dict, dict]:
    """Per R and role, the round of median rec/s; per role, the median of the rounds' R = 3 / R = 1
    ratios and their [min, max] (None where a round has no figure)."""
    rows: dict[str, dict] = {"R=1": {}, "R=3 M=2": {}}
    ratios: dict[str, float | None] = {}
    ranges: dict[str, list | None] = {}
    for role in ("produce", "consume_ack"):
        for row in rows:
            ordered = sorted((r[row][role] for r in rounds), key=lambda result: result.get("msgs_s") or 0)
            rows[row][role] = ordered[len(ordered) // 2]
        each = [r["R=3 M=2"][role]["msgs_s"] / r["R=1"][role]["msgs_s"] for r in rounds
                if r["R=1"][role].get("msgs_s") and r["R=3 M=2"][role].get("msgs_s")]
        ratios[role] = round(statistics.median(each), 3) if len(each) == len(rounds) else None
        ranges[role] = [round(min(each), 3), round(max(each), 3)] if each else None
    return rows, ratios, ranges


def run(scale: float = 1.0) -> dict[str, Any]:
    from zbroker.client import Admin

    records = max(2_000, int(BASE_RECORDS * scale))
    seconds = max(1.0, BASE_LATENCY_S * scale)
    with three_actor_broker("zbroker-bench-repl-") as broker:
        with Admin(broker.url) as admin:
            rounds = [{"R=1": _throughput(broker, admin, records, 1, i),
                       "R=3 M=2": _throughput(broker, admin, records, 3, i)} for i in range(THROUGHPUT_ROUNDS)]
            rows, ratios, ratio_ranges = _medians(rounds)
            latency = {"R=1": _latency(broker, admin, seconds, 1), "R=3 M=2": _latency(broker, admin, seconds, 3)}
            failover = _failover(broker, admin, FAILOVER_KILLS)
    return {"records": records, "record_bytes": RECORD_BYTES, "rows": rows, "r3_over_r1": ratios,
            "r3_over_r1_range": ratio_ranges, "rounds": len(rounds),
            "latency": latency, "failover": failover,
            "layout": "zbroker up --partition-actors 3 --actor-dirs (one host), one partition per topic"}


if __name__ == "__main__":
    print(json.dumps(run(float(os.environ.get("BENCH_SCALE", "1")))))
    sys.exit(0)
