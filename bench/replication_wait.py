"""How long an R = 3 produce batch waits for its acknowledgement, beside R = 1 (issue #25).

    .venv/bin/python -m bench.replication_wait [--records 300000] [--rounds 2]

The broker and producer of bench/replication.py's produce rows (`zbroker up
--partition-actors 3 --actor-dirs`, 100-byte records, `Producer(linger_ms=2,
batch_size=500, max_in_flight_records=1000)`), R = 1 then R = 3 (M = 2) on
fresh topics, alternated `--rounds` times. For each row: records/s, each
batch's time from its request leaving to its reply being filed (p50, p90),
the share of replies filed within 50 µs of the one before (two batches
answered together), and the share of the row's time the producer spent
waiting for room in its window. With a window of two batches, records/s is
at most 1,000 records per acknowledgement time; a producer that waits most
of the row is held up by the acknowledgement chain, not by its own CPU.
"""

from __future__ import annotations

import argparse
import os
import time

from bench.replication import RECORD_BYTES, _fully_in_sync, _wait, three_actor_broker
from bench.zbroker_adapter import PRODUCE_BATCH

WINDOW = 1000


def _row(url: str, admin, topic: str, replication_factor: int, records: int) -> str:
    from zbroker.client.sync import Producer

    admin.create_topic(topic, partitions=1, replication_factor=replication_factor)
    _wait(f"{topic} to be in sync", lambda: _fully_in_sync(admin, topic))
    producer = Producer(url, linger_ms=2, batch_size=PRODUCE_BATCH, max_in_flight_records=WINDOW)
    sent_at: dict[int, float] = {}
    filed_at: dict[int, float] = {}
    waited = [0.0]
    core, clock = producer.core, time.perf_counter
    core_sent, core_settle, pump = core.sent, core.settle, producer._pump

    def sent(corr, batch, now):
        sent_at[corr] = clock()
        return core_sent(corr, batch, now)

    def settle(corr, error, reply, now):
        filed_at[corr] = clock()
        return core_settle(corr, error, reply, now)

    def timed_pump(timeout_s):
        start = clock()
        try:
            return pump(timeout_s)
        finally:
            waited[0] += clock() - start

    core.sent, core.settle, producer._pump = sent, settle, timed_pump
    payload, send = bytes(RECORD_BYTES), producer.send
    try:
        start = clock()
        for _ in range(records):
            send(topic, payload)
        producer.flush()
        elapsed = clock() - start
    finally:
        producer.close()
    waits = sorted((filed_at[c] - sent_at[c]) * 1e3 for c in sent_at if c in filed_at)
    filed = sorted(filed_at.values())
    paired = sum(1 for a, b in zip(filed, filed[1:]) if b - a < 50e-6) / max(1, len(filed) - 1)
    return (f"R={replication_factor}: {records / elapsed:,.0f} records/s; acknowledgement after "
            f"p50 {waits[len(waits) // 2]:.2f} ms, p90 {waits[int(len(waits) * 0.9)]:.2f} ms over {len(waits)} "
            f"batches; {paired:.0%} filed within 50 us of the one before; the producer waited for room "
            f"{waited[0] / elapsed:.0%} of the row")


def main() -> None:
    from zbroker.client import Admin

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=300_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with three_actor_broker("zbroker-bench-repl-wait-") as broker, Admin(broker.url) as admin:
        for i in range(args.rounds):
            for rf in (1, 3):
                print(_row(broker.url, admin, f"wait-r{rf}-{i}", rf, args.records), flush=True)
            print(f"(load average {os.getloadavg()[0]:.2f})", flush=True)


if __name__ == "__main__":
    main()
