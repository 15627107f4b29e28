"""Helpers shared by the partition-log tests: payloads with recognisable records, whole-log reads,
and file snapshots for crash-and-damage tests."""

from __future__ import annotations

from pathlib import Path

from zbroker.protocol.batch import Record, decode_fetched, encode_records, parse_batch_header
from zbroker.storage.log import LogConfig, PartitionLog


def record_value(tag: int, index: int, value_size: int) -> bytes:
    return f"{tag}:{index}:".encode().ljust(value_size, b".")


def make_payload(tag: int, record_count: int, value_size: int = 20) -> bytes:
    """A batch payload whose records say which batch (`tag`) and position they came from."""
    return encode_records([[tag, None, record_value(tag, i, value_size), None] for i in range(record_count)])


def open_log(directory: Path, *, now_ms: int = 0, **config: int) -> PartitionLog:
    return PartitionLog.open(directory, LogConfig(**config), now_ms=now_ms)


def read_records(plog: PartitionLog, offset: int, max_bytes: int = 1 << 30) -> list[Record]:
    return decode_fetched(plog.read(offset, max_bytes), "t", 0, from_offset=offset)


def read_all(plog: PartitionLog, *, from_offset: int | None = None, max_bytes: int = 4096) -> list[Record]:
    """Read forward the way a consumer does, checking every reply on the way."""
    offset = plog.log_start if from_offset is None else from_offset
    records: list[Record] = []
    while offset < plog.log_end:
        batch = read_records(plog, offset, max_bytes)
        assert batch, f"read at {offset} returned nothing below log_end {plog.log_end}"
        assert batch[0].offset == offset
        records.extend(batch)
        offset = batch[-1].offset + 1
    assert plog.read(offset, max_bytes) == b""
    return records


def batch_spans(data: bytes) -> list[tuple[int, int, int, int]]:
    """(position, end position, base offset, next offset) of every batch in a segment file's bytes."""
    spans = []
    position = 0
    while position < len(data):
        header = parse_batch_header(data, position)
        spans.append((position, position + header.total_size, header.base_offset, header.next_offset))
        position += header.total_size
    return spans


def snapshot_files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in directory.iterdir() if path.is_file()}


def restore_files(directory: Path, files: dict[str, bytes]) -> None:
    """Put the directory back exactly as snapshotted (extra files removed)."""
    for path in directory.iterdir():
        if path.name not in files:
            path.unlink()
    for name, data in files.items():
        (directory / name).write_bytes(data)
