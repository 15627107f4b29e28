"""A damaged stored batch fails the deliveries it holds, never the consumer."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from zbroker.storage.log.segment import DATA_SUFFIX
from zbroker.client import Admin, Consumer, Producer
from zbroker.client.aio import AsyncConsumer

pytestmark = pytest.mark.processes


def _flip_last_byte(data_dir: Path, topic: str, partition: int) -> None:
    segments = sorted((data_dir / "partitions" / "logs" / topic / str(partition)).glob("*" + DATA_SUFFIX))
    assert segments, list(data_dir.rglob("*"))
    with open(segments[-1], "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))


@pytest.mark.parametrize("client", ["sync", "sync-no-read-ahead", "sync-lease-ahead", "asyncio"])
def test_a_damaged_batch_on_one_partition_does_not_stop_the_others(start, tmp_path, client):
    broker = start(tmp_path / "data")
    with Admin(broker.url) as admin:
        admin.create_topic("jobs", partitions=2)
    with Producer(broker.url, linger_ms=0) as producer:
        for partition in (0, 1):
            for i in range(50):
                producer.send("jobs", b"p%d-%d" % (partition, i), partition=partition)
        producer.flush()
    _flip_last_byte(tmp_path / "data", "jobs", 0)

    got, errors = [], []
    deadline = time.monotonic() + 20
    if client.startswith("sync"):
        options = {"sync-no-read-ahead": {"read_ahead": False},
                   "sync-lease-ahead": {"lease_ahead": True, "poll_ahead": True}}.get(client, {})
        with Consumer(broker.url, group="g", topics=["jobs"], **options) as consumer:
            while len([r for r in got if r.partition == 1]) < 50 and time.monotonic() < deadline:
                try:
                    records = consumer.poll(timeout=0.2)
                except Exception as exc:  # noqa: BLE001 - recorded: the test says which
                    errors.append(exc)
                    continue
                got += records
                consumer.ack_many(records)
    else:
        async def main():
            consumer = await AsyncConsumer(broker.url, group="g", topics=["jobs"]).start()
            try:
                while len([r for r in got if r.partition == 1]) < 50 and time.monotonic() < deadline:
                    try:
                        records = await consumer.poll(timeout=0.2)
                    except Exception as exc:  # noqa: BLE001
                        errors.append(exc)
                        continue
                    got.extend(records)
                    for r in records:
                        await consumer.ack(r)
            finally:
                await consumer.close()
        asyncio.run(main())
    assert sorted(r.offset for r in got if r.partition == 1) == list(range(50)), errors[:3]
    assert 49 not in {r.offset for r in got if r.partition == 0}  # the damaged batch is never handed out
