"""Trace context crosses the bus: producer span -> consumer span (parent), fan-in links, no spans
outside a trace, low-cardinality names, the OTLP-JSON file, the OTLP exporters."""

import asyncio
import json

import pytest
from bus_factories import make_task
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from rlbus.obs import tracing
from rlbus.wire import tasks


@pytest.fixture
def spans(monkeypatch):
    """Route rlbus spans to an in-memory exporter (without touching the process-global provider)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "tracer", lambda: provider.get_tracer("test"))
    monkeypatch.setattr(tracing, "enabled", lambda: True)
    return exporter


async def consume(bus, count: int, **kwargs) -> list:
    deliveries = []
    done = asyncio.Event()

    async def handle(delivery):
        with tracing.tracer().start_as_current_span("rollout"):
            pass
        deliveries.append(delivery)
        if len(deliveries) == count:
            done.set()

    s = bus.subjects
    async with bus.consumer(s.tasks_stream, s.tasks_durable, tasks.decoder, handle, **kwargs):
        await asyncio.wait_for(done.wait(), 10)
    return deliveries


async def test_consumer_span_is_child_of_the_producer_span(bus, spans):
    with tracing.span(tracing.STEP, root=True):
        await bus.publish(bus.subjects.tasks, make_task(0), msg_id="0-0")
    await consume(bus, 1)
    by_name = {span.name: span for span in spans.get_finished_spans()}
    producer = by_name["publish tasks"]
    consumer = by_name["process tasks"]
    inner = by_name["rollout"]
    assert producer.kind == SpanKind.PRODUCER and consumer.kind == SpanKind.CONSUMER
    assert consumer.parent.span_id == producer.context.span_id
    assert consumer.context.trace_id == producer.context.trace_id
    assert inner.parent.span_id == consumer.context.span_id
    assert producer.attributes["messaging.message.id"] == "0-0"


async def test_a_publish_outside_any_trace_records_no_span(bus, spans):
    await bus.publish(bus.subjects.tasks, make_task(0), msg_id="0-0")
    (delivery,) = await consume(bus, 1)
    assert "traceparent" not in (delivery.headers or {})
    # The handler's own span has no parent to join either: nothing at all was recorded.
    assert [s.name for s in spans.get_finished_spans()] == ["rollout"]


async def test_span_names_carry_no_run_id_or_step(bus, spans):
    with tracing.span(tracing.STEP, root=True):
        await bus.publish(bus.subjects.batch(17), make_task(0), msg_id="b-17")
        await bus.publish_many([(bus.subjects.tasks, make_task(1), "t-1")])
    names = {s.name for s in spans.get_finished_spans()}
    assert names == {tracing.STEP, "publish batches.*", "publish tasks"}
    published = [s for s in spans.get_finished_spans() if s.name == "publish batches.*"]
    assert published[0].attributes["messaging.destination.name"] == bus.subjects.batch(17)


async def test_fan_in_span_links_every_producer(bus, spans):
    for index in range(3):
        with tracing.span(tracing.STEP, root=True):
            await bus.publish(bus.subjects.tasks, make_task(index), msg_id=f"0-{index}")
    deliveries = await consume(bus, 3, concurrency=3)
    with tracing.consumer_span("build batch", links_from=[d.headers for d in deliveries]):
        pass
    finished = spans.get_finished_spans()
    producers = {s.context.span_id for s in finished if s.kind == SpanKind.PRODUCER}
    (batch_span,) = [s for s in finished if s.name == "build batch"]
    assert {link.context.span_id for link in batch_span.links} == producers
    assert len(producers) == 3


def test_the_trace_file_is_otlp_json_one_request_per_line(tmp_path):
    path = tmp_path / "traces" / "trainer.jsonl"
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(tracing.OtlpJsonFileExporter(path)))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("trainer.step", attributes={"rlbus.step": 3}) as outer:
        with tracer.start_as_current_span("trainer.checkpoint"):
            pass
    requests = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(requests) == 2  # SimpleSpanProcessor exports each span alone
    inner, step = (r["resourceSpans"][0]["scopeSpans"][0]["spans"][0] for r in requests)
    assert (inner["name"], step["name"]) == ("trainer.checkpoint", "trainer.step")
    # OTLP-JSON: hex ids (not protobuf's base64), integer enums, lowerCamelCase keys.
    assert step["traceId"] == format(outer.get_span_context().trace_id, "032x")
    assert (
        inner["parentSpanId"] == step["spanId"] == format(outer.get_span_context().span_id, "016x")
    )
    assert step["kind"] == 1 and int(step["endTimeUnixNano"]) >= int(step["startTimeUnixNano"])
    assert step["attributes"] == [{"key": "rlbus.step", "value": {"intValue": "3"}}]
    # It parses as an ExportTraceServiceRequest, which is what the collector's file receiver needs.
    from google.protobuf.json_format import Parse
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    parsed = Parse(path.read_text().splitlines()[1], ExportTraceServiceRequest())
    assert parsed.resource_spans[0].scope_spans[0].spans[0].name == "trainer.step"
    assert [s["name"] for s in tracing.read_otlp_json(path)] == [
        "trainer.checkpoint",
        "trainer.step",
    ]


def test_setup_tracing_without_endpoint_or_run_dir_is_off(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.setattr(tracing, "_provider", None)
    assert tracing.setup_tracing("svc") is None
    assert tracing.setup_tracing("svc", run_dir="/x", enabled=False) is None


def test_otlp_protocol_comes_from_config_then_environment(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    assert tracing.otlp_protocol() == "http/protobuf"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert tracing.otlp_protocol() == "grpc"
    assert tracing.otlp_protocol("http/protobuf") == "http/protobuf"
    with pytest.raises(ValueError, match="otel.protocol .* 'http/json': use one of grpc"):
        tracing.otlp_protocol("http/json")


def test_otlp_endpoint_gets_the_traces_path():
    assert tracing.otlp_traces_endpoint("http://c:4318") == "http://c:4318/v1/traces"
    assert tracing.otlp_traces_endpoint("http://c:4318/v1/traces") == "http://c:4318/v1/traces"


def test_log_processor_adds_the_current_trace_id(spans):
    assert tracing.add_trace_ids(None, "info", {"event": "x"}) == {"event": "x"}
    with tracing.tracer().start_as_current_span("step") as span:
        event = tracing.add_trace_ids(None, "info", {"event": "x"})
    assert event["trace_id"] == format(span.get_span_context().trace_id, "032x")


@pytest.mark.parametrize(("protocol", "via"), [("grpc", "grpc"), ("http/protobuf", "http")])
def test_spans_reach_an_otlp_receiver(protocol, via):
    from opentelemetry.sdk.resources import Resource
    from otlp_receiver import OtlpReceiver

    receiver = OtlpReceiver().start()
    try:
        endpoint = receiver.grpc_endpoint if via == "grpc" else receiver.http_endpoint
        resource = Resource.create(tracing.service_attributes("inference-1"))
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(
            SimpleSpanProcessor(tracing.span_exporter(endpoint, tracing.otlp_protocol(protocol)))
        )
        with provider.get_tracer("test").start_as_current_span(tracing.WEIGHTS_LOAD):
            pass
        provider.shutdown()
        (span,) = receiver.snapshot()
        assert (span["name"], span["service"]) == (tracing.WEIGHTS_LOAD, "inference")
        assert receiver.requests == {"grpc": 0, "http": 0, via: 1}
    finally:
        receiver.stop()


def test_numbered_copies_of_a_service_share_its_name():
    assert tracing.service_attributes("inference-1") == {
        "service.name": "inference",
        "service.instance.id": "inference-1",
    }
    assert tracing.service_attributes("trainer") == {"service.name": "trainer"}
