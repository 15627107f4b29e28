"""bench.memory's record counts, with a fake producer: the table states what was stored."""

from __future__ import annotations

from bench import memory


class CountingProducer:
    stored = 0

    def __init__(self, url: str, **options) -> None:
        pass

    def send_many(self, topic: str, values: list, partition: int | None = None) -> None:
        CountingProducer.stored += len(values)

    def __enter__(self) -> "CountingProducer":
        return self

    def __exit__(self, *exc) -> None:
        pass


def test_the_stored_counts_it_reports_are_the_records_it_produced(monkeypatch):
    monkeypatch.setattr(memory, "Producer", CountingProducer)
    for count in (1_000, 12_300, 110_700, 2_500):
        CountingProducer.stored = 0
        memory._produce("tcp://x", "mem-stored", count)
        assert CountingProducer.stored == count
