"""The orchestrator's Prometheus series, declared here and served by `rlbus.obs.metrics`.

    record_batch(step, metrics)        the coordinator published a step's batch (its difficulty
                                       filter's skips among them)
    observe_eval(env, metrics)         the coordinator finished an evaluation of one environment
    count_dropped_task(reason, env)    the coordinator dropped a training task
    count_rollout(rollout)             a rollout worker published a group (and left out episodes)
    poll_stream_stats(bus)        the coordinator role: JetStream stream and consumer state every
                                  STREAM_STATS_INTERVAL_S into gauges (Bus.stream_stats), so a
                                  scrape never waits on NATS

Components: `coordinator`, `workers`, `streams` (rlbus.obs.metrics.SERVICE_COMPONENTS says which
process serves which).

The `env` label is the environment id (`[[orchestrator.env]].id`): the run's config names them,
so the label has a few values; `env_label` still caps it at MAX_ENV_LABELS per process (any
further id counts as `other`). The outcome and token series of an environment start at 0 when it
is first seen; drops appear with the first one.
"""

import asyncio
import re
from collections.abc import Mapping

import structlog
from prometheus_client import Counter, Gauge, Histogram

from rlbus.bus.client import Bus
from rlbus.obs.metrics import declare, enable, serving_address, stream_family
from rlbus.wire.rollouts import Rollout

log = structlog.get_logger()

LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32)
"""Off-policy lag in steps (an integer: bucket `le="2"` counts lags 0, 1 and 2)."""
STREAM_STATS_INTERVAL_S = 5.0
MAX_CONSUMERS_PER_STREAM = 16
"""Durable consumers reported per stream: their names are fixed in code, this only guards the
label's cardinality against a tool that creates many."""
MAX_ENV_LABELS = 32
"""Distinct `env` label values per process (module docstring)."""

# ---- coordinator -------------------------------------------------------------------------------

BATCHES = Counter(
    "rlbus_batches_published",
    "Train batches the coordinator published (one per step).",
    registry=None,
)
ORCHESTRATOR_STEP = Gauge(
    "rlbus_orchestrator_step",
    "The step of the last batch the coordinator published.",
    registry=None,
)
OFF_POLICY_LAG = Histogram(
    "rlbus_off_policy_lag_steps",
    "Per sample of each published batch: (step - 1) - the weights version that generated it.",
    buckets=LAG_BUCKETS,
    registry=None,
)
TASKS_DROPPED = Counter(
    "rlbus_tasks_dropped",
    "Training tasks ended without being trained, by reason (stale, error, zero_advantage, "
    "invalid, timeout) and environment.",
    ["reason", "env"],
    registry=None,
)
REWARD_MEAN = Gauge(
    "rlbus_orchestrator_reward_mean",
    "Mean sampled reward of the last published step, per environment (env/<id>/reward/mean).",
    ["env"],
    registry=None,
)
EVAL_REWARD = Gauge(
    "rlbus_eval_reward",
    "Mean reward of the last evaluation of each environment (eval/<env>/reward/mean).",
    ["env"],
    registry=None,
)
EVAL_PASS_AT_K = Gauge(
    "rlbus_eval_pass_at_k",
    "pass@k of the last evaluation of each environment, per k evaluated (eval/<env>/pass@<k>).",
    ["env", "k"],
    registry=None,
)
PROMPTS_SKIPPED = Gauge(
    "rlbus_prompts_skipped",
    "Prompts the difficulty filter skips at the last published step; kind: easy (always "
    "solved) or hard (always failed) (difficulty/skipped_<kind>).",
    ["kind"],
    registry=None,
)
PROMPT_SKIPS = Counter(
    "rlbus_prompt_skips",
    "Data cursors the difficulty filter passed over because their prompt was skipped "
    "(difficulty/skips).",
    registry=None,
)
declare(
    "coordinator",
    BATCHES,
    ORCHESTRATOR_STEP,
    OFF_POLICY_LAG,
    TASKS_DROPPED,
    REWARD_MEAN,
    EVAL_REWARD,
    EVAL_PASS_AT_K,
    PROMPTS_SKIPPED,
    PROMPT_SKIPS,
)

# ---- rollout workers ---------------------------------------------------------------------------

ROLLOUTS = Counter(
    "rlbus_rollouts",
    "Samples (completions) of the groups rollout workers published, per environment.",
    ["env"],
    registry=None,
)
ROLLOUT_GROUPS = Counter(
    "rlbus_rollout_groups",
    "Groups (one task each) rollout workers published, per environment; outcome: ok, partial "
    "(some episodes left out), or error (no sample: the environment raised).",
    ["outcome", "env"],
    registry=None,
)
ROLLOUT_TOKENS = Counter(
    "rlbus_rollout_tokens",
    "Tokens of the published samples, per environment; kind: prompt (per sample) or completion "
    "(generated).",
    ["kind", "env"],
    registry=None,
)
EPISODES_DROPPED = Counter(
    "rlbus_episodes_dropped",
    "Episodes left out of their group, by reason (error: raised; timeout: past the environment's "
    "episode_timeout_s) and environment.",
    ["reason", "env"],
    registry=None,
)
declare("workers", ROLLOUTS, ROLLOUT_GROUPS, ROLLOUT_TOKENS, EPISODES_DROPPED)

# ---- JetStream state (coordinator role) --------------------------------------------------------

STREAM_MESSAGES = Gauge(
    "rlbus_stream_messages",
    "Messages stored in each stream of the run (tasks, rollouts: the queue depth).",
    ["stream"],
    registry=None,
)
CONSUMER_PENDING = Gauge(
    "rlbus_consumer_pending_messages",
    "Messages of the stream not yet delivered to each durable consumer (its lag).",
    ["stream", "consumer"],
    registry=None,
)
CONSUMER_ACK_PENDING = Gauge(
    "rlbus_consumer_ack_pending_messages",
    "Messages delivered to each durable consumer and not acknowledged yet (in flight).",
    ["stream", "consumer"],
    registry=None,
)
STREAM_STATS_UPDATED = Gauge(
    "rlbus_stream_stats_updated_timestamp_seconds",
    "Unix time the stream and consumer gauges were last read from JetStream.",
    registry=None,
)
declare("streams", STREAM_MESSAGES, CONSUMER_PENDING, CONSUMER_ACK_PENDING, STREAM_STATS_UPDATED)

# ---- recording ---------------------------------------------------------------------------------

OFF_POLICY_LAG_KEY = re.compile(r"^off_policy_lag/(-?\d+)$")
ENV_REWARD_KEY = re.compile(r"^env/(.+)/reward/mean$")
PASS_AT_K_KEY = re.compile(r"pass@(\d+)")
SKIPPED_KEY = re.compile(r"^difficulty/skipped_(easy|hard)$")
ROLLOUT_OUTCOMES = ("ok", "partial", "error")
TOKEN_KINDS = ("prompt", "completion")
_env_labels: set[str] = set()


def env_label(env_id: str) -> str:
    """The `env` label of an environment id: itself, or `other` past MAX_ENV_LABELS ids; a
    new one gets its series at 0 (module docstring)."""
    if env_id in _env_labels:
        return env_id
    if len(_env_labels) >= MAX_ENV_LABELS:
        return "other"
    _env_labels.add(env_id)
    for outcome in ROLLOUT_OUTCOMES:
        ROLLOUT_GROUPS.labels(outcome=outcome, env=env_id)
    for kind in TOKEN_KINDS:
        ROLLOUT_TOKENS.labels(kind=kind, env=env_id)
    ROLLOUTS.labels(env=env_id)
    return env_id


def record_batch(step: int, metrics: Mapping[str, float]) -> None:
    """A batch the coordinator published, from its step metrics: `off_policy_lag/<lag>` holds
    how many of its samples have that lag (rlbus_orchestrator.step_metrics)."""
    enable("coordinator")
    BATCHES.inc()
    ORCHESTRATOR_STEP.set(step)
    for key, count in metrics.items():
        if match := OFF_POLICY_LAG_KEY.match(key):
            lag = int(match.group(1))
            for _ in range(int(count)):
                OFF_POLICY_LAG.observe(lag)
        elif match := ENV_REWARD_KEY.match(key):
            REWARD_MEAN.labels(env=env_label(match.group(1))).set(count)
        elif match := SKIPPED_KEY.match(key):
            PROMPTS_SKIPPED.labels(kind=match.group(1)).set(count)
        elif key == "difficulty/skips":
            PROMPT_SKIPS.inc(count)


def observe_eval(env: str, metrics: Mapping[str, float]) -> None:
    """An evaluation of `env` finished: its `eval/<env>/reward/mean` and `eval/<env>/pass@<k>`
    (rlbus_orchestrator.eval_metrics) become the gauges' values until the next one."""
    enable("coordinator")
    label = env_label(env)
    prefix = f"eval/{env}/"
    if (reward := metrics.get(prefix + "reward/mean")) is not None:
        EVAL_REWARD.labels(env=label).set(reward)
    for key, value in metrics.items():
        if key.startswith(prefix) and (match := PASS_AT_K_KEY.fullmatch(key[len(prefix) :])):
            EVAL_PASS_AT_K.labels(env=label, k=match.group(1)).set(value)


def count_dropped_task(reason: str, env_id: str = "") -> None:
    """A training task of `env_id` the coordinator dropped (one of its DROP_REASONS)."""
    enable("coordinator")
    TASKS_DROPPED.labels(reason=reason, env=env_label(env_id)).inc()


def rollout_outcome(rollout: Rollout) -> str:
    if rollout.error or not rollout.samples:
        return "error"
    return "partial" if any(rollout.dropped.values()) else "ok"


def count_rollout(rollout: Rollout) -> None:
    """A group a rollout worker published, and the episodes it left out."""
    enable("workers")
    env = env_label(rollout.env_id)
    ROLLOUT_GROUPS.labels(outcome=rollout_outcome(rollout), env=env).inc()
    ROLLOUTS.labels(env=env).inc(len(rollout.samples))
    prompt = sum(len(s.prompt_token_ids) for s in rollout.samples)
    ROLLOUT_TOKENS.labels(kind="prompt", env=env).inc(prompt)
    completion = sum(len(s.completion_token_ids) for s in rollout.samples)
    ROLLOUT_TOKENS.labels(kind="completion", env=env).inc(completion)
    for reason, num in rollout.dropped.items():  # the worker's own reasons: error, timeout
        EPISODES_DROPPED.labels(reason=reason, env=env).inc(num)


_stream_labels: set[tuple[str, ...]] = set()
_consumer_labels: set[tuple[str, ...]] = set()


async def refresh_stream_stats(bus: Bus) -> None:
    """Read the message count of every stream of the run and the pending / ack-pending counts of
    its durable consumers into the gauges; series of streams and consumers gone since are removed.
    A stream that cannot be read (deleted by a tool, a bus outage) keeps its last values and does
    not keep the others from being read; the first such error is raised at the end."""
    enable("streams")
    subjects = bus.subjects
    streams: set[tuple[str, ...]] = set()
    consumers: set[tuple[str, ...]] = set()
    failure: Exception | None = None
    for spec in subjects.streams():
        family = stream_family(subjects, spec.name)
        try:
            stats = await bus.stream_stats(spec.name)
        except Exception as error:
            failure = failure or error
            continue
        STREAM_MESSAGES.labels(stream=family).set(stats.num_messages)
        streams.add((family,))
        for consumer in stats.consumers[:MAX_CONSUMERS_PER_STREAM]:  # durable ones only
            labels = (family, consumer.durable)
            CONSUMER_PENDING.labels(*labels).set(consumer.num_pending)
            CONSUMER_ACK_PENDING.labels(*labels).set(consumer.num_ack_pending)
            consumers.add(labels)
    if failure is not None:  # what could not be read keeps its last values
        _stream_labels.update(streams)
        _consumer_labels.update(consumers)
        raise failure
    _forget_gone(streams, consumers)
    STREAM_STATS_UPDATED.set_to_current_time()


def _forget_gone(streams: set[tuple[str, ...]], consumers: set[tuple[str, ...]]) -> None:
    """Remove the series of streams and consumers not seen in this read; remember these."""
    for labels in _stream_labels - streams:
        STREAM_MESSAGES.remove(*labels)
    for labels in _consumer_labels - consumers:
        CONSUMER_PENDING.remove(*labels)
        CONSUMER_ACK_PENDING.remove(*labels)
    _stream_labels.clear()
    _stream_labels.update(streams)
    _consumer_labels.clear()
    _consumer_labels.update(consumers)


def cancel_was_lost() -> bool:
    """This task was cancelled, but a library turned the cancel into another error (a bus
    request's deadline passing at the same moment): end as cancelled, not retry."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def poll_stream_stats(bus: Bus, interval_s: float = STREAM_STATS_INTERVAL_S) -> None:
    """`refresh_stream_stats` every `interval_s` until cancelled, in a process that serves
    metrics (returns at once otherwise). A bus outage is one warning line; the gauges keep their
    last values meanwhile (`rlbus_stream_stats_updated_timestamp_seconds` shows their age). Never
    raises: a supervised task that did would end the service."""
    if serving_address() is None:
        return
    failing = False
    while True:
        try:
            await refresh_stream_stats(bus)
            failing = False
        except Exception as error:
            if cancel_was_lost():
                raise asyncio.CancelledError from error
            if not failing:
                log.warning("stream_stats_failed", error=repr(error), retry_in_s=interval_s)
            failing = True
        await asyncio.sleep(interval_s)
