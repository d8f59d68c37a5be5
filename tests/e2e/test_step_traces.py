"""One trace per step, across every service and vLLM, into a real OTLP receiver over gRPC.

A debug run with two inference replicas exports to the test's OTLP receiver (OpenTelemetry's own
gRPC service definition, tests/otlp_receiver.py); for a step in the middle of the run its trace
must hold the orchestrator's issue, rollouts, HTTP calls, vLLM's own request spans, the batch
(linked to every rollout), the trainer's step, the weights publish and the weight load on each
replica, as one connected tree; span names carry no run id or step number.
"""

import re

import pytest
from e2e_support import RlLaunch, attributes, spans_named, step_trace
from otlp_receiver import OtlpReceiver

from rlbus.obs import tracing

pytestmark = pytest.mark.slow

STEPS = 4
CHOSEN = 2
REPLICAS = 2
NAME = re.compile(r"^[a-z_.]+( [a-z_.*]+)?$|^[A-Z][A-Za-z ()]+$")
"""Our dotted names, `publish <family>`, vLLM's `llm_request` and its start-up phase names."""


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory, starting_model):
    receiver = OtlpReceiver().start()
    launch = RlLaunch(
        tmp_path_factory.mktemp("traced"),
        "traced",
        "--model.name",
        str(starting_model.path),
        "--max-steps",
        str(STEPS),
        "--deployment.num-infer-replicas",
        str(REPLICAS),
        "--otel.endpoint",
        receiver.grpc_endpoint,
        "--otel.protocol",
        "grpc",
    )
    try:
        launch.exit_code = launch.wait()
        launch.spans = receiver.snapshot()
        launch.receiver = receiver
        yield launch
    finally:
        launch.kill()
        receiver.stop()


def test_the_run_exported_over_grpc_and_wrote_no_trace_files(traced_run):
    assert traced_run.exit_code == 0, traced_run.output()[-4000:]
    assert traced_run.receiver.requests["grpc"] > 0 and traced_run.receiver.requests["http"] == 0
    assert not (traced_run.run_dir / "traces").exists()  # the collector has them, not files


def test_a_step_is_one_trace_across_orchestrator_inference_vllm_and_trainer(traced_run):
    trace = step_trace(traced_run.spans, CHOSEN)
    assert {s["service"] for s in trace} == {"orchestrator", "inference", "trainer"}
    by_id = {s["spanId"]: s for s in trace}

    def parent(span: dict) -> str:
        return by_id[span["parentSpanId"]]["name"]

    rollouts = spans_named(trace, tracing.ROLLOUT)
    assert rollouts and all(parent(s) == "process tasks" for s in rollouts)
    generate = spans_named(trace, tracing.GENERATE)
    assert generate and all(s["kind"] == 3 for s in generate)  # CLIENT
    http = spans_named(trace, tracing.HTTP_SERVER)
    assert http and {parent(s) for s in http} == {tracing.GENERATE}
    engine = spans_named(trace, "llm_request")  # vLLM's own span, through the router
    assert engine and {parent(s) for s in engine} == {tracing.HTTP_SERVER}
    assert spans_named(trace, tracing.SCORE)

    (batch,) = spans_named(trace, tracing.BATCH)
    assert attributes(batch)[tracing.STEP_ATTR] == str(CHOSEN)
    linked = {link["spanId"] for link in batch.get("links", [])}
    every_rollout = {s["spanId"] for s in spans_named(traced_run.spans, tracing.ROLLOUT)}
    assert len(linked) == 128 // 8 and linked <= every_rollout  # one link per group of the batch

    (train,) = spans_named(trace, tracing.TRAIN_STEP)
    assert parent(train) == "publish batches.*" and attributes(train)[tracing.STEP_ATTR] == "2"
    (publish,) = spans_named(trace, tracing.WEIGHTS_PUBLISH)
    assert parent(publish) == tracing.TRAIN_STEP
    loads = spans_named(trace, tracing.WEIGHTS_LOAD)
    assert {parent(s) for s in loads} == {tracing.WEIGHTS_PUBLISH}
    assert {attributes(s)[tracing.VERSION] for s in loads} == {str(CHOSEN)}
    replicas = {attributes(s)[tracing.REPLICA] for s in loads}
    assert len(replicas) == REPLICAS, f"weight loads on {replicas}"


def test_every_step_has_its_own_trace_and_names_stay_low_cardinality(traced_run):
    for step in range(1, STEPS + 1):
        step_trace(traced_run.spans, step)
    names = {s["name"] for s in traced_run.spans}
    assert all(NAME.match(name) and not re.search(r"\d", name) for name in names), names
    run_id = traced_run.run_dir.name
    assert not any(run_id in name for name in names)
    # Spans outside the step traces: only vLLM's own start-up phases (one trace per engine).
    step_traces = {s["traceId"] for s in traced_run.spans if s["name"] == tracing.STEP}
    outside = {s["name"] for s in traced_run.spans if s["traceId"] not in step_traces}
    assert all(s["service"] == "inference" for s in traced_run.spans if s["name"] in outside)
    assert not outside & set(tracing.SPAN_NAMES), outside
