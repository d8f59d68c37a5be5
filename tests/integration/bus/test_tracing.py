"""Trace context crosses the bus: producer span -> consumer span (parent), fan-in links, JSONL export."""

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
    await bus.publish(bus.subjects.tasks, make_task(0), msg_id="0-0")
    await consume(bus, 1)
    by_name = {span.name: span for span in spans.get_finished_spans()}
    producer = by_name[f"publish {bus.subjects.tasks}"]
    consumer = by_name[f"process {bus.subjects.tasks}"]
    inner = by_name["rollout"]
    assert producer.kind == SpanKind.PRODUCER and consumer.kind == SpanKind.CONSUMER
    assert consumer.parent.span_id == producer.context.span_id
    assert consumer.context.trace_id == producer.context.trace_id
    assert inner.parent.span_id == consumer.context.span_id
    assert producer.attributes["messaging.message.id"] == "0-0"


async def test_fan_in_span_links_every_producer(bus, spans):
    for index in range(3):
        await bus.publish(bus.subjects.tasks, make_task(index), msg_id=f"0-{index}")
    deliveries = await consume(bus, 3, concurrency=3)
    with tracing.consumer_span("build batch", links_from=[d.headers for d in deliveries]):
        pass
    finished = spans.get_finished_spans()
    producers = {s.context.span_id for s in finished if s.kind == SpanKind.PRODUCER}
    (batch_span,) = [s for s in finished if s.name == "build batch"]
    assert {link.context.span_id for link in batch_span.links} == producers
    assert len(producers) == 3


def test_jsonl_exporter_writes_one_span_per_line(tmp_path):
    path = tmp_path / "traces" / "trainer.jsonl"
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(tracing.JsonlSpanExporter(path)))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("train step"):
        with tracer.start_as_current_span("forward"):
            pass
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["name"] for line in lines] == ["forward", "train step"]
    assert lines[0]["parent_id"] == lines[1]["context"]["span_id"]


def test_setup_tracing_without_endpoint_or_run_dir_is_off(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.setattr(tracing, "_provider", None)
    assert tracing.setup_tracing("svc") is None
    assert tracing.setup_tracing("svc", run_dir="/x", enabled=False) is None


def test_otlp_endpoint_gets_the_traces_path():
    assert tracing.otlp_traces_endpoint("http://c:4318") == "http://c:4318/v1/traces"
    assert tracing.otlp_traces_endpoint("http://c:4318/v1/traces") == "http://c:4318/v1/traces"


def test_log_processor_adds_the_current_trace_id(spans):
    assert tracing.add_trace_ids(None, "info", {"event": "x"}) == {"event": "x"}
    with tracing.tracer().start_as_current_span("step") as span:
        event = tracing.add_trace_ids(None, "info", {"event": "x"})
    assert event["trace_id"] == format(span.get_span_context().trace_id, "032x")
