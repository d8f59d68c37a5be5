"""OpenTelemetry tracing: setup, the span names, and W3C trace context in NATS message headers.

`setup_tracing(service, run_dir=..., endpoint=..., protocol=...)` installs the global tracer
provider once per process. Spans go to an OTLP collector when an endpoint is configured (or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT` is set), over gRPC (port
4317) or HTTP (port 4318); otherwise to `<run_dir>/traces/<service>.jsonl` in OTLP-JSON, one
`ExportTraceServiceRequest` per line, which is what the OpenTelemetry collector's file exporter
writes and its `otlpjsonfile` receiver reads. Without setup, every helper below is a cheap no-op.

One trace per step (docs/observability.md): the orchestrator opens a root span per step
(`orchestrator.step`); the tasks it issues for that step, their rollouts, the HTTP calls to vLLM,
the batch, the trainer's step, the weights publish and every replica's weight load descend from
it. Span names are fixed strings (`SPAN_NAMES`); the run, step, replica and subject go in
attributes, so a trace backend's operation list stays short.

There is no official OpenTelemetry instrumentation for nats-py, so `rlbus.bus` calls these
helpers itself: `producer_span()` wraps a publish and injects `traceparent` into its headers;
`consumer_span()` starts the handler's span as a child of the producer's. A message built from
many others (a batch from rollouts) should not pick one parent: pass all their headers as
`links_from` and the span links to each (fan-in). A publish or delivery outside any trace
(a heartbeat, a metrics event) records no span: single-span traces are noise.
"""

from __future__ import annotations

import base64
import json
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import INVALID_SPAN, Link, Span, SpanKind
from opentelemetry.util.types import AttributeValue

if TYPE_CHECKING:  # the SDK and protobuf load only where a process traces (setup_tracing)
    from google.protobuf.message import Message
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

TRACER_NAME = "rlbus"

Protocol = Literal["grpc", "http/protobuf"]
PROTOCOLS: tuple[str, ...] = ("grpc", "http/protobuf")

# Span names (low-cardinality): the run id, step, replica and subject are attributes.
STEP = "orchestrator.step"
ROLLOUT = "orchestrator.rollout"
GENERATE = "orchestrator.generate"
SCORE = "orchestrator.score"
BATCH = "orchestrator.batch"
HTTP_SERVER = "inference.http"
WEIGHTS_LOAD = "inference.weights_load"
TRAIN_STEP = "trainer.step"
CHECKPOINT = "trainer.checkpoint"
WEIGHTS_PUBLISH = "trainer.weights_publish"
SPAN_NAMES = (
    STEP,
    ROLLOUT,
    GENERATE,
    SCORE,
    BATCH,
    HTTP_SERVER,
    WEIGHTS_LOAD,
    TRAIN_STEP,
    CHECKPOINT,
    WEIGHTS_PUBLISH,
)
"""Our own spans; the bus adds `publish <family>` / `process <family>` / `notify <family>` with
the subject's family (`Subjects.family`: `batches.*`, `events.weights.published`), and vLLM adds
`llm_request` when its tracing is on."""

# Attribute keys.
RUN_ID = "rlbus.run_id"
STEP_ATTR = "rlbus.step"
TASK_ID = "rlbus.task_id"
REPLICA = "rlbus.replica_id"
VERSION = "rlbus.weights.version"

_provider_lock = threading.Lock()
_provider: TracerProvider | None = None


# ---- the OTLP-JSON file ----------------------------------------------------------------------

_ID_FIELDS = frozenset({"traceId", "spanId", "parentSpanId"})


def _hex_ids(node: Any) -> Any:
    """Protobuf's JSON mapping writes bytes as base64; OTLP-JSON wants trace and span ids hex."""
    if isinstance(node, dict):
        return {
            key: base64.b64decode(value).hex()
            if key in _ID_FIELDS and isinstance(value, str)
            else _hex_ids(value)
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_hex_ids(item) for item in node]
    return node


def otlp_json(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    """Finished SDK spans as one OTLP-JSON `ExportTraceServiceRequest` (the OTLP/HTTP JSON body)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    return request_json(encode_spans(spans))


def request_json(request: Message) -> dict[str, Any]:
    """A protobuf `ExportTraceServiceRequest` in OTLP-JSON form (hex ids, integer enums)."""
    from google.protobuf.json_format import MessageToDict

    return _hex_ids(MessageToDict(request, use_integers_for_enums=True))


def read_otlp_json(path: str | Path) -> list[dict]:
    """The spans of an OTLP-JSON lines file, each with its resource's `service.name` added as
    `service` (for tests and `rl-trace`)."""
    spans = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            spans.extend(spans_of_request(json.loads(line)))
    return spans


def spans_of_request(request: dict) -> list[dict]:
    """The spans of one OTLP-JSON `ExportTraceServiceRequest`, with `service` set."""
    spans = []
    for resource_spans in request.get("resourceSpans", []):
        attributes = attribute_map(resource_spans.get("resource", {}).get("attributes", []))
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                spans.append({**span, "service": attributes.get("service.name", "")})
    return spans


def attribute_map(attributes: list[dict]) -> dict:
    """OTLP `[{"key": k, "value": {"stringValue": v}}]` -> `{k: v}` (scalar values)."""
    out = {}
    for item in attributes:
        value = item.get("value", {})
        out[item["key"]] = next(iter(value.values()), None) if value else None
    return out


class OtlpJsonFileExporter:
    """SpanExporter appending one OTLP-JSON `ExportTraceServiceRequest` per line to a file (used
    without an OTLP endpoint); the collector's `otlpjsonfile` receiver reads it back."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        from opentelemetry.sdk.trace.export import SpanExportResult

        line = json.dumps(otlp_json(spans), separators=(",", ":"))
        # Created on the first span only: a process that traces nothing leaves no traces/ dir.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock, open(self.path, "a") as out:
            out.write(line + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


# ---- setup -----------------------------------------------------------------------------------


def otlp_endpoint(endpoint: str | None = None) -> str | None:
    """The configured endpoint, else the standard OpenTelemetry variables, else None."""
    return (
        endpoint
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or None
    )


def otlp_protocol(protocol: str | None = None) -> str:
    """The configured protocol, else `OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`, else http/protobuf
    (OpenTelemetry's default); `ValueError` naming the choices for anything else."""
    protocol = (
        protocol
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    if protocol not in PROTOCOLS:
        raise ValueError(
            f"otel.protocol (or OTEL_EXPORTER_OTLP_PROTOCOL) is {protocol!r}: use one of "
            + ", ".join(PROTOCOLS)
        )
    return protocol


def otlp_traces_endpoint(endpoint: str) -> str:
    """OTLP/HTTP base URL -> its traces URL (`.../v1/traces`)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else f"{endpoint}/v1/traces"


def span_exporter(endpoint: str, protocol: str) -> SpanExporter:
    """The OTLP exporter for `endpoint` over `protocol` (gRPC: `host:4317`; HTTP: base URL)."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcSpanExporter,
        )

        insecure = not endpoint.startswith("https://")
        return GrpcSpanExporter(endpoint=endpoint, insecure=insecure)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpSpanExporter,
    )

    return HttpSpanExporter(endpoint=otlp_traces_endpoint(endpoint))


def service_attributes(service: str) -> dict[str, str]:
    """Resource attributes of process `service`: numbered copies (`inference-1`, the launcher's
    names for replicas) share one `service.name` and differ by `service.instance.id`."""
    family, _, index = service.rpartition("-")
    if family and index.isdigit():
        return {"service.name": family, "service.instance.id": service}
    return {"service.name": service}


def setup_tracing(
    service: str,
    *,
    run_dir: str | Path | None = None,
    endpoint: str | None = None,
    protocol: str | None = None,
    enabled: bool = True,
    run_id: str | None = None,
) -> TracerProvider | None:
    """Install the process's tracer provider; returns it (None when tracing is off or no sink exists).

    `service` is the process's name (`service_attributes`; the OTLP-JSON file without an
    endpoint is `<run_dir>/traces/<service>.jsonl`). Calling
    it again returns the provider of the first call (OpenTelemetry allows one per process).
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

        endpoint = otlp_endpoint(endpoint)
        if endpoint:
            exporter = span_exporter(endpoint, otlp_protocol(protocol))
        elif run_dir is not None:
            # a SpanExporter by its methods: subclassing would load the SDK with this module
            exporter = cast(
                "SpanExporter",
                OtlpJsonFileExporter(Path(run_dir) / "traces" / f"{service}.jsonl"),
            )
        else:
            return None
        attributes = service_attributes(service)
        if run_id:
            attributes[RUN_ID] = run_id
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


# ---- context in headers ----------------------------------------------------------------------


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


def in_trace(context: otel_context.Context | None = None) -> bool:
    """Whether `context` (default: the current one) holds a valid span: something to descend from."""
    return trace.get_current_span(context).get_span_context().is_valid


@contextmanager
def use_context(context: otel_context.Context | None) -> Iterator[None]:
    """Make `context` current inside the block (nothing changes for None)."""
    if context is None:
        yield
        return
    token = otel_context.attach(context)
    try:
        yield
    finally:
        otel_context.detach(token)


@contextmanager
def span(
    name: str,
    *,
    context: otel_context.Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    links: Sequence[Link] = (),
    attributes: Mapping[str, AttributeValue] | None = None,
    root: bool = False,
) -> Iterator[Span]:
    """A span named `name`, child of `context` (default: the current span), made current.

    Outside any trace (no valid parent) it records nothing unless `root` is set: the spans that
    start a trace (`orchestrator.step`) say so, everything else joins one or stays silent.
    """
    if not enabled() or (not root and not links and not in_trace(context)):
        yield INVALID_SPAN
        return
    with tracer().start_as_current_span(
        name, context=context, kind=kind, links=links, attributes=dict(attributes or {})
    ) as current:
        yield current


@contextmanager
def producer_span(
    name: str, *, subject: str, headers: dict[str, str], msg_id: str | None = None
) -> Iterator[Span]:
    """A PRODUCER span around a publish inside a trace; its context is injected into `headers`."""
    attributes = {"messaging.system": "nats", "messaging.destination.name": subject}
    if msg_id is not None:
        attributes["messaging.message.id"] = msg_id
    with span(name, kind=SpanKind.PRODUCER, attributes=attributes) as current:
        if current.get_span_context().is_valid:
            inject_headers(headers)
        yield current


@contextmanager
def consumer_span(
    name: str,
    *,
    headers: Mapping[str, str] | None = None,
    links_from: Iterable[Mapping[str, str] | None] = (),
    subject: str | None = None,
    attributes: Mapping[str, AttributeValue] | None = None,
) -> Iterator[Span]:
    """A CONSUMER span: child of the producer in `headers`, linked to every producer in
    `links_from`; nothing when the message came from outside any trace."""
    links = [link for link in map(link_from_headers, links_from) if link is not None]
    span_attributes: dict[str, AttributeValue] = {"messaging.system": "nats", **(attributes or {})}
    if subject is not None:
        span_attributes["messaging.destination.name"] = subject
    parent = extract_context(headers) if headers else None
    with span(
        name, context=parent, kind=SpanKind.CONSUMER, links=links, attributes=span_attributes
    ) as current:
        yield current


def add_trace_ids(
    logger: object, method_name: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """structlog processor: add `trace_id` / `span_id` of the current span (when one is recording)."""
    span_context = trace.get_current_span().get_span_context()
    if span_context.is_valid:
        event_dict.setdefault("trace_id", format(span_context.trace_id, "032x"))
        event_dict.setdefault("span_id", format(span_context.span_id, "016x"))
    return event_dict
