"""The trainer's Prometheus series (rank 0), declared here and served by `rlbus.obs.metrics`.

record_train_step(step, metrics)   once per finished step, from the step metrics it publishes
"""

from collections.abc import Mapping

from prometheus_client import Counter, Gauge, Histogram

from rlbus.obs.metrics import STEP_BUCKETS, declare, enable

TRAINER_STEPS = Counter(
    "rlbus_trainer_steps",
    "Training steps the trainer finished; outcome: trained, or skipped (its batch was quarantined).",
    ["outcome"],
    registry=None,
)
TRAINER_STEP_SECONDS = Histogram(
    "rlbus_trainer_step_seconds",
    "Wall time of one trainer step after its batch arrived: train, checkpoint, publish weights.",
    buckets=STEP_BUCKETS,
    registry=None,
)
TRAINER_BATCH_WAIT_SECONDS = Histogram(
    "rlbus_trainer_batch_wait_seconds",
    "How long the trainer waited for each step's batch (long: the orchestrator is the bottleneck).",
    buckets=STEP_BUCKETS,
    registry=None,
)
TRAINER_TOKENS = Counter(
    "rlbus_trainer_tokens",
    "Tokens of the batches the trainer trained (padding excluded).",
    registry=None,
)
TRAINER_STEP = Gauge("rlbus_trainer_step", "The last step the trainer finished.", registry=None)
WEIGHTS_PUBLISHED_VERSION = Gauge(
    "rlbus_weights_published_version",
    "The newest weights version the trainer published (version N = the model after step N).",
    registry=None,
)


def _zero_outcomes() -> None:
    for outcome in ("trained", "skipped"):
        TRAINER_STEPS.labels(outcome=outcome)


declare(
    "trainer",
    TRAINER_STEPS,
    TRAINER_STEP_SECONDS,
    TRAINER_BATCH_WAIT_SECONDS,
    TRAINER_TOKENS,
    TRAINER_STEP,
    WEIGHTS_PUBLISHED_VERSION,
    zero=_zero_outcomes,
)


def record_train_step(step: int, metrics: Mapping[str, float]) -> None:
    """A trainer step that finished (rank 0), from the step metrics it publishes: `step_s`,
    `wait_s`, `num_tokens`, and `skipped` / `retrained` when set (a retrained step publishes no
    weights)."""
    enable("trainer")
    skipped = bool(metrics.get("skipped"))
    TRAINER_STEPS.labels(outcome="skipped" if skipped else "trained").inc()
    TRAINER_STEP_SECONDS.observe(metrics.get("step_s", 0.0))
    TRAINER_BATCH_WAIT_SECONDS.observe(metrics.get("wait_s", 0.0))
    TRAINER_TOKENS.inc(metrics.get("num_tokens", 0.0))
    TRAINER_STEP.set(step)
    if not metrics.get("retrained"):
        WEIGHTS_PUBLISHED_VERSION.set(step)
