"""Events: step metrics and lifecycle changes.

Senders: every service (`subjects.metrics(service)`, `subjects.lifecycle(service)`). Receivers:
monitors (metrics.jsonl, wandb), the launcher's progress view. The events stream also carries the
weights acknowledgements, so `decoder` reads any event subject (`subjects.events_all`).
"""

from typing import Literal

import msgspec

from rlbus.wire.base import Message, now
from rlbus.wire.weights import WeightsApplied, WeightsFailed, WeightsPublished

LifecycleState = Literal["started", "ready", "draining", "stopped", "failed"]


class StepMetrics(Message, kw_only=True, tag="step_metrics"):
    """Numeric metrics of one step of one service."""

    service: str
    step: int
    metrics: dict[str, float] = {}
    instance_id: str | None = None
    time: float = msgspec.field(default_factory=now)


class Lifecycle(Message, kw_only=True, tag="lifecycle"):
    """A process changed state."""

    service: str
    state: LifecycleState
    instance_id: str | None = None
    reason: str | None = None
    """Why (mandatory in spirit for `failed`)."""
    time: float = msgspec.field(default_factory=now)


class EvalResult(Message, kw_only=True, tag="eval_result"):
    """One evaluation of one environment on the weights of `step` (0: the starting weights):
    `metrics` keyed `eval/<env>/<metric>` (docs/evaluating.md)."""

    service: str
    step: int
    env: str
    """The eval environment's name (its id unless `name` is set)."""
    metrics: dict[str, float] = {}
    time: float = msgspec.field(default_factory=now)


Event = StepMetrics | Lifecycle | EvalResult | WeightsPublished | WeightsApplied | WeightsFailed

encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(Event)
