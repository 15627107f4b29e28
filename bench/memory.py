"""Memory benchmark: actor RSS against records stored and records in flight.

Two questions from the issues, answered on a broker of its own:

* stored: does each actor's RSS stay flat (within 20 %) from 1 million to
  10 million records stored? The log keeps a sparse index in compact arrays
  and reads with ``pread``; nothing per record lives in memory.
* in flight: does the coordinator's RSS stay flat while 1,000,000 records are
  leased and unacknowledged? Leases are offset ranges, so it should not grow
  with the record count. Leases are taken with raw ``poll`` requests: the
  records are never fetched, so the client holds no payloads.

Run: ``python -m bench.memory [--stored 10000000] [--in-flight 1000000]``;
prints one JSON line. `bench/harness.py` calls `run(scale=...)`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from zbroker.protocol import messages as m
from zbroker.client import Admin, Producer
from zbroker.client.sync import Connection
from zbroker.supervisor import start_broker

CHUNK = 1000


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def actor_rss(handle) -> dict[str, int]:
    return {name: rss_kib(pid) for name, pid in handle.pids().items() if name != "supervisor"}


def _produce(url: str, topic: str, count: int) -> None:
    value = bytes(100)
    with Producer(url, batch_size=CHUNK, max_in_flight_records=10 * CHUNK) as producer:
        for start in range(0, count, CHUNK):  # all `count`: the table states them as stored
            producer.send_many(topic, [value] * min(CHUNK, count - start), partition=0)


def _growth(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    return {name: round(after[name] / before[name] - 1, 4) for name in before if name in after and before[name]}


def measure_stored(url: str, handle, stored: int) -> dict:
    first = max(stored // 10, CHUNK)
    _produce(url, "mem-stored", first)
    conn = Connection(url)
    try:
        conn.refresh()
        # Touch the data path the way consumers do, so read caches are warm in both samples.
        from zbroker.client import fetch
        fetch(conn, "mem-stored", 0, 0)
        fetch(conn, "mem-stored", 0, first - 1)
        at_first = actor_rss(handle)
        _produce(url, "mem-stored", stored - first)
        fetch(conn, "mem-stored", 0, 0)
        fetch(conn, "mem-stored", 0, stored - 1)
        at_all = actor_rss(handle)
    finally:
        conn.close()
    growth = _growth(at_first, at_all)
    return {"records_first": first, "records_all": stored, "rss_kib_at_first": at_first, "rss_kib_at_all": at_all,
            "growth": growth, "flat_within_20pct": all(g <= 0.20 for g in growth.values())}


def measure_in_flight(url: str, handle, in_flight: int) -> dict:
    with Admin(url) as admin:
        admin.create_topic("mem-leases", partitions=1)
        admin.configure_group("mem", max_in_flight=in_flight, ack_timeout_ms=600_000)
    _produce(url, "mem-leases", in_flight)
    conn = Connection(url, request_timeout=30)
    try:
        join = conn.coordinator(m.Join(group="mem", topics=["mem-leases"], session_timeout_ms=600_000))
        baseline = rss_kib(handle.pids()["coordinator"])
        samples = {0: baseline}
        leased: list[list] = []
        held = 0
        while held < in_flight:
            reply = conn.coordinator(m.Poll(group="mem", member_id=join.member_id, generation=join.generation,
                                            max_records=min(100_000, in_flight - held), max_wait_ms=1000))
            for topic, partition, lease, start, end, _attempt, _reason in reply.deliveries:
                leased.append([topic, partition, lease, start, end])
                held += end - start
            if held >= in_flight // 10 and in_flight // 10 not in samples:
                samples[in_flight // 10] = rss_kib(handle.pids()["coordinator"])
        samples[held] = rss_kib(handle.pids()["coordinator"])
        started = time.perf_counter()
        ack = conn.coordinator(m.Ack(group="mem", member_id=join.member_id, generation=join.generation,
                                     ranges=leased))
        ack_s = time.perf_counter() - started
        deadline = time.monotonic() + 30
        committed = None
        while time.monotonic() < deadline:
            group = conn.coordinator(m.DescribeGroup(group="mem")).group
            committed = group["partitions"][0]["committed"]
            if committed == in_flight:
                break
            time.sleep(0.05)
    finally:
        conn.close()
    return {"in_flight": held, "lease_ranges": len(leased), "coordinator_rss_kib": samples,
            "growth_from_10pct": round(samples[held] / samples[in_flight // 10] - 1, 4),
            "one_ack_frame_s": round(ack_s, 4), "applied": ack.applied, "committed_after_ack": committed}


def run(scale: float = 1.0, stored: int | None = None, in_flight: int | None = None) -> dict:
    stored = stored or max(int(10_000_000 * scale) // CHUNK * CHUNK, 10 * CHUNK)
    in_flight = in_flight or max(int(1_000_000 * scale) // CHUNK * CHUNK, 10 * CHUNK)
    with tempfile.TemporaryDirectory(prefix="zbroker-mem-") as tmp:
        handle = start_broker(Path(tmp) / "data", log_level="warning")
        try:
            with Admin(handle.url) as admin:
                admin.create_topic("mem-stored", partitions=1)
            result = {"stored": measure_stored(handle.url, handle, stored),
                      "in_flight": measure_in_flight(handle.url, handle, in_flight)}
        finally:
            handle.stop()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stored", type=int, default=10_000_000)
    parser.add_argument("--in-flight", type=int, default=1_000_000)
    args = parser.parse_args()
    print(json.dumps(run(stored=args.stored, in_flight=args.in_flight)))


if __name__ == "__main__":
    main()
