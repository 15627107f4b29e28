"""A fixed workload for the partition actor core, for instruction counts (bench/PROFILE.md).

Records one per partition-batch, round-robin over P partitions, go through
`PartitionActorCore.handle` as the shell hands them over (encoded and decoded
by `protocol.codec`, replies encoded): either one `produce` per batch, or one
`produce_many` of `--group` batches; then fetched back a record at a time,
one `fetch` per partition, or one `fetch_many` per group. No sockets and no fsync, so what is
counted is the core's and the codec's work per record.

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        .venv/bin/python -m bench.partition_core_instructions --records N --mode many

Run at two record counts and take the difference over the extra records: that
cancels the interpreter's start and the opening of the logs.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
from pathlib import Path

import structlog

from zbroker.actors.partition_log.core import FsyncPolicy, PartitionActorCore
from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.batch import encode_records
from zbroker.storage.log.partition_log import PartitionLog


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--partitions", type=int, default=1024)
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--group", type=int, default=1000, help="batches per produce_many / parts per fetch_many")
    parser.add_argument("--mode", choices=("single", "many"), default="many")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    # In memory where there is a tmpfs: 1,024 log directories on the shared disk took 30 s.
    root = Path(tempfile.mkdtemp(prefix="zb-instr-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        core = PartitionActorCore("p0", open_log=lambda t, p, c, now: PartitionLog.open(root / t / str(p), c,
                                                                                       now_ms=now),
                                  fsync=FsyncPolicy.parse("never"))
        core.on_assign([["t", p, None] for p in range(args.partitions)], 0)
        payload = encode_records([[1, None, bytes(100), None]])
        sent = 0
        corr = 0
        while sent < args.records:
            n = min(args.group, args.records - sent)
            partitions = [(sent + i) % args.partitions for i in range(n)]
            if args.mode == "single":
                for p in partitions:
                    corr += 1
                    _serve(core, codec.encode_request(m.Produce(topic="t", partition=p), corr, [payload]))
            else:
                corr += 1
                parts = [["t", p, 0, -1, len(payload)] for p in partitions]
                _serve(core, codec.encode_request(m.ProduceMany(parts=parts), corr, [payload * n]))
            sent += n
        fetched = 0
        offsets = [0] * args.partitions
        while fetched < args.records:
            n = min(args.group, args.records - fetched)
            partitions = sorted({(fetched + i) % args.partitions for i in range(n)})
            # max_bytes 1: one batch (one record) each, as a consumer fetches a lease of one
            # record, and the next fetch starts where this one ended (the log's read cache).
            if args.mode == "single":
                for p in partitions:
                    corr += 1
                    _serve(core, codec.encode_request(m.Fetch(topic="t", partition=p, offset=offsets[p],
                                                              max_bytes=1), corr))
            else:
                corr += 1
                parts = [["t", p, offsets[p], 1] for p in partitions]
                _serve(core, codec.encode_request(m.FetchMany(parts=parts), corr))
            for p in partitions:
                offsets[p] += 1
            fetched += n
        core.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _serve(core: PartitionActorCore, frames: list) -> None:
    """What the shell does with a request: decode, handle, encode each reply."""
    env = codec.decode_request(frames)
    for effect in core.handle(("route", env.corr_id, env.op), env, 1) + core.end_turn(1):
        codec.encode_reply(effect.msg, env.corr_id, effect.frames)


if __name__ == "__main__":
    main()
