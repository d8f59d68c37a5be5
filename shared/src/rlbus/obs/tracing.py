"""OpenTelemetry tracing: setup, and W3C trace context carried in NATS message headers.

`setup_tracing(service, run_dir=..., endpoint=...)` installs the global tracer provider once per
process: spans go to an OTLP/HTTP collector when an endpoint is configured (or
`OTEL_EXPORTER_OTLP_ENDPOINT` is set), otherwise to `<run_dir>/traces/<service>.jsonl`, one span
per line. Without setup, every helper below is a cheap no-op (OpenTelemetry's default provider).

There is no official OpenTelemetry instrumentation for nats-py, so `rlbus.bus` calls these
helpers itself: `producer_span()` wraps a publish and injects `traceparent` into its headers;
`consumer_span()` starts the handler's span as a child of the producer's. A message built from
many others (a batch from rollouts) should not pick one parent: pass all their headers as
`links_from` and the span links to each (fan-in).
"""

import json
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, Span, SpanKind

TRACER_NAME = "rlbus"

_provider_lock = threading.Lock()
_provider = None


class JsonlSpanExporter:
    """SpanExporter writing one JSON object per span to a file (used without an OTLP endpoint)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()

    def export(self, spans: Sequence) -> "object":
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = [
            json.dumps(json.loads(span.to_json(indent=None)), separators=(",", ":"))
            for span in spans
        ]
        # Created on the first span only: a process that traces nothing leaves no traces/ dir.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock, open(self.path, "a") as out:
            out.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def otlp_traces_endpoint(endpoint: str) -> str:
    """OTLP/HTTP base URL -> its traces URL (`.../v1/traces`)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else f"{endpoint}/v1/traces"


def setup_tracing(
    service: str,
    *,
    run_dir: str | Path | None = None,
    endpoint: str | None = None,
    enabled: bool = True,
    run_id: str | None = None,
):
    """Install the process's tracer provider; returns it (None when tracing is off or no sink exists).

    Calling it again returns the provider of the first call (OpenTelemetry allows one per process).
    """
    global _provider
    if not enabled:
        return None
    with _provider_lock:
        if _provider is not None:
            return _provider
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        endpoint = (
            endpoint
            or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        )
        if endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=otlp_traces_endpoint(endpoint))
        elif run_dir is not None:
            exporter = JsonlSpanExporter(Path(run_dir) / "traces" / f"{service}.jsonl")
        else:
            return None
        attributes = {"service.name": service}
        if run_id:
            attributes["rlbus.run_id"] = run_id
        provider = TracerProvider(resource=Resource.create(attributes))
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=1000))
        trace.set_tracer_provider(provider)
        _provider = provider
        return provider


def shutdown_tracing() -> None:
    """Flush and stop the exporter (call at service exit)."""
    if _provider is not None:
        _provider.shutdown()


def enabled() -> bool:
    """Whether spans are recorded (a real provider is installed); the bus skips span work otherwise."""
    return _provider is not None or not isinstance(
        trace.get_tracer_provider(), trace.ProxyTracerProvider
    )


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Add the current span's W3C context (`traceparent`, `tracestate`) to `headers`."""
    headers = {} if headers is None else headers
    propagate.inject(headers)
    return headers


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The trace context carried by message headers (empty context when there is none)."""
    return propagate.extract(headers or {})


def link_from_headers(headers: Mapping[str, str] | None) -> Link | None:
    """A span link to the producer span recorded in `headers`, if any."""
    span_context = trace.get_current_span(extract_context(headers)).get_span_context()
    return Link(span_context) if span_context.is_valid else None


@contextmanager
def producer_span(
    name: str, *, subject: str, headers: dict[str, str], msg_id: str | None = None
) -> Iterator[Span]:
    """A PRODUCER span around a publish; its context is injected into `headers`."""
    attributes = {"messaging.system": "nats", "messaging.destination.name": subject}
    if msg_id is not None:
        attributes["messaging.message.id"] = msg_id
    with tracer().start_as_current_span(
        name, kind=SpanKind.PRODUCER, attributes=attributes
    ) as span:
        inject_headers(headers)
        yield span


@contextmanager
def consumer_span(
    name: str,
    *,
    headers: Mapping[str, str] | None = None,
    links_from: Iterable[Mapping[str, str] | None] = (),
    subject: str | None = None,
) -> Iterator[Span]:
    """A CONSUMER span: child of the producer in `headers`, linked to every producer in `links_from`."""
    links = [link for link in map(link_from_headers, links_from) if link is not None]
    attributes = {"messaging.system": "nats"}
    if subject is not None:
        attributes["messaging.destination.name"] = subject
    parent = extract_context(headers) if headers else None
    with tracer().start_as_current_span(
        name, context=parent, kind=SpanKind.CONSUMER, links=links, attributes=attributes
    ) as span:
        yield span


def add_trace_ids(logger, method_name: str, event_dict: dict) -> dict:
    """structlog processor: add `trace_id` / `span_id` of the current span (when one is recording)."""
    span_context = trace.get_current_span().get_span_context()
    if span_context.is_valid:
        event_dict.setdefault("trace_id", format(span_context.trace_id, "032x"))
        event_dict.setdefault("span_id", format(span_context.span_id, "016x"))
    return event_dict
