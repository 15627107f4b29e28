"""The one-record request path (issue #29): zbload producing single-record requests.

Starts a broker (one partition actor, fsync interval:1000 unless told), makes a
topic of one partition, and has the C load generator send COUNT produce requests
of one 100-byte record each, with 1,000 outstanding. Prints one JSON line a round:
the requests/s zbload saw, its own CPU per request, the server's CPU per request
in total and per broker process (from each process's CPU clock, as bench does),
CPU and voluntary context switches (wake-ups) per request of every thread of the
actor and the coordinator, and the actor's counters per request (`reports`: the
messages it sent the coordinator).

    .venv/bin/python -m bench.one_record --records 100000 [--rounds 2] [--fsync always]
    .venv/bin/python -m bench.one_record --records 10000 --callgrind /tmp/one.cg

Several rounds run on one broker, each on a topic of its own, so that two trees
can be compared side by side by running this script from each, interleaved.
With ``--callgrind`` (or ``--cprofile``) an extra actor runs under that tool and
the topic's partition is put on it: its instructions per request are counted
between `callgrind_control -z` and `-d` around zbload (bench/PROFILE.md,
twentieth pass).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile

from bench.procstat import CLOCK_TICKS, process_cpu_clock
from bench.zbroker_adapter import LOADGEN, wait_until_open
from zbroker.client import Admin
from zbroker.protocol import messages as m
from zbroker.supervisor import start_broker


def actor_status(admin: Admin, topic: str, partition: int = 0) -> dict:
    endpoint = admin.conn.coordinator(m.Metadata(topics=[topic])).topics[0]["partitions"][partition]["endpoint"]
    return admin.conn.call(endpoint, m.Status(), timeout=60).msg.actors[0]


def threads(pid: int) -> dict[str, tuple[int, int]]:
    """Per thread name: voluntary context switches (each a wait that something had to
    wake) and CPU in clock ticks (utime + stime)."""
    import os
    out: dict[str, tuple[int, int]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = fields["Name"].strip()
        switches, ticks = out.get(name, (0, 0))
        out[name] = (switches + int(fields["voluntary_ctxt_switches"]), ticks + int(stat[11]) + int(stat[12]))
    return out


def callgrind_total(out: str) -> int:
    """Instructions in the newest dump of `out` (callgrind_control -d writes OUT.1, OUT.2, ...)."""
    import glob
    import os
    newest = max(glob.glob(out + ".*"), key=os.path.getmtime)
    with open(newest) as f:
        for line in f:
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise RuntimeError(f"no totals in {newest}")


def traced_actor(broker, args) -> tuple:
    """An extra partition actor under callgrind or cProfile; returns (process, out file, its topic, partition)."""
    import os
    import time
    data = tempfile.mkdtemp(prefix="zb-one-vg-")
    if args.callgrind:
        out = os.path.abspath(args.callgrind)
        prefix = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable]
    else:
        out = os.path.abspath(args.cprofile)
        prefix = [sys.executable, "-m", "cProfile", "-o", out]
    process = subprocess.Popen([*prefix, "-m", "zbroker", "partition", "--coordinator", broker.url,
                                "--data", data, "--actor-id", "vg", "--bind", "tcp://127.0.0.1:0",
                                "--fsync", args.fsync, "--log-level", "warning"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    admin = Admin(broker.url)
    deadline = time.monotonic() + 300
    while not any(a.get("actor_id") == "vg" and a.get("healthy") for a in admin.conn.coordinator(m.Status()).actors):
        if time.monotonic() > deadline or process.poll() is not None:
            raise RuntimeError("the actor under callgrind did not register")
        time.sleep(0.5)
    # Two partitions, one per actor (placement takes the least loaded): the run uses vg's.
    admin.create_topic("vg", partitions=2)
    while True:
        placed = admin.conn.coordinator(m.Metadata(topics=["vg"])).topics[0]["partitions"]
        mine = [p["partition"] for p in placed if p.get("endpoint")
                and admin.conn.call(p["endpoint"], m.Status(), timeout=60).msg.actors[0]["actor_id"] == "vg"
                and any(row[0] == "vg" for row in admin.conn.call(p["endpoint"], m.Status(), timeout=60).msg.actors[0]["partitions"])]
        if mine:
            break
        time.sleep(0.5)
    admin.close()
    return process, out, "vg", mine[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--fsync", default="interval:1000")
    parser.add_argument("--callgrind", metavar="OUT", help="count the instructions of an extra actor run under "
                        "callgrind (zeroed before the produce, dumped after, to OUT.N): the rate is then valgrind's")
    parser.add_argument("--cprofile", metavar="OUT", help="the same extra actor under cProfile, written to OUT "
                        "when it stops (a profile of every call it made, start-up included)")
    args = parser.parse_args()
    subprocess.run(["make", "-s", "-C", LOADGEN.rsplit("/", 1)[0]], check=True)
    data = tempfile.mkdtemp(prefix="zb-one-")
    broker = start_broker(data, fsync=args.fsync)
    traced = None
    try:
        pids = {name: pid for name, pid in broker.pids().items()}
        admin = Admin(broker.url)
        if args.callgrind or args.cprofile:
            traced, out, topic, partition = traced_actor(broker, args)
            pids["vg"] = traced.pid
        for round_no in range(args.rounds):
            if traced is None:
                topic, partition = f"one-{round_no}", 0
                admin.create_topic(topic, partitions=1)
                wait_until_open(admin, topic, 1)
            counters_before = actor_status(admin, topic, partition)["counters"]
            before = {name: process_cpu_clock(pid) for name, pid in pids.items()}
            threads_before = {name: threads(pid) for name, pid in pids.items()}
            if args.callgrind:
                subprocess.run(["callgrind_control", "-z", str(traced.pid)], check=True, capture_output=True)
            done = subprocess.run([LOADGEN, "produce", broker.url, topic, str(args.records), str(args.size),
                                   str(args.window), "1", str(partition), "1000000"],
                                  capture_output=True, text=True, check=True)
            if args.callgrind:
                subprocess.run(["callgrind_control", "-d", str(traced.pid)], check=True, capture_output=True)
            after = {name: process_cpu_clock(pid) for name, pid in pids.items()}
            threads_after = {name: threads(pid) for name, pid in pids.items()
                             if name in ("coordinator", "partition-0", "vg")}
            switches = {name: {thread: round((n - threads_before[name].get(thread, (0, 0))[0]) / args.records, 3)
                               for thread, (n, _) in by_thread.items()} for name, by_thread in threads_after.items()}
            thread_us = {name: {thread: round((t - threads_before[name].get(thread, (0, 0))[1]) * 1e6 / CLOCK_TICKS
                                              / args.records, 2) for thread, (_, t) in by_thread.items()}
                         for name, by_thread in threads_after.items()}
            counters_after = actor_status(admin, topic, partition)["counters"]
            report = json.loads(done.stdout)
            per = {name: round((after[name] - before[name]) * 1e6 / args.records, 2) for name in pids
                   if before[name] is not None and after[name] is not None}
            counted = {k: v - counters_before.get(k, 0) for k, v in counters_after.items()
                       if isinstance(v, int) and v != counters_before.get(k, 0)}
            row = {"round": round_no, "requests": counted.get("produce_requests", 0),
                   "requests_s": round(args.records / report["seconds"]),
                   "server_cpu_us_per_request": round(sum(per.values()), 2), "by_process": per,
                   "zbload_cpu_us_per_request": round(report["cpu_s"] * 1e6 / args.records, 2),
                   "wakeups_per_request": switches, "thread_cpu_us_per_request": thread_us,
                   "actor_counters_per_request": {k: round(v / args.records, 4) for k, v in counted.items()}}
            if args.callgrind:
                row["actor_instructions_per_request"] = round(callgrind_total(out) / args.records)
            print(json.dumps(row), flush=True)
        admin.close()
    finally:
        if traced is not None:
            traced.terminate()
            traced.wait(120)
        broker.stop()
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
