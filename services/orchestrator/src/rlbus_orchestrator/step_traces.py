"""One root span per step (`orchestrator.step`), shared by task issue and the batcher.

The tasks issued for step N, their rollouts and HTTP calls, batch N, the trainer's step N and the
weight loads of version N all descend from it (docs/observability.md). It is opened at the first
task issued for the step and ended once its batch is on the bus (or when the coordinator stops).
"""

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span

from rlbus.obs import tracing


class StepTraces:
    """The open step spans, by step."""

    def __init__(self) -> None:
        self.spans: dict[int, Span] = {}

    def context(self, step: int) -> otel_context.Context | None:
        """The context to issue step `step`'s work in (None when tracing is off)."""
        if not tracing.enabled():
            return None
        span = self.spans.get(step)
        if span is None:
            span = tracing.tracer().start_span(
                tracing.STEP, context=otel_context.Context(), attributes={tracing.STEP_ATTR: step}
            )
            self.spans[step] = span
        return trace.set_span_in_context(span)

    def end(self, step: int) -> None:
        if (span := self.spans.pop(step, None)) is not None:
            span.end()

    def end_all(self) -> None:
        for step in list(self.spans):
            self.end(step)
