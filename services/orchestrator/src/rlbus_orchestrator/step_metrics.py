"""A step's metrics: the counters kept between two batches and the `StepMetrics` they become.

`StepStats` is filled by the parts as a step is built (drops by the intake, the pool and the
task expiry; weights waits by the weights watcher; the coordinator's own time by the wiring) and
reset once the step's batch is published. `step_metrics` turns it, the batch's samples and the
task ledger into the metrics dict of `TrainBatch.metrics` and the `StepMetrics` event
(docs/orchestrator.md, "Metrics"); the key order is the order of the dict below.
"""

import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import structlog

from rlbus.bus.client import Bus
from rlbus.bus.errors import PoisonBatch
from rlbus.wire import events
from rlbus.wire.events import StepMetrics
from rlbus.wire.rollouts import RolloutSample
from rlbus_orchestrator.staleness import off_policy_lag
from rlbus_orchestrator.state_store import DROP_REASONS, CoordinatorState

log = structlog.get_logger()

MAX_REPLAYED_STEPS = 8
"""At most this many of the last published steps get their metrics sent again on a restart."""


@dataclass
class StepStats:
    """Counters between two batches (`reset` after each step's metrics)."""

    dropped: Counter[str] = field(default_factory=Counter)
    started: float = field(default_factory=time.monotonic)
    wait_weights_s: float = 0.0
    own_s: float = 0.0
    completion_tokens: int = 0
    no_signal_samples: list[RolloutSample] = field(default_factory=list)
    """Samples of the groups dropped for zero advantage: sampled but never trained, they still
    count in the step's sampled reward (`reward/mean`)."""

    def reset(self) -> None:
        """Start counting the next step (the object is shared by the parts, so it stays)."""
        self.__dict__.update(StepStats().__dict__)


def step_metrics(
    step: int,
    samples: list[RolloutSample],
    *,
    stats: StepStats,
    state: CoordinatorState,
    num_pooled: int,
    applied_version: int,
    num_groups: int = 0,
) -> dict[str, float]:
    """The step's metrics; the task counts include the `num_groups` groups of this batch.

    `reward/*` describe every sample of the step: the batch's plus those of the groups dropped
    for zero advantage since the last batch (what other tools call the mean reward);
    `reward/trained_mean` is the batch's alone (docs/orchestrator.md, "Metrics")."""
    sampled = [*samples, *stats.no_signal_samples]
    m = reward_metrics(samples, sampled)
    m |= completion_metrics(samples)
    m["tasks/in_flight"] = float(len(state.outstanding) - num_pooled)
    m |= time_metrics(stats)
    m["weights/applied_version"] = float(applied_version)
    m |= reward_component_metrics(sampled)
    for lag, count in Counter(off_policy_lag(step, s.policy_version) for s in samples).items():
        m[f"off_policy_lag/{lag}"] = float(count)
    m |= task_metrics(state, stats, num_groups)
    return m


def reward_metrics(samples: list[RolloutSample], sampled: list[RolloutSample]) -> dict[str, float]:
    """`reward/*` over every sampled sample, and `reward/trained_mean` over the batch's."""
    rewards = [s.reward for s in sampled]
    return {
        "reward/mean": statistics.fmean(rewards),
        "reward/std": statistics.pstdev(rewards),
        "reward/min": min(rewards),
        "reward/max": max(rewards),
        "reward/trained_mean": statistics.fmean(s.reward for s in samples),
        "reward/num_samples": float(len(rewards)),
    }


def completion_metrics(samples: list[RolloutSample]) -> dict[str, float]:
    lengths = [len(s.completion_token_ids) for s in samples]
    return {
        "completion_len/mean": statistics.fmean(lengths),
        "completion_len/max": float(max(lengths)),
        "truncated/rate": sum(s.is_truncated for s in samples) / len(samples),
    }


def time_metrics(stats: StepStats) -> dict[str, float]:
    """Throughput and where the step's time went (waiting for rollouts is the rest)."""
    elapsed = max(time.monotonic() - stats.started, 1e-9)
    return {
        "tokens_per_s": stats.completion_tokens / elapsed,
        "time/step_s": elapsed,
        "time/wait_weights_s": stats.wait_weights_s,
        "time/orchestrator_s": stats.own_s,
        "time/wait_rollouts_s": max(0.0, elapsed - stats.wait_weights_s - stats.own_s),
    }


def reward_component_metrics(sampled: list[RolloutSample]) -> dict[str, float]:
    names = {k for s in sampled for k in s.reward_components}
    return {
        f"reward/{name}/mean": statistics.fmean(s.reward_components.get(name, 0.0) for s in sampled)
        for name in names
    }


def task_metrics(state: CoordinatorState, stats: StepStats, num_groups: int) -> dict[str, float]:
    """Drops of this step and of the run, and the task ledger with this batch's groups trained."""
    m: dict[str, float] = {}
    for reason in DROP_REASONS:
        m[f"dropped/{reason}"] = float(stats.dropped[reason])
        m[f"tasks/dropped/{reason}"] = float(state.dropped.get(reason, 0))
    m["tasks/issued"] = float(state.cursor)
    m["tasks/trained"] = float(state.trained + num_groups)
    m["tasks/outstanding"] = float(len(state.outstanding) - num_groups)
    return m


async def publish_metrics(bus: Bus, step: int, metrics: dict[str, float]) -> None:
    """A `StepMetrics` event of the orchestrator (monitors write it to metrics.jsonl)."""
    event = StepMetrics(service="orchestrator", step=step, metrics=metrics)
    await bus.publish(bus.subjects.metrics("orchestrator"), event)


async def last_metrics_step(bus: Bus) -> int:
    """The step of the newest orchestrator metrics stored on the events stream (0: none, or
    unreadable: then the metrics are sent again, and the monitor keeps one row per step)."""
    subjects = bus.subjects
    try:
        raw = await bus.last_stored(subjects.events_stream, subjects.metrics("orchestrator"))
        event = None if raw is None else events.decoder.decode(raw.data or b"")
    except Exception as error:
        log.warning("orchestrator_metrics_unread", error=repr(error))
        return 0
    return event.step if isinstance(event, StepMetrics) else 0


async def replay_lost_metrics(bus: Bus, last_published: int) -> list[int]:
    """A coordinator killed between storing a batch and publishing its `StepMetrics` left the
    step without orchestrator metrics: send them again from the stored batch (`replayed = 1`),
    for the published steps after the newest metrics on the bus. Returns the steps sent."""
    first = max(await last_metrics_step(bus) + 1, last_published - MAX_REPLAYED_STEPS + 1, 1)
    sent = []
    for step in range(first, last_published + 1):
        try:
            batch = await bus.step_log.read(step)
        except PoisonBatch:
            continue  # the trainer skips that step; it has no metrics to send
        if batch is None or not batch.metrics:
            continue
        await publish_metrics(bus, step, {**batch.metrics, "replayed": 1.0})
        sent.append(step)
    if sent:
        log.warning("step_metrics_replayed", steps=sent)
    return sent
