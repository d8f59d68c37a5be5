"""`rl-trace`: a step's trace read from OTLP-JSON files (as a run writes them), folded and drawn."""

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from rlbus.obs import tracing
from rlbus_launch import traceview


def write_step(traces_dir, step: int, rollouts: int) -> None:
    """What the orchestrator and trainer of a run write for `step`, through the real exporter."""
    providers = {}
    for service in ("orchestrator", "trainer"):
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        exporter = tracing.OtlpJsonFileExporter(traces_dir / f"{service}.jsonl")
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        providers[service] = provider.get_tracer("test")
    orchestrator, trainer = providers["orchestrator"], providers["trainer"]
    root = orchestrator.start_span(
        tracing.STEP, context=otel_context.Context(), attributes={tracing.STEP_ATTR: step}
    )
    with trace.use_span(root, end_on_exit=True):
        for _ in range(rollouts):
            with orchestrator.start_as_current_span(tracing.ROLLOUT):
                pass
        with orchestrator.start_as_current_span(tracing.BATCH):
            carrier = tracing.inject_headers({})
    with trainer.start_as_current_span(
        tracing.TRAIN_STEP, context=tracing.extract_context(carrier)
    ):
        with trainer.start_as_current_span(tracing.WEIGHTS_PUBLISH):
            pass


def test_a_step_is_printed_as_a_folded_tree_and_drawn(tmp_path, capsys):
    traces = tmp_path / "run" / "traces"
    write_step(traces, 1, rollouts=2)
    write_step(traces, 2, rollouts=3)
    traceview.main([str(tmp_path / "run"), "--png", str(tmp_path / "step.png")])  # the last step
    lines = capsys.readouterr().out.splitlines()
    assert (
        lines[0].startswith("step 2: trace ") and "7 spans from orchestrator, trainer" in lines[0]
    )
    body = [line.split(None, 3)[3] if len(line.split()) > 3 else line for line in lines[2:]]
    names = [line.split()[0] for line in body[:-1]]
    assert names == [
        tracing.STEP,
        tracing.ROLLOUT,
        tracing.BATCH,
        tracing.TRAIN_STEP,
        tracing.WEIGHTS_PUBLISH,
    ]
    assert f"{tracing.ROLLOUT} x3" in lines[3]  # same-name siblings folded with their count
    assert lines[-1].endswith("step.png") and (tmp_path / "step.png").stat().st_size > 10_000


def test_a_step_without_a_trace_is_one_line_naming_the_steps_that_have_one(tmp_path):
    write_step(tmp_path / "traces", 4, rollouts=1)
    with pytest.raises(SystemExit) as exit:
        traceview.main([str(tmp_path), "--step", "9"])
    assert str(exit.value.code) == "rl-trace: --step 9 has no trace; steps with one: 4-4"
    with pytest.raises(SystemExit) as exit:
        traceview.main([str(tmp_path / "nothing")])
    assert str(exit.value.code) == f"rl-trace: {tmp_path / 'nothing'} does not exist"
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exit:
        traceview.main([str(tmp_path / "empty")])
    assert str(exit.value.code).startswith("rl-trace: no OTLP-JSON trace files in ")
