"""Where R = 3 produce spends the server's CPU beside R = 1 (issue #25), per actor.

    .venv/bin/python -m bench.replication_cost [--records 200000] [--rounds 2]

The broker and workload of bench/replication.py's produce rows (`zbroker up
--partition-actors 3 --actor-dirs`, 100-byte records, the producer's
1,000-record window in 500-record batches), R = 1 then R = 3 (M = 2), a fresh
topic each, alternated `--rounds` times on one broker. For each row: records/s,
the server's CPU per record, and for every actor its CPU per record and its
voluntary context switches (every thread; a voluntary switch is a wait that
something ended: a wake-up) per 500-record batch; the leader is marked "L:".
To compare two checkouts, copy this file into the other one's bench/ and run
it there with that checkout's venv.
"""

from __future__ import annotations

import argparse
import os

from bench.adapter import ProduceSpec
from bench.one_record import threads
from bench.replication import RECORD_BYTES, _fully_in_sync, _phase, _wait, three_actor_broker
from bench.zbroker_adapter import PRODUCE_BATCH, _produce


def _cpu_and_wakeups(pid: int) -> tuple[float, int]:
    """CPU seconds and voluntary context switches of all the process's threads."""
    per_thread = threads(pid).values()
    return sum(ticks for _s, ticks in per_thread) / os.sysconf("SC_CLK_TCK"), sum(s for s, _t in per_thread)


def _row(broker, admin, actors: dict, topic: str, replication_factor: int, records: int) -> dict:
    admin.create_topic(topic, partitions=1, replication_factor=replication_factor)
    leader = _wait(f"{topic} to be in sync", lambda: _fully_in_sync(admin, topic))["leader"]
    before = {a: _cpu_and_wakeups(pid) for a, pid in actors.items()}
    phase = _phase(f"R={replication_factor} produce", records, broker.pids)
    _produce(broker.url, topic, records, bytes(RECORD_BYTES), ProduceSpec("produce", records, RECORD_BYTES), phase)
    result = phase.result()
    batches = records / PRODUCE_BATCH
    after = {a: _cpu_and_wakeups(pid) for a, pid in actors.items()}
    per_actor = {("L:" if a == leader else "") + a: (round((after[a][0] - before[a][0]) / records * 1e6, 2),
                                                     round((after[a][1] - before[a][1]) / batches, 1))
                 for a in actors}
    return {"msgs_s": round(result["msgs_s"]), "server_us_per_record": round(result["server_cpu_us_per_record"], 2),
            "actors_us_per_record_and_wakeups_per_batch": per_actor}


def main() -> None:
    from zbroker.client import Admin

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with three_actor_broker("zbroker-bench-repl-cost-") as broker, Admin(broker.url) as admin:
        actors = {a["actor_id"]: a["pid"] for a in admin.status()["actors"] if a.get("actor_id")}
        for i in range(args.rounds):
            rows = {rf: _row(broker, admin, actors, f"cost-r{rf}-{i}", rf, args.records) for rf in (1, 3)}
            for rf, row in rows.items():
                print(f"R={rf}", row, flush=True)
            print(f"R=3 / R=1 produce: {rows[3]['msgs_s'] / rows[1]['msgs_s']:.3f}  "
                  f"(load average {os.getloadavg()[0]:.2f})", flush=True)


if __name__ == "__main__":
    main()
