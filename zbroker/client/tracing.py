"""OpenTelemetry tracing through record headers (the optional extra ``zbroker[otel]``).

Theory of operation
-------------------
A producer span's W3C trace context (``traceparent``, and ``tracestate`` when the
span has one) rides in the record's headers as ASCII bytes, the way Kafka's and
RabbitMQ's instrumentations carry it. A consumer extracts it and starts one
``process`` span per record as a child of the producer's span, so one trace runs
from the web handler that published an event to the worker that handled it, across
redeliveries: every delivery of a record is a span of its own, and the attribute
``messaging.zbroker.message.delivery_count`` (the lease's ``attempt``: 1 for the
first delivery) tells them apart. Attribute names follow the OpenTelemetry
messaging semantic conventions (``messaging.system``, ``messaging.operation.type``,
``messaging.destination.name``, ``messaging.destination.partition.id``,
``messaging.consumer.group.name``); the system-specific ones are named as the
conventions name Kafka's and Service Bus's (``messaging.<system>.*``).

Why wrappers, not hooks in the drivers: the clients' per-record paths are measured
in instructions (bench/PROFILE.md), and a user who does not trace must not pay even
an ``if tracer is not None`` per record. `TracingProducer` and `traced_handler`
wrap the public API, so tracing costs only those who ask for it, and the sync and
asyncio clients are served by the same code. This module imports ``opentelemetry``
at import time; nothing else in zbroker imports this module.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.trace import SpanKind

SYSTEM = "zbroker"
DELIVERY_COUNT = "messaging.zbroker.message.delivery_count"
OFFSET = "messaging.zbroker.message.offset"
REDELIVERY_REASON = "messaging.zbroker.message.redelivery_reason"
_TRACER_NAME = "zbroker"


class _HeaderSetter(Setter):
    """Record headers are ``str -> bytes``: trace context goes in as ASCII."""

    def set(self, carrier: dict, key: str, value: str) -> None:
        carrier[key] = value.encode("ascii")


class _HeaderGetter(Getter):
    def get(self, carrier: Mapping[str, bytes], key: str) -> list[str] | None:
        value = carrier.get(key)
        if value is None:
            return None
        try:
            return [bytes(value).decode("ascii")]
        except UnicodeDecodeError:  # not ours: a malformed header starts a new trace, it never fails the record
            return None

    def keys(self, carrier: Mapping[str, bytes]) -> list[str]:
        return list(carrier)


_SETTER, _GETTER = _HeaderSetter(), _HeaderGetter()


def inject(headers: Mapping[str, bytes] | None = None) -> dict[str, bytes]:
    """A copy of ``headers`` carrying the current span's trace context."""
    carrier = dict(headers or {})
    propagate.inject(carrier, setter=_SETTER)
    return carrier


def _tracer(tracer_provider: Any = None) -> trace.Tracer:
    return trace.get_tracer(_TRACER_NAME, tracer_provider=tracer_provider)


def _send_attributes(topic: str, partition: int | None, value: bytes) -> dict[str, Any]:
    attributes: dict[str, Any] = {"messaging.system": SYSTEM, "messaging.operation.type": "send",
                                  "messaging.operation.name": "send", "messaging.destination.name": topic,
                                  "messaging.message.body.size": len(value)}
    if partition is not None:
        attributes["messaging.destination.partition.id"] = str(partition)
    return attributes


class TracingProducer:
    """A `Producer` (sync) whose ``send`` starts a ``send {topic}`` span and injects its context.

    Everything else is the wrapped producer's: ``flush``, ``close``, the context manager.
    """

    def __init__(self, producer: Any, *, tracer_provider: Any = None) -> None:
        self._producer = producer
        self._tracer = _tracer(tracer_provider)

    def send(self, topic: str, value: bytes, key: bytes | None = None, headers: dict | None = None,
             partition: int | None = None, **options: Any) -> Any:
        with self._tracer.start_as_current_span(f"send {topic}", kind=SpanKind.PRODUCER,
                                                attributes=_send_attributes(topic, partition, value)):
            return self._producer.send(topic, value, key=key, headers=inject(headers), partition=partition,
                                       **options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def __enter__(self) -> "TracingProducer":
        self._producer.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._producer.__exit__(*exc)


class AsyncTracingProducer(TracingProducer):
    """The asyncio twin: ``await producer.send(...)`` inside the span."""

    async def send(self, topic: str, value: bytes, key: bytes | None = None,  # type: ignore[override]
                   headers: dict | None = None, partition: int | None = None, **options: Any) -> Any:
        with self._tracer.start_as_current_span(f"send {topic}", kind=SpanKind.PRODUCER,
                                                attributes=_send_attributes(topic, partition, value)):
            return await self._producer.send(topic, value, key=key, headers=inject(headers),
                                             partition=partition, **options)

    async def __aenter__(self) -> "AsyncTracingProducer":
        await self._producer.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> Any:
        return await self._producer.__aexit__(*exc)


@contextmanager
def process_span(record: Any, group: str, *, tracer_provider: Any = None) -> Iterator[trace.Span]:
    """A ``process {topic}`` span for one delivered record, child of its producer's span.

    An exception leaving the block is recorded on the span and marks it as an error
    (OpenTelemetry's default), then propagates: the consumer's nack is unchanged.
    """
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM, "messaging.operation.type": "process", "messaging.operation.name": "process",
        "messaging.destination.name": record.topic, "messaging.destination.partition.id": str(record.partition),
        "messaging.consumer.group.name": group, "messaging.message.body.size": len(record.value),
        OFFSET: record.offset,
    }
    attempt = getattr(record, "attempt", None)
    if attempt is not None:
        attributes[DELIVERY_COUNT] = attempt
        if attempt > 1 and getattr(record, "reason", ""):
            attributes[REDELIVERY_REASON] = record.reason
    parent = propagate.extract(record.headers or {}, getter=_GETTER)
    with _tracer(tracer_provider).start_as_current_span(f"process {record.topic}", context=parent,
                                                        kind=SpanKind.CONSUMER, attributes=attributes) as span:
        yield span


def traced_handler(handler: Callable[[Any], Any], group: str, *, tracer_provider: Any = None) -> Callable:
    """``handler`` for `Consumer.run`, each call inside a `process_span`; async handlers stay async."""
    if inspect.iscoroutinefunction(handler):
        @functools.wraps(handler)
        async def run_async(record: Any) -> Any:
            with process_span(record, group, tracer_provider=tracer_provider):
                return await handler(record)
        return run_async

    @functools.wraps(handler)
    def run(record: Any) -> Any:
        with process_span(record, group, tracer_provider=tracer_provider):
            return handler(record)
    return run
