"""Micro-benchmark of the partition log alone: appends of 1000-record batches, then a
sequential read-back, into a temporary directory (page cache; no fsync, as with
`--fsync never`). The point is to show the log is never the broker's bottleneck.

    python -m bench.log_append [--batches N] [--records N] [--record-bytes N]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from zbroker.protocol.batch import encode_values, iter_stored_batches
from zbroker.storage.log import LogConfig, PartitionLog


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=5000)
    parser.add_argument("--records", type=int, default=1000, help="records per batch")
    parser.add_argument("--record-bytes", type=int, default=100, help="value bytes per record")
    parser.add_argument("--read-bytes", type=int, default=1024 * 1024, help="max_bytes per read")
    args = parser.parse_args(argv)

    now_ms = time.time_ns() // 1_000_000
    payload = encode_values([os.urandom(args.record_bytes) for _ in range(args.records)], now_ms)
    with tempfile.TemporaryDirectory(prefix="zbroker-bench-") as directory:
        with PartitionLog.open(Path(directory), LogConfig(), now_ms=now_ms) as plog:
            started = time.perf_counter()
            for _ in range(args.batches):
                plog.append(payload, args.records, append_time_ms=now_ms)
            append_seconds = time.perf_counter() - started

            started = time.perf_counter()
            offset = 0
            while offset < plog.log_end:
                for header, _ in iter_stored_batches(plog.read(offset, args.read_bytes), verify_crc=False):
                    offset = header.next_offset
            read_seconds = time.perf_counter() - started
            total_bytes = plog.size_bytes
            segments = plog.statistics()["segments"]

    records = args.batches * args.records
    mib = total_bytes / (1024 * 1024)
    print(f"append: {args.batches / append_seconds:,.0f} batches/s, {records / append_seconds:,.0f} records/s, "
          f"{mib / append_seconds:,.0f} MiB/s ({args.batches} x {args.records} records of "
          f"{args.record_bytes} B, {segments} segments)")
    print(f"read:   {records / read_seconds:,.0f} records/s, {mib / read_seconds:,.0f} MiB/s "
          f"(sequential, {args.read_bytes} B per read)")


if __name__ == "__main__":
    main()
