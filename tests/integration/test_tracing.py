"""The ``otel`` extra against a real broker: one trace from the producer's span to every delivery."""

from __future__ import annotations

import asyncio

import pytest
# The test extra installs the SDK (the otel extra only the API): missing, this fails rather than skips.
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from zbroker.client import Admin, Consumer, Producer
from zbroker.client.aio import AsyncProducer
from zbroker.client.tracing import DELIVERY_COUNT, AsyncTracingProducer, TracingProducer, traced_handler

pytestmark = pytest.mark.processes


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def test_the_process_span_of_every_delivery_is_a_child_of_the_send_span(broker, spans):
    provider, exporter = spans
    with Admin(broker.url) as admin:
        admin.create_topic("orders", partitions=1)
    with TracingProducer(Producer(broker.url), tracer_provider=provider) as producer:
        producer.send("orders", b"one", headers={"app": b"kept"})
        producer.send("orders", b"two")
        producer.flush()

    failed_once: set[bytes] = set()
    seen: list[tuple[bytes, dict]] = []

    def handle(record):
        seen.append((record.value, dict(record.headers or {})))
        if record.value == b"two" and record.value not in failed_once:
            failed_once.add(record.value)
            raise RuntimeError("first try fails")

    with Consumer(broker.url, group="billing", topics=["orders"]) as consumer:
        consumer.run(traced_handler(handle, "billing", tracer_provider=provider),
                     stop=lambda: len(seen) >= 3)

    finished = exporter.get_finished_spans()
    processes = [span for span in finished if span.kind is SpanKind.CONSUMER]
    assert [span.name for span in processes] == ["process orders"] * 3
    send_ids = {span.context.span_id: span for span in finished if span.kind is SpanKind.PRODUCER}
    assert len(send_ids) == 2
    for span in processes:
        parent = send_ids[span.parent.span_id]  # the producer's span, through the headers
        assert span.context.trace_id == parent.context.trace_id
        assert span.attributes["messaging.system"] == "zbroker"
        assert span.attributes["messaging.consumer.group.name"] == "billing"
        assert span.attributes["messaging.destination.name"] == "orders"
    counts = sorted((span.attributes[DELIVERY_COUNT], span.status.status_code.name) for span in processes)
    # "one" once, "two" failed on its first delivery and succeeded on its second.
    assert counts == [(1, "ERROR"), (1, "UNSET"), (2, "UNSET")]
    assert seen[0][1]["app"] == b"kept" and "traceparent" in seen[0][1]


def test_the_asyncio_producer_injects_the_same_context(broker, spans):
    provider, exporter = spans
    with Admin(broker.url) as admin:
        admin.create_topic("events", partitions=1)

    async def produce():
        async with AsyncTracingProducer(AsyncProducer(broker.url), tracer_provider=provider) as producer:
            handle = await producer.send("events", b"x")
            await producer.flush()
            return handle

    asyncio.run(produce())
    got = []
    with Consumer(broker.url, group="g", topics=["events"]) as consumer:
        consumer.run(lambda record: got.append(record.headers), stop=lambda: bool(got))
    (send,) = [span for span in exporter.get_finished_spans() if span.kind is SpanKind.PRODUCER]
    traceparent = got[0]["traceparent"].decode()
    assert traceparent.split("-")[1] == format(send.context.trace_id, "032x")
    assert traceparent.split("-")[2] == format(send.context.span_id, "016x")
