"""Every subject, stream, durable consumer and KV bucket of one run.

All subjects live under `rlbus.<run_id>.`; stream and bucket names (which cannot contain dots)
are `RLBUS_<run>_<NAME>` / `rlbus_<run>_<name>`. `RunSubjects(run_id)` is the only place these
names are spelled; `rlbus.bus` creates the streams, consumers and buckets listed in `streams()`,
`consumers()` and `buckets()`.

| family    | subject(s)                         | stream / bucket          | retention  | durable consumer(s)   |
| --------- | ---------------------------------- | ------------------------ | ---------- | --------------------- |
| tasks     | `rlbus.<run>.tasks`                | `RLBUS_<run>_TASKS`      | work queue | `rollout-workers`     |
|           | `rlbus.<run>.eval_tasks`           | (same stream)            | work queue | `eval-workers`        |
| rollouts  | `rlbus.<run>.rollouts`             | `RLBUS_<run>_ROLLOUTS`   | work queue | `coordinator`         |
| batches   | `rlbus.<run>.batches.<step>`       | `RLBUS_<run>_BATCHES`    | limits     | (direct get by step)  |
| events    | `rlbus.<run>.events.<kind>.<svc>`  | `RLBUS_<run>_EVENTS`     | limits     | (ad hoc, per monitor) |
| dead      | `rlbus.<run>.dead.<stream>`        | `RLBUS_<run>_DEAD`       | limits     | -                     |
| weights   | KV key `latest`                    | `rlbus_<run>_weights`    | KV         | (watch)               |
| replicas  | KV key `<replica_id>` (TTL lease)  | `rlbus_<run>_replicas`   | KV + TTL   | (watch / keys)        |
| state     | KV key `<name>` (`orchestrator`, `finished`, `coordinator-leader`) | `rlbus_<run>_state`      | KV         | (watch)               |
| control   | `rlbus.<run>.control.<service>`    | core NATS request/reply  | -          | -                     |
"""

import re
from dataclasses import dataclass
from typing import Literal

PREFIX = "rlbus"
WEIGHTS_LATEST_KEY = "latest"
RUN_FINISHED_KEY = "finished"
"""State-bucket key of the run's `RunFinished` record (rlbus.wire.run)."""
COORDINATOR_LEADER_KEY = "coordinator-leader"
"""State-bucket key of the coordinator's leader lease (one coordinator per run)."""
TASKS_DURABLE = "rollout-workers"
EVAL_TASKS_DURABLE = "eval-workers"
"""Evaluation tasks have a consumer of their own: a worker serves them with a budget of its own,
and they never queue in front of training tasks."""
ROLLOUTS_DURABLE = "coordinator"

_INVALID_RUN_CHARS = re.compile(r"[^A-Za-z0-9_-]")


def sanitize_run_id(run_id: str) -> str:
    """Map a run name to a token valid in subjects, stream names and bucket names."""
    assert run_id, "run_id must be non-empty"
    return _INVALID_RUN_CHARS.sub("_", run_id)


@dataclass(frozen=True)
class StreamSpec:
    """What `rlbus.bus` ensures for one stream."""

    name: str
    subjects: tuple[str, ...]
    retention: Literal["limits", "workqueue"]
    max_msgs_per_subject: int = -1


@dataclass(frozen=True)
class ConsumerSpec:
    """A durable pull consumer of a stream."""

    stream: str
    durable: str
    filter_subject: str | None = None


@dataclass(frozen=True)
class BucketSpec:
    """A KV bucket. Every bucket accepts per-key TTLs (leases): nats-py creates each KV stream
    with `allow_msg_ttl` on (docs/bus.md, "Lease"), so there is no per-bucket switch."""

    name: str
    history: int = 1


class RunSubjects:
    """Names of one run's subjects, streams, consumers and buckets."""

    def __init__(self, run_id: str) -> None:
        self.run_id = sanitize_run_id(run_id)
        self.prefix = f"{PREFIX}.{self.run_id}"
        upper = f"RLBUS_{self.run_id}"
        lower = f"rlbus_{self.run_id}"
        # streams
        self.tasks_stream = f"{upper}_TASKS"
        self.rollouts_stream = f"{upper}_ROLLOUTS"
        self.batches_stream = f"{upper}_BATCHES"
        self.events_stream = f"{upper}_EVENTS"
        self.dead_stream = f"{upper}_DEAD"
        # subjects
        self.tasks = f"{self.prefix}.tasks"
        self.eval_tasks = f"{self.prefix}.eval_tasks"
        self.rollouts = f"{self.prefix}.rollouts"
        self.batches_all = f"{self.prefix}.batches.*"
        self.events_all = f"{self.prefix}.events.>"
        self.dead_all = f"{self.prefix}.dead.>"
        self.weights_published = f"{self.prefix}.events.weights.published"
        self.weights_applied = f"{self.prefix}.events.weights.applied"
        self.weights_failed = f"{self.prefix}.events.weights.failed"
        # durables
        self.tasks_durable = TASKS_DURABLE
        self.eval_tasks_durable = EVAL_TASKS_DURABLE
        self.rollouts_durable = ROLLOUTS_DURABLE
        # KV buckets
        self.weights_bucket = f"{lower}_weights"
        self.replicas_bucket = f"{lower}_replicas"
        self.state_bucket = f"{lower}_state"

    def batch(self, step: int) -> str:
        """Subject of step `step`'s train batch."""
        return f"{self.prefix}.batches.{step}"

    def family(self, subject: str) -> str:
        """`subject` without the run's prefix and with its numbers as `*` (`batches.*`,
        `events.metrics.trainer`): a low-cardinality name for spans and metrics."""
        rest = subject.removeprefix(self.prefix + ".")
        return ".".join("*" if token.isdigit() else token for token in rest.split("."))

    def batch_msg_id(self, step: int) -> str:
        """Deterministic Nats-Msg-Id of step `step`'s batch."""
        return f"batch-{step}"

    def metrics(self, service: str) -> str:
        return f"{self.prefix}.events.metrics.{service}"

    def evals(self, service: str) -> str:
        """Where `service` publishes its evaluations' results (`EvalResult`)."""
        return f"{self.prefix}.events.evals.{service}"

    def lifecycle(self, service: str) -> str:
        return f"{self.prefix}.events.lifecycle.{service}"

    def control(self, service: str) -> str:
        return f"{self.prefix}.control.{service}"

    def dead(self, stream: str) -> str:
        """Dead-letter subject of quarantined messages of `stream` (or KV bucket)."""
        return f"{self.prefix}.dead.{stream}"

    def dead_kind(self, stream: str) -> str:
        """What a quarantined message of `stream` (or KV bucket) is, for the `Rlbus-Dead-Kind`
        header and the dead-letter listing (`rollout`, `batch`, `weights-record`, ...)."""
        kinds = {
            self.tasks_stream: "task",
            self.rollouts_stream: "rollout",
            self.batches_stream: "batch",
            self.events_stream: "event",
            self.weights_bucket: "weights-record",
            self.replicas_bucket: "replica-entry",
            self.state_bucket: "state-entry",
        }
        return kinds.get(stream, stream.lower())

    def streams(self) -> list[StreamSpec]:
        return [
            StreamSpec(self.tasks_stream, (self.tasks, self.eval_tasks), "workqueue"),
            StreamSpec(self.rollouts_stream, (self.rollouts,), "workqueue"),
            # One message per step subject: a republished batch is a no-op (dedup + the limit).
            StreamSpec(self.batches_stream, (self.batches_all,), "limits", max_msgs_per_subject=1),
            StreamSpec(self.events_stream, (self.events_all,), "limits"),
            StreamSpec(self.dead_stream, (self.dead_all,), "limits"),
        ]

    def consumers(self) -> list[ConsumerSpec]:
        return [
            ConsumerSpec(self.tasks_stream, self.tasks_durable, self.tasks),
            ConsumerSpec(self.tasks_stream, self.eval_tasks_durable, self.eval_tasks),
            ConsumerSpec(self.rollouts_stream, self.rollouts_durable, self.rollouts),
        ]

    def buckets(self) -> list[BucketSpec]:
        return [
            BucketSpec(self.weights_bucket, history=8),
            BucketSpec(self.replicas_bucket),
            BucketSpec(self.state_bucket, history=4),
        ]
