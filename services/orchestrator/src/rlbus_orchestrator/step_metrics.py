"""A step's metrics: the counters kept between two batches and the `StepMetrics` they become.

`StepStats` is filled by the parts as a step is built (drops by the intake, the pool and the
task expiry; weights waits by the weights watcher; the coordinator's own time by the wiring) and
reset once the step's batch is published. `step_metrics` turns it, the batch's samples and the
task ledger into the metrics dict of `TrainBatch.metrics` and the `StepMetrics` event
(docs/orchestrator.md, "Metrics"); the key order is the order of the dict below. The keys under
`env/<id>/` are the same step seen per environment, for every environment of the run's config
(one or several) and any other a rollout of the step named.
"""

import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog

from rlbus.bus.client import Bus
from rlbus.bus.errors import PoisonBatch
from rlbus.wire import events
from rlbus.wire.events import StepMetrics
from rlbus.wire.rollouts import Rollout, RolloutSample
from rlbus_orchestrator.envs.multiturn import STOP_REASONS
from rlbus_orchestrator.staleness import off_policy_lag
from rlbus_orchestrator.state_store import DROP_REASONS, EPISODE_DROP_REASONS, CoordinatorState

log = structlog.get_logger()

MAX_REPLAYED_STEPS = 8
"""At most this many of the last published steps get their metrics sent again on a restart."""


@dataclass
class StepStats:
    """Counters between two batches (`reset` after each step's metrics)."""

    dropped: Counter[str] = field(default_factory=Counter)
    """Groups (tasks) dropped, by reason."""
    env_dropped: Counter[tuple[str, str]] = field(default_factory=Counter)
    """The same per (environment id, reason)."""
    episodes_dropped: Counter[tuple[str, str]] = field(default_factory=Counter)
    """Episodes left out of their groups (`Rollout.dropped`), per (environment id, reason)."""
    started: float = field(default_factory=time.monotonic)
    wait_weights_s: float = 0.0
    own_s: float = 0.0
    completion_tokens: int = 0
    no_signal: list[Rollout] = field(default_factory=list)
    """The groups dropped for zero advantage: sampled but never trained, their samples still
    count in the step's sampled reward (`reward/mean`)."""
    prompt_skips: Counter[str] = field(default_factory=Counter)
    """Cursors the difficulty filter passed over, by kind (`easy`, `hard`)."""
    prompts_forced: int = 0
    """Tasks issued although their prompt is skipped (its environment had no other)."""

    def reset(self) -> None:
        """Start counting the next step (the object is shared by the parts, so it stays)."""
        self.__dict__.update(StepStats().__dict__)

    def count_drop(self, reason: str, env_id: str) -> None:
        """A group of `env_id` dropped for `reason` (the caller recorded it in the ledger)."""
        self.dropped[reason] += 1
        self.env_dropped[env_id, reason] += 1

    def count_skips(self, skips: Counter[str], forced: int) -> None:
        """The difficulty filter's decisions of one issue (difficulty.Selection)."""
        self.prompt_skips.update(skips)
        self.prompts_forced += forced

    def count_dropped_episodes(self, rollout: Rollout) -> None:
        """The episodes a worker left out of `rollout`'s group."""
        for reason, num in rollout.dropped.items():
            self.episodes_dropped[rollout.env_id, reason] += num


def step_metrics(
    step: int,
    rollouts: list[Rollout],
    *,
    stats: StepStats,
    state: CoordinatorState,
    num_pooled: int,
    applied_version: int,
    num_groups: int = 0,
    env_ids: Sequence[str] = (),
    skipped: Counter[str] | None = None,
) -> dict[str, float]:
    """The step's metrics from the groups of its batch; the task counts include the
    `num_groups` groups of this batch; `env/<id>/*` for each of `env_ids` (the run's) at least;
    `difficulty/*` when `skipped` (the prompts skipped at this step, by kind) is given.

    `reward/*` describe every sample of the step: the batch's plus those of the groups dropped
    for zero advantage since the last batch (what other tools call the mean reward);
    `reward/trained_mean` is the batch's alone (docs/orchestrator.md, "Metrics")."""
    samples = [s for r in rollouts for s in r.samples]
    sampled = [*samples, *(s for r in stats.no_signal for s in r.samples)]
    m = reward_metrics(samples, sampled)
    m |= completion_metrics(samples)
    m["tasks/in_flight"] = float(len(state.outstanding) - num_pooled)
    m |= time_metrics(stats)
    m["weights/applied_version"] = float(applied_version)
    m |= reward_component_metrics(sampled)
    for lag, count in Counter(off_policy_lag(step, s.policy_version) for s in samples).items():
        m[f"off_policy_lag/{lag}"] = float(count)
    m |= task_metrics(state, stats, num_groups)
    for reason in EPISODE_DROP_REASONS:
        m[f"episodes_dropped/{reason}"] = float(
            sum(n for (_, r), n in stats.episodes_dropped.items() if r == reason)
        )
    m |= env_metrics(env_ids, rollouts, stats)
    if skipped is not None:
        m |= difficulty_metrics(skipped, stats, state)
    return m


def difficulty_metrics(
    skipped: Counter[str], stats: StepStats, state: CoordinatorState
) -> dict[str, float]:
    """The difficulty filter at this step: prompts skipped now, cursors passed over and tasks
    forced since the last batch, and cursors passed over since the run began."""
    return {
        "difficulty/skipped_easy": float(skipped["easy"]),
        "difficulty/skipped_hard": float(skipped["hard"]),
        "difficulty/skips": float(sum(stats.prompt_skips.values())),
        "difficulty/forced": float(stats.prompts_forced),
        "tasks/skipped": float(state.skipped),
    }


def env_metrics(
    env_ids: Sequence[str], rollouts: list[Rollout], stats: StepStats
) -> dict[str, float]:
    """`env/<id>/*`: the step's samples (batch and flat groups), drops and episode drops of each
    environment of `env_ids` and of the rollouts."""
    named = [*env_ids, *(r.env_id for r in rollouts), *(r.env_id for r in stats.no_signal)]
    m: dict[str, float] = {}
    for env_id in dict.fromkeys(named):
        prefix = f"env/{env_id}/"
        trained = [s for r in rollouts if r.env_id == env_id for s in r.samples]
        flat = [s for r in stats.no_signal if r.env_id == env_id for s in r.samples]
        m[prefix + "samples"] = float(len(trained) + len(flat))
        m[prefix + "trained_samples"] = float(len(trained))
        m |= {prefix + key: value for key, value in sample_means([*trained, *flat]).items()}
        for reason in DROP_REASONS:
            m[f"{prefix}dropped/{reason}"] = float(stats.env_dropped[env_id, reason])
        for reason in EPISODE_DROP_REASONS:
            m[f"{prefix}episodes_dropped/{reason}"] = float(stats.episodes_dropped[env_id, reason])
    return m


def sample_means(samples: list[RolloutSample]) -> dict[str, float]:
    """Reward, completion length, turns and tool use of some samples (means; none when empty)."""
    if not samples:
        return {"tool_errors": 0.0}
    m = {
        "reward/mean": statistics.fmean(s.reward for s in samples),
        "completion_len/mean": statistics.fmean(len(s.completion_token_ids) for s in samples),
        "num_turns/mean": statistics.fmean(s.num_turns for s in samples),
        "tool_calls/mean": statistics.fmean(s.num_tool_calls for s in samples),
        "tool_errors": float(sum(s.num_tool_errors for s in samples)),
    }
    stops = [s.stop_reason for s in samples if s.stop_reason is not None]
    if stops:  # multi-turn episodes: why each ended (`max_turns` and `deadline` among them)
        m |= {f"stop/{reason}": float(stops.count(reason)) for reason in STOP_REASONS}
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
    m["tasks/issued"] = float(state.num_issued())
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
