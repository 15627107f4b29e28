"""zbroker.client.tracing without a broker: what goes into headers, and what a consumer makes of them."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from zbroker.client.core import ConsumedRecord
from zbroker.client.tracing import DELIVERY_COUNT, REDELIVERY_REASON, inject, process_span, traced_handler


@pytest.fixture
def provider():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    provider.exporter = exporter
    yield provider
    provider.shutdown()


def record(headers, attempt=1, reason=""):
    return ConsumedRecord("t", 3, 41, 0, None, b"value", headers, 7, attempt, reason)


def test_inject_copies_the_headers_and_adds_ascii_bytes(provider):
    mine = {"app": b"1"}
    with provider.get_tracer("t").start_as_current_span("outer") as span:
        carried = inject(mine)
    assert mine == {"app": b"1"}, "the caller's dict is not changed"
    version, trace_id, span_id, flags = carried["traceparent"].decode("ascii").split("-")
    assert (version, int(trace_id, 16), int(span_id, 16)) == ("00", span.context.trace_id, span.context.span_id)
    assert inject(None) == {}, "no current span: nothing to carry"


@pytest.mark.parametrize("bad", [b"\xff\xfe", b"00-zz-yy-01", b""])
def test_a_malformed_traceparent_starts_a_new_trace_and_never_fails_the_record(provider, bad):
    with process_span(record({"traceparent": bad}), "g", tracer_provider=provider):
        pass
    (span,) = provider.exporter.get_finished_spans()
    assert span.parent is None


def test_a_redelivery_carries_its_count_and_reason(provider):
    handler = traced_handler(lambda r: r.offset, "g", tracer_provider=provider)
    assert handler(record(None, attempt=3, reason="lease_expired")) == 41
    (span,) = provider.exporter.get_finished_spans()
    assert span.attributes[DELIVERY_COUNT] == 3
    assert span.attributes[REDELIVERY_REASON] == "lease_expired"
    assert span.attributes["messaging.destination.partition.id"] == "3"


def test_an_async_handler_stays_async(provider):
    import asyncio

    async def handle(r):
        return r.value

    wrapped = traced_handler(handle, "g", tracer_provider=provider)
    assert asyncio.run(wrapped(record(None))) == b"value"
    assert len(provider.exporter.get_finished_spans()) == 1


@pytest.mark.processes  # a fresh interpreter: this one has imported opentelemetry already
def test_a_client_that_does_not_trace_imports_nothing_of_opentelemetry():
    import subprocess
    import sys
    code = ("import sys, zbroker.client, zbroker.client.aio, zbroker.client.sync; "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
