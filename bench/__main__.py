"""`python -m bench` (`make bench`): zbroker beside RabbitMQ, NATS JetStream, Redis Streams and raw ZeroMQ.

Writes <out>/<UTC stamp>.json (everything measured), .png (chart) and .md
(tables), copies them to <out>/latest.*, and renders bench/RESULTS.md from
bench/RESULTS.md.tmpl when the run is a full one (scale 1, every workload)
or when --results-md names a file.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
from pathlib import Path

from bench import harness, machine, report

RESULTS_MD = Path(__file__).resolve().parent / "RESULTS.md"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply record counts (200,000 records, 10,000 leases; latency lasts 5 s x F, "
                             "at least 1 s); e.g. 0.05 for a smoke run")
    parser.add_argument("--only", default="",
                        help="comma-separated workloads: produce (all four variants), produce_1k, "
                             "produce_fsync_always, produce_unbatched, consume, latency, scale_out, "
                             "redelivery, key_shared, commits, memory, coordinator_failover, console_overhead, replication")
    parser.add_argument("--peers", default=",".join(harness.Config.peers), help="comma-separated peers to compare")
    parser.add_argument("--no-peers", action="store_true", help="zbroker and the ceiling only")
    parser.add_argument("--no-zbroker", action="store_true", help="peers and the ceiling only")
    parser.add_argument("--no-ceiling", action="store_true", help="skip the raw-ZeroMQ ceiling")
    parser.add_argument("--out", type=Path, default=harness.results_dir_default(),
                        help="directory for the run's files (default bench/results)")
    parser.add_argument("--results-md", type=Path, default=None,
                        help="also render RESULTS.md here (a full run writes bench/RESULTS.md by itself)")
    parser.add_argument("--phase-timeout", type=float, default=300.0, help="time bound per phase, seconds")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--client-sched", choices=("normal", "batch"), default="normal",
                        help="scheduling policy of every system's client processes: batch runs them "
                             "SCHED_BATCH (no wake-up preemption; Linux), the brokers keep theirs "
                             "(see bench/PROFILE.md, 'latency and the scheduler')")
    args = parser.parse_args(argv)
    if args.client_sched == "batch":
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # inherited by every client we start
        except (AttributeError, OSError) as exc:
            parser.error(f"--client-sched batch is not available here: {exc}")
    if args.scale <= 0:
        parser.error("--scale must be positive")
    try:
        args.workloads = harness.expand_workloads(args.only.split(",")) if args.only else harness.WORKLOADS
    except ValueError as exc:
        parser.error(str(exc))
    peers = [] if args.no_peers else [p.strip() for p in args.peers.split(",") if p.strip()]
    known = harness.Config.peers
    unknown = [p for p in peers if p not in known]
    if unknown:
        parser.error(f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    args.peer_list = tuple(peers)
    return args


def install_signal_handlers() -> None:
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, _terminate)


def _terminate(signum, _frame) -> None:
    # Turn SIGTERM, SIGHUP (a closed terminal) and SIGQUIT into KeyboardInterrupt so that
    # every adapter's teardown runs: the Redis one puts the server's AOF settings back.
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    logging.getLogger("pika").setLevel(logging.WARNING)  # pika logs every connection step at INFO
    # procrastinate logs two INFO lines per job: 400,000 lines a run, written while it is timed.
    logging.getLogger("procrastinate").setLevel(logging.WARNING)
    install_signal_handlers()
    command = shlex.join(["python", "-m", "bench", *argv])
    config = harness.Config(
        scale=args.scale,
        workloads=args.workloads,
        peers=args.peer_list,
        include_zbroker=not args.no_zbroker,
        ceiling=not args.no_ceiling,
        phase_timeout_s=args.phase_timeout,
        progress=not args.no_progress,
        command=command,
    )
    described = machine.describe()  # before the run: the load average is the machine's, not ours
    results = harness.Harness(config, harness.default_adapters(config)).run()
    results["machine"] = described
    results["command"] = command
    results_md = args.results_md if args.results_md is not None else (RESULTS_MD if config.full_run else None)
    paths = report.write_run(results, args.out, results_md=results_md)
    print(paths["latest_md"].read_text(encoding="utf-8"))
    for name, path in paths.items():
        print(f"{name}: {path}", file=sys.stderr)
    if results_md is None:
        print("bench/RESULTS.md not rewritten (not a full run; use --results-md PATH to force)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
