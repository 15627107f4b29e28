"""zbroker[otel] against a real broker: traceparent travels in the record headers, and each
consumed record gets a CONSUMER span, child of its PRODUCER span, with the delivery count."""

from __future__ import annotations

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the test extra installs opentelemetry-sdk")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind, StatusCode  # noqa: E402

from zbroker.client import Admin, Consumer, Producer  # noqa: E402
from zbroker.otel import DELIVERY_COUNT, TracingConsumer, TracingProducer  # noqa: E402
from tests.integration.test_consumer_groups import drain  # noqa: E402

pytestmark = pytest.mark.processes


def test_a_record_carries_its_trace_and_each_delivery_is_a_counted_span(broker):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with Admin(broker.url) as admin:
        admin.create_topic("traced", partitions=1)
    with tracer.start_as_current_span("request") as root, \
            TracingProducer(Producer(broker.url, linger_ms=1), tracer_provider=provider) as producer:
        producer.send("traced", b"a", headers={"own": b"1"})
        producer.send("traced", b"b")
        producer.flush()
    sends = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.PRODUCER]
    assert [s.name for s in sends] == ["send traced", "send traced"]
    assert all(s.parent.span_id == root.get_span_context().span_id for s in sends)

    with TracingConsumer(Consumer(broker.url, group="tracers", topics=["traced"]),
                         tracer_provider=provider) as consumer:
        first = drain(consumer, 2, ack=False)
        assert first[0].headers["own"] == b"1" and first[0].headers["traceparent"].startswith(b"00-")
        with consumer.use(first[0]):
            from opentelemetry import trace
            assert trace.get_current_span() is consumer.span(first[0])
        consumer.ack(first[0])
        consumer.nack([first[1]], reason="later")
        [again] = drain(consumer, 1, ack=False)
        consumer.ack(again)
        consumer.flush_acks()

    process = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.CONSUMER]
    assert len(process) == 3
    by_send = {s.context.span_id: s for s in sends}
    for span in process:
        assert span.name == "process traced"
        assert span.context.trace_id == root.get_span_context().trace_id
        assert span.parent.span_id in by_send  # the child of the send that produced the record
        attrs = span.attributes
        assert (attrs["messaging.system"], attrs["messaging.destination.name"], attrs["messaging.operation.type"],
                attrs["messaging.consumer.group.name"]) == ("zbroker", "traced", "process", "tracers")
    counts = sorted((s.attributes["messaging.zbroker.message.offset"], s.attributes[DELIVERY_COUNT],
                     s.status.status_code) for s in process)
    assert counts == [(0, 1, StatusCode.UNSET), (1, 1, StatusCode.ERROR), (1, 2, StatusCode.UNSET)]


def test_the_client_does_not_import_opentelemetry():
    import subprocess
    import sys
    code = ("import sys, zbroker.client, zbroker.client.aio, zbroker.cli; "
            "print(any(m.startswith('opentelemetry') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
