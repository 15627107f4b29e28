"""OpenTelemetry tracing for zbroker clients (the optional extra ``zbroker[otel]``).

Theory of operation
-------------------
W3C trace context travels in record headers (``traceparent``, and ``tracestate``
when there is one), as the messaging semantic conventions say. Two wrappers:

* `TracingProducer(producer)`: each ``send`` runs in a PRODUCER span
  ``send <topic>`` and injects that span's context into the record's headers.
* `TracingConsumer(consumer)`: each record a ``poll`` returns gets a CONSUMER span
  ``process <topic>``, a child of the context its headers carry, with the delivery
  count (`ConsumedRecord.attempt`) as ``messaging.zbroker.message.delivery_count``
  (the conventions name delivery counts per system, like
  ``messaging.servicebus.message.delivery_count``). The span ends when the record
  is acked (status unset), or nacked or rejected (status ERROR, the reason as its
  description); ``use(record)`` makes it the current span around the handler.

Nothing here is imported by the client: code that does not wrap its producer or
consumer runs exactly the code it ran before, so the hot path costs nothing when
the extra is not used. Spans go to the tracer provider given, else the global one.
"""

from __future__ import annotations

from typing import Any, Iterable

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

SYSTEM = "zbroker"
DELIVERY_COUNT = "messaging.zbroker.message.delivery_count"
OFFSET = "messaging.zbroker.message.offset"
TRACE_HEADERS = ("traceparent", "tracestate")
_W3C = TraceContextTextMapPropagator()


def _tracer(provider: Any) -> trace.Tracer:
    from importlib.metadata import version
    return trace.get_tracer("zbroker", version("zbroker"), tracer_provider=provider)


def context_from_headers(headers: dict | None):
    """The trace context a record's headers carry (an empty one when none)."""
    carrier = {}
    for name in TRACE_HEADERS:
        value = (headers or {}).get(name)
        if value is not None:
            carrier[name] = value.decode("ascii", "replace") if isinstance(value, (bytes, bytearray)) else str(value)
    return _W3C.extract(carrier)


class TracingProducer:
    """A producer whose sends are traced; everything else is the wrapped producer's."""

    def __init__(self, producer: Any, *, tracer_provider: Any = None) -> None:
        self._producer = producer
        self._tracer = _tracer(tracer_provider)

    def send(self, topic: str, value: bytes, key: bytes | None = None, headers: dict | None = None,
             partition: int | None = None, timestamp_ms: int | None = None):
        attributes = {"messaging.system": SYSTEM, "messaging.destination.name": topic,
                      "messaging.operation.type": "send", "messaging.operation.name": "send"}
        if partition is not None:
            attributes["messaging.destination.partition.id"] = str(partition)
        with self._tracer.start_as_current_span(f"send {topic}", kind=SpanKind.PRODUCER, attributes=attributes):
            carrier: dict[str, str] = {}
            _W3C.inject(carrier)
            headers = {**(headers or {}), **{k: v.encode() for k, v in carrier.items()}}
            return self._producer.send(topic, value, key=key, headers=headers, partition=partition,
                                       timestamp_ms=timestamp_ms)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def __enter__(self) -> "TracingProducer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._producer.close()


class TracingConsumer:
    """A consumer whose records each get a span, ended by their ack, nack or reject."""

    def __init__(self, consumer: Any, *, tracer_provider: Any = None) -> None:
        self._consumer = consumer
        self._tracer = _tracer(tracer_provider)
        self._spans: dict[tuple, trace.Span] = {}

    def poll(self, *args: Any, **kwargs: Any) -> list:
        records = self._consumer.poll(*args, **kwargs)
        for record in records:
            self._spans[_key(record)] = self._tracer.start_span(
                f"process {record.topic}", context=context_from_headers(record.headers), kind=SpanKind.CONSUMER,
                attributes={"messaging.system": SYSTEM, "messaging.destination.name": record.topic,
                            "messaging.destination.partition.id": str(record.partition),
                            "messaging.consumer.group.name": self._consumer.group,
                            "messaging.operation.type": "process", "messaging.operation.name": "process",
                            OFFSET: record.offset, DELIVERY_COUNT: record.attempt})
        return records

    def span(self, record: Any) -> trace.Span:
        """The span of a record this consumer polled and has not finished."""
        return self._spans[_key(record)]

    def use(self, record: Any):
        """``with consumer.use(record):`` the record's span is the current one (not ended on exit)."""
        return trace.use_span(self.span(record), end_on_exit=False)

    def ack(self, record: Any) -> None:
        self._consumer.ack(record)
        self._end([record], None)

    def ack_many(self, records: Iterable[Any]) -> None:
        records = list(records)
        self._consumer.ack_many(records)
        self._end(records, None)

    def nack(self, records: Iterable[Any], **kwargs: Any) -> int:
        records = list(records)
        applied = self._consumer.nack(records, **kwargs)
        self._end(records, f"nack: {kwargs.get('reason', '')}")
        return applied

    def reject(self, records: Iterable[Any], **kwargs: Any) -> int:
        records = list(records)
        applied = self._consumer.reject(records, **kwargs)
        self._end(records, f"reject: {kwargs.get('reason', '')}")
        return applied

    def _end(self, records: list, error: str | None) -> None:
        for record in records:
            span = self._spans.pop(_key(record), None)
            if span is None:
                continue
            if error is not None:
                span.set_status(Status(StatusCode.ERROR, error))
            span.end()

    def close(self, *args: Any, **kwargs: Any) -> None:
        """Close the consumer; spans of records never finished end unset (they will be redelivered)."""
        try:
            self._consumer.close(*args, **kwargs)
        finally:
            for span in self._spans.values():
                span.end()
            self._spans.clear()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)

    def __enter__(self) -> "TracingConsumer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _key(record: Any) -> tuple:
    return record.topic, record.partition, record.offset, record.lease_id


__all__ = ["TracingConsumer", "TracingProducer", "context_from_headers"]
