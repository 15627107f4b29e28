"""Console overhead: produce and consume+ack with the console running and scraped every
second, against the same broker started with ``--http off``.

Side by side in one run: the two configurations alternate round by round (off, on,
off, on, ...), each on a fresh broker and data directory, so a machine that slows
down during the run slows both; each figure is the median of its rounds, and the
result is the ratio on/off (1.0 = no overhead; the goal is at least 0.95). With the
console on, a thread fetches /metrics once a second for the whole round, as a
Prometheus scraper would, and the console samples the coordinator once a second.

Run: ``python -m bench --only console_overhead`` (``--scale`` sets the records per
round, 500,000 at scale 1), or ``python -m bench.console_overhead [--records N]
[--rounds R]``; prints one JSON line. `bench/harness.py` calls `run(scale=...)`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from zbroker.client import Admin, Consumer, Producer
from zbroker.supervisor import free_port_block, start_broker

# Records per round at scale 1: a floor. Produce goes on past it until the phase has
# lasted MIN_PRODUCE_S, so that it outlasts several one-second scrapes: at 2.3 M
# records/s (send_many), 250,000 records took 0.1 s and the console was never scraped
# during a measured phase. Consume+ack takes every record produced, and lasts longer.
# Each round's data is deleted after it.
BASE_RECORDS = 500_000
MIN_PRODUCE_S = 2.0
ROUNDS = 3  # per configuration
CHUNK = 1000
PARTITIONS = 2


class Scraper:
    """GET /metrics once a second until stopped; counts scrapes and failures."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = threading.Event()
        self.scrapes = 0
        self.failures = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def scrape(self) -> None:
        with urllib.request.urlopen(self.url, timeout=5) as resp:
            resp.read()

    def _run(self) -> None:
        while not self.stop.wait(1.0):
            try:
                self.scrape()
                self.scrapes += 1
            except OSError:
                self.failures += 1

    def __enter__(self) -> "Scraper":
        # The console starts beside the broker and is not waited for by start_broker: its
        # start-up (imports, first sample) must not fall inside the measured phases.
        deadline = time.monotonic() + 30
        while True:
            try:
                self.scrape()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)


def one_round(console: bool, records: int, root: Path, index: int) -> dict:
    port = free_port_block(4)
    http_port = free_port_block(1) if console else None
    data = root / f"{'on' if console else 'off'}-{index}"
    handle = start_broker(data, port=port, http=f"127.0.0.1:{http_port}" if console else "off")
    try:
        url = handle.url
        with Admin(url) as admin:
            admin.create_topic("overhead", partitions=PARTITIONS)
        scraper = Scraper(f"http://127.0.0.1:{http_port}/metrics") if console else None
        if scraper is not None:
            scraper.__enter__()
        try:
            value = bytes(100)
            started = time.perf_counter()
            sent = 0
            with Producer(url, batch_size=CHUNK, max_in_flight_records=10 * CHUNK) as producer:
                while sent < records or time.perf_counter() - started < MIN_PRODUCE_S:
                    producer.send_many("overhead", [value] * CHUNK, partition=(sent // CHUNK) % PARTITIONS)
                    sent += CHUNK
            produce_s = time.perf_counter() - started
            records = sent
            started = time.perf_counter()
            done = 0
            with Consumer(url, group="overhead", topics=["overhead"]) as consumer:
                while done < records:
                    for rec in consumer.poll(max_records=CHUNK, timeout=1.0):
                        consumer.ack(rec)
                        done += 1
                consumer.flush_acks()
            consume_s = time.perf_counter() - started
        finally:
            if scraper is not None:
                scraper.__exit__()
        return {"records": records, "produce_rps": records / produce_s, "consume_ack_rps": records / consume_s,
                "scrapes": scraper.scrapes if scraper else 0, "scrape_failures": scraper.failures if scraper else 0}
    finally:
        handle.stop()
        shutil.rmtree(data, ignore_errors=True)


def measure(records: int, rounds: int) -> dict:
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="zbroker-console-overhead-") as tmp:
        for i in range(rounds):
            for name in ("off", "on"):
                runs[name].append(one_round(name == "on", records, Path(tmp), i))
    # Rounds differ in size (produce runs at least MIN_PRODUCE_S): the median of their sizes.
    sizes = [r["records"] for rs in runs.values() for r in rs]
    out: dict = {"records_per_round": round(statistics.median(sizes)), "min_records": records,
                 "min_produce_s": MIN_PRODUCE_S, "rounds": rounds, "partitions": PARTITIONS, "runs": runs}
    for figure in ("produce_rps", "consume_ack_rps"):
        off = statistics.median(r[figure] for r in runs["off"])
        on = statistics.median(r[figure] for r in runs["on"])
        out[figure] = {"http_off": round(off), "console_scraped": round(on), "ratio": round(on / off, 3)}
    out["scrapes"] = sum(r["scrapes"] for r in runs["on"])
    out["scrape_failures"] = sum(r["scrape_failures"] for r in runs["on"])
    out["goal_met"] = all(out[f]["ratio"] >= 0.95 for f in ("produce_rps", "consume_ack_rps"))
    return out


def run(scale: float = 1.0) -> dict:
    return measure(max(CHUNK, int(BASE_RECORDS * scale)), ROUNDS)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.console_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=BASE_RECORDS)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    print(json.dumps(measure(args.records, args.rounds)))


if __name__ == "__main__":
    main()
