"""The coordinator: hands out tasks, turns rollouts into train batches, keeps the run resumable.

    ┌──────────────── Coordinator.run() ─────────────────────────────────────────────────┐
    │                                                                                     │
    │  watch_weights ──(applied version)──┐                                               │
    │                                     ▼                                               │
    │  issue_tasks ──tasks──▶ [tasks stream] ──▶ rollout workers ──▶ [rollouts stream]    │
    │      ▲  (wakes on `changed`)                                        │               │
    │      │                                                              ▼               │
    │      └──────── changed ◀── on_rollout (consumer handler) ◀──────────┘               │
    │                              │ invalid (validation.py): dead letter, term (counted)  │
    │                              │ stale / error / no signal: drop (counted), ack        │
    │                              │ eval task: aggregate, ack                            │
    │                              ▼ else: pool (unacked, heartbeated by the consumer)    │
    │                          build_batches ──▶ [batches stream, subject per step]       │
    │                              then: save state (KV), ack the pooled rollouts          │
    └─────────────────────────────────────────────────────────────────────────────────────┘

| asyncio task   | waits on                                   | unblocked by                            |
| -------------- | ------------------------------------------ | --------------------------------------- |
| watch_weights  | 1 s poll of replicas KV; `weights.applied` | inference applying a new version         |
|                | events (core subscription)                 |                                          |
| issue_tasks    | `changed` event                            | a rollout accepted/dropped, new weights, |
|                |                                            | a batch published, a task timed out      |
| expire_tasks   | a poll (`task_timeout_s` / 4, at most 5 s) | -                                        |
| rollouts       | pull fetch on the `coordinator` durable    | a worker publishing a group              |
| (handler)      | `lock` (one rollout at a time)             | -                                        |

Issuing rule: keep `pooled + in_flight * group_size >= batch_size * (max_step - next_step + 1)`
samples on the way, where `max_step = applied + 1 + async_level` (never more than `async_level`
steps ahead of the newest applied weights, and never past `max_steps`).

State (KV `state`, key `orchestrator`): next step, data cursor, outstanding task cursors (published
and not yet in a batch or dropped), the cursors of a publish in progress (written before the
publish; republished on restart, deduplicated by message id), and the accounting of every issued
task: `cursor == trained + sum(dropped.values()) + len(outstanding)` after every save. The
batches stream is the truth for which steps exist: on start, any batch at `next_step` already in
the log (crash between publish and state save) is adopted and its task ids marked consumed.
Outstanding tasks whose rollout never comes are dropped after `task_timeout_s` (expire_tasks).

Pause (control `Pause`, until `Resume`): issue_tasks issues nothing; rollouts still in flight are
pooled and batched as usual. Drain (SIGTERM/SIGINT, control `Drain`): stop issuing, wait up to
DRAIN_TIMEOUT_S for the rollouts in flight to come back (batched or dropped), then the clean
shutdown. Stop (control `Stop`): the clean shutdown at once, without waiting for handlers.

Bus stalls: a state read or save that fails with a transient bus error (timeout, reconnecting) is
retried with a `coordinator_bus_retry` line for up to `bus.publish_retry_s` (publishes retry
themselves, rlbus.bus.core), so a NATS outage shorter than that is ridden out; past it the task
raises and the supervisor ends the service with exit 1 and one `service_task_failed` line.

Clean shutdown: stop issuing, stop the consumer (pooled rollouts stay unacked and are redelivered
to the next coordinator), save state. Crash (kill -9): the same, minus the last save, which the
restart repairs from the batch log and the write-ahead cursors.
"""

import asyncio
import json
import math
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span

from rlbus.bus.client import Bus
from rlbus.bus.consumer import Delivery
from rlbus.bus.core import retry_transient
from rlbus.bus.kv import KV
from rlbus.configs.orchestrator import OrchestratorConfig
from rlbus.obs import tracing
from rlbus.obs.metrics import count_dropped_task, record_batch
from rlbus.runtime import DRAIN_BUDGET_S, ServiceState, TaskSupervisor
from rlbus.wire import rollouts as rollouts_wire
from rlbus.wire.batches import TrainBatch
from rlbus.wire.events import StepMetrics
from rlbus.wire.rollouts import Rollout
from rlbus.wire.tasks import SamplingArgs, Task
from rlbus_orchestrator import validation
from rlbus_orchestrator.advantages import group_advantages, has_signal
from rlbus_orchestrator.envs import Environment, load_environment
from rlbus_orchestrator.packing import group_sequences, make_train_sample, pack
from rlbus_orchestrator.staleness import (
    is_stale,
    max_allowed_step,
    min_policy_version,
    off_policy_lag,
)

log = structlog.get_logger()

STATE_KEY = "orchestrator"
WEIGHTS_POLL_S = 1.0
DRAIN_TIMEOUT_S = 20.0
"""How long a drain waits for the rollouts in flight, counted from the drain request; the rest of
rlbus.runtime.DRAIN_BUDGET_S is left to the consumers' handlers and the workers."""
DRAIN_POLL_S = 0.2
DROP_REASONS = ("invalid", "stale", "zero_advantage", "error", "timeout")
"""Why an issued training task ended without being trained (counted in the state and metrics)."""
BUS_RETRY_MAX_DELAY_S = 1.0


@dataclass
class CoordinatorState:
    """What survives a restart (JSON in the state KV bucket)."""

    next_step: int = 1
    cursor: int = 0
    outstanding: dict[str, int] = field(default_factory=dict)
    """task_id -> data cursor, for tasks published and not yet batched or dropped."""
    publishing: list[int] = field(default_factory=list)
    """Cursors being published right now (republished after a crash)."""
    trained: int = 0
    """Training tasks whose group is in a stored batch."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Training tasks dropped, by reason (DROP_REASONS)."""

    def accounting(self) -> dict[str, int]:
        """Every issued task is trained, dropped (by reason) or outstanding; `unaccounted` is 0."""
        num_dropped = sum(self.dropped.values())
        return {
            "issued": self.cursor,
            "trained": self.trained,
            "dropped": num_dropped,
            "outstanding": len(self.outstanding),
            "unaccounted": self.cursor - self.trained - num_dropped - len(self.outstanding),
        }

    def encode(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @classmethod
    def decode(cls, data: bytes) -> "CoordinatorState":
        return cls(**json.loads(data))


async def read_saved_state(bus: Bus) -> CoordinatorState | None:
    """The coordinator state last saved on the bus (None before the first save), e.g. for
    `state.accounting()` in a test or a tool."""
    entry = await bus.kv(bus.subjects.state_bucket).get(STATE_KEY)
    return CoordinatorState.decode(entry.value) if entry else None


@dataclass
class PooledGroup:
    rollout: Rollout
    delivery: Delivery
    advantages: list[float]


def dataset_index(cursor: int, num_examples: int | None, seed: int) -> int:
    """Example index of a data cursor: the cursor itself for generated data, else a per-epoch shuffle."""
    if num_examples is None:
        return cursor
    epoch, pos = divmod(cursor, num_examples)
    order = list(range(num_examples))
    random.Random(f"{seed}/{epoch}").shuffle(order)
    return order[pos]


def task_id_of(cursor: int) -> str:
    return f"train-{cursor}"


class StepStats:
    """Counters between two batches (reset after each step's metrics)."""

    def __init__(self) -> None:
        self.dropped: Counter[str] = Counter()
        self.started = time.monotonic()
        self.wait_weights_s = 0.0
        self.own_s = 0.0
        self.completion_tokens = 0
        self.no_signal_samples: list = []
        """Samples of the groups dropped for zero advantage: sampled but never trained, they
        still count in the step's sampled reward (`reward/mean`)."""


class StepTraces:
    """One root span per step (`orchestrator.step`): the tasks issued for step N, their rollouts
    and HTTP calls, batch N, the trainer's step N and the weight loads of version N all descend
    from it (docs/observability.md). Opened at the first task issued for the step, ended once its
    batch is on the bus."""

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


class Coordinator:
    """One per run (see module docstring)."""

    def __init__(self, bus: Bus, config: OrchestratorConfig):
        self.bus = bus
        self.config = config
        self.envs: list[tuple[Environment, dict]] = [
            (load_environment(e.id, e.args), e.args) for e in config.env
        ]
        self.env_weights = [e.weight for e in config.env]
        self.state = CoordinatorState()
        self.pool: dict[str, PooledGroup] = {}
        self.applied_version = 0
        self.changed = asyncio.Event()
        self.lock = asyncio.Lock()
        self.done = asyncio.Event()
        self.stats = StepStats()
        self.eval_results: dict[int, dict[str, float]] = {}
        self.eval_pending: dict[int, list[float]] = {}
        self.num_batches_published = 0
        self.service = ServiceState("orchestrator")
        """Paused / draining / stopping: replaced by the service's own in `run`."""
        self.issued_at: dict[str, float] = {}
        """task_id -> monotonic time it was issued (or the coordinator started, after a restart)."""
        self.tasks = TaskSupervisor()
        """issue_tasks, watch_weights and evaluation runs: one that raises ends the coordinator."""
        self.traces = StepTraces()

    # ---- state ---------------------------------------------------------------------------

    def state_kv(self) -> KV:
        return self.bus.kv(self.bus.subjects.state_bucket)

    async def retry_bus(self, what: str, operation):
        """`await operation()`, retried on transient bus errors for `bus.publish_retry_s`."""
        return await retry_transient(
            what,
            operation,
            within_s=self.config.bus.publish_retry_s,
            event="coordinator_bus_retry",
            max_delay_s=BUS_RETRY_MAX_DELAY_S,
        )

    async def load_state(self) -> None:
        entry = await self.retry_bus("read_state", lambda: self.state_kv().get(STATE_KEY))
        self.state = CoordinatorState.decode(entry.value) if entry else CoordinatorState()
        await self.adopt_published_batches()
        started = time.monotonic()
        self.issued_at = dict.fromkeys(self.state.outstanding, started)
        if self.state.publishing:
            await self.publish_tasks(self.state.publishing)
        log.info(
            "coordinator_state_loaded",
            next_step=self.state.next_step,
            cursor=self.state.cursor,
            outstanding=len(self.state.outstanding),
        )

    async def save_state(self) -> None:
        data = self.state.encode()
        await self.retry_bus("save_state", lambda: self.state_kv().put(STATE_KEY, data))

    async def adopt_published_batches(self) -> None:
        """Steps published before a crash but not recorded in the state: mark their tasks consumed.
        A stored step that is not a batch (the trainer quarantines and skips it) still counts as
        published; its tasks, unknown, stay outstanding until `task_timeout_s` drops them."""
        from rlbus.bus.errors import PoisonBatch

        while True:
            try:
                batch = await self.bus.step_log.read(self.state.next_step)
            except PoisonBatch as poison:
                log.error(
                    "coordinator_stored_step_unreadable", step=poison.step, reason=poison.reason
                )
                self.state.next_step += 1
                continue
            if batch is None:
                break
            for task_id in batch.task_ids:
                if self.state.outstanding.pop(task_id, None) is not None:
                    self.state.trained += 1
            log.warning("coordinator_adopted_published_batch", step=batch.step)
            self.state.next_step += 1
        await self.save_state()

    # ---- tasks ---------------------------------------------------------------------------

    def make_task(self, cursor: int) -> Task:
        rng = random.Random(f"{self.config.seed}/env/{cursor}")
        env_index = (
            rng.choices(range(len(self.envs)), weights=self.env_weights)[0]
            if len(self.envs) > 1
            else 0
        )
        env, args = self.envs[env_index]
        index = dataset_index(cursor, env.num_examples("train"), self.config.seed)
        step = self.state.next_step
        return Task(
            task_id=task_id_of(cursor),
            step=step,
            env_id=env.env_id,
            env_args=args,
            example_id=index,
            problem=env.example("train", index),
            sampling=self.sampling_args(),
            group_size=self.config.group_size,
            min_policy_version=min_policy_version(step, self.config.max_off_policy_steps),
        )

    def sampling_args(self, *, greedy: bool = False) -> SamplingArgs:
        s = self.config.sampling
        return SamplingArgs(
            temperature=0.0 if greedy else s.temperature,
            top_p=1.0 if greedy else s.top_p,
            max_tokens=s.max_tokens,
            extra=dict(s.extra_body),
        )

    async def publish_tasks(self, cursors: list[int]) -> None:
        """Publish concurrently (one round trip, not one per task); ids make a retry a no-op.
        Each task is published in the trace of the step its group is expected to land in."""
        tasks = [self.make_task(cursor) for cursor in cursors]

        async def publish(task: Task, step: int) -> None:
            with tracing.use_context(self.traces.context(step)):
                await self.bus.publish(self.bus.subjects.tasks, task, msg_id=task.task_id)

        await asyncio.gather(
            *(
                publish(t, step)
                for t, step in zip(tasks, self.expected_steps(len(tasks)), strict=True)
            )
        )

    def expected_steps(self, num_tasks: int) -> list[int]:
        """The step each of `num_tasks` new groups should land in: batches take groups first in,
        first out, after those pooled and in flight (a guess for tracing: a dropped group moves
        the later ones one step on)."""
        pooled = sum(len(g.rollout.samples) for g in self.pool.values())
        in_flight = max(0, len(self.state.outstanding) - num_tasks - len(self.pool))
        ahead = pooled + in_flight * self.config.group_size
        size = self.config.batch_size
        return [
            self.state.next_step + (ahead + k * self.config.group_size) // size
            for k in range(num_tasks)
        ]

    def max_step(self) -> int:
        limit = max_allowed_step(self.applied_version, self.config.async_level)
        return min(limit, self.config.max_steps) if self.config.max_steps else limit

    def num_tasks_to_issue(self) -> int:
        steps_ahead = self.max_step() - self.state.next_step + 1
        if steps_ahead <= 0:
            return 0
        pooled = sum(len(g.rollout.samples) for g in self.pool.values())
        in_flight = len(self.state.outstanding) - len(self.pool)
        missing = self.config.batch_size * steps_ahead - pooled - in_flight * self.config.group_size
        return max(0, math.ceil(missing / self.config.group_size))

    async def issue_tasks(self) -> None:
        while not self.done.is_set():
            if not self.service.unpaused.is_set():
                await self.service.unpaused.wait()
                self.changed.set()  # issue what the pause held back
            await self.changed.wait()
            self.changed.clear()
            if self.service.mode != "running":  # paused or draining: nothing new
                continue
            async with self.lock:
                started = time.monotonic()
                num = self.num_tasks_to_issue()
                if num:
                    cursors = list(range(self.state.cursor, self.state.cursor + num))
                    self.state.cursor += num
                    for c in cursors:
                        self.state.outstanding[task_id_of(c)] = c
                        self.issued_at[task_id_of(c)] = started
                    self.state.publishing = cursors
                    await self.save_state()
                    await self.publish_tasks(cursors)
                    self.state.publishing = []
                    await self.save_state()
                    log.debug("tasks_published", num_tasks=num, cursor=self.state.cursor)
                self.stats.own_s += time.monotonic() - started

    def overdue_tasks(self, now: float) -> list[str]:
        """In-flight tasks (issued, no rollout pooled) older than `task_timeout_s`."""
        timeout = self.config.task_timeout_s
        if timeout is None:
            return []
        return [
            task_id
            for task_id in self.state.outstanding
            if task_id not in self.pool and now - self.issued_at.get(task_id, now) > timeout
        ]

    async def expire_overdue_tasks(self) -> int:
        """Drop overdue tasks as `timeout` (replacements follow); returns how many."""
        async with self.lock:
            overdue = self.overdue_tasks(time.monotonic())
            for task_id in overdue:
                self.drop(task_id, "timeout")
            if overdue:
                log.warning("tasks_timed_out", num_tasks=len(overdue), first=overdue[0])
                await self.save_state()
                self.changed.set()
        return len(overdue)

    async def expire_tasks(self) -> None:
        timeout = self.config.task_timeout_s
        if timeout is None:
            return
        while not self.done.is_set():
            await asyncio.sleep(min(timeout / 4, 5.0))
            await self.expire_overdue_tasks()

    # ---- weights -------------------------------------------------------------------------

    async def newest_applied_version(self) -> int:
        infos = await self.bus.read_replicas()
        return max((i.weights_version for i in infos), default=self.applied_version)

    def on_weights_applied(self, version: int) -> None:
        if version > self.applied_version:
            self.applied_version = version
            log.info("weights_applied_seen", version=version)
            self.changed.set()

    async def subscribe_weights_applied(self):
        """Core subscription to `weights.applied` events: reacts faster than the registry poll."""
        from rlbus.wire import weights as weights_wire

        async def on_event(event, headers) -> None:  # the bus logs and skips undecodable ones
            if isinstance(event, weights_wire.WeightsApplied):
                self.on_weights_applied(event.version)

        return await self.bus.subscribe(
            self.bus.subjects.weights_applied, weights_wire.decoder, on_event
        )

    async def subscribe_weights_failed(self):
        """Core subscription to `weights.failed`: a replica that refused or failed a version says
        why (one error line each), so a run gated on that version never waits in silence."""
        from rlbus.wire import weights as weights_wire

        async def on_event(event, headers) -> None:
            if isinstance(event, weights_wire.WeightsFailed):
                log.error(
                    "weights_failed_seen",
                    version=event.version,
                    replica_id=event.replica_id,
                    reason=event.reason,
                )

        return await self.bus.subscribe(
            self.bus.subjects.weights_failed, weights_wire.decoder, on_event
        )

    async def watch_weights(self) -> None:
        subscriptions = [
            await self.subscribe_weights_applied(),
            await self.subscribe_weights_failed(),
        ]
        try:
            await self.poll_weights()
        finally:
            for subscription in subscriptions:
                await subscription.unsubscribe()

    async def poll_weights(self) -> None:
        while not self.done.is_set():
            gated = self.state.next_step > self.max_step()
            started = time.monotonic()
            try:
                version = await self.newest_applied_version()
            except Exception as error:
                log.warning("weights_version_read_failed", error=repr(error))
                version = self.applied_version
            self.on_weights_applied(version)
            await asyncio.sleep(WEIGHTS_POLL_S)
            if gated:
                self.stats.wait_weights_s += time.monotonic() - started

    # ---- rollouts ------------------------------------------------------------------------

    async def on_rollout(self, delivery: Delivery[Rollout]) -> None:
        rollout = delivery.data
        async with self.lock:
            fault = validation.problem(
                rollout,
                issued_cursor=self.state.cursor,
                group_size=self.config.group_size,
                next_step=self.state.next_step,
            )
            if fault is not None:
                await self.quarantine(delivery, fault)
                return
        if validation.eval_step(rollout.task_id) is not None:
            await self.on_eval_rollout(delivery)
            return
        async with self.lock:
            started = time.monotonic()
            await self.accept_rollout(delivery)
            await self.build_batches()
            self.stats.own_s += time.monotonic() - started
        self.changed.set()

    async def quarantine(self, delivery: Delivery[Rollout], fault: str) -> None:
        """A rollout that cannot be used: to the dead letters, never redelivered, its task
        dropped as `invalid` (a replacement task is issued; see docs/orchestrator.md)."""
        rollout = delivery.data
        log.error("rollout_quarantined", task_id=rollout.task_id, reason=fault)
        msg = delivery.msg
        await self.bus.dead_letter(
            self.bus.subjects.rollouts_stream, msg.subject, msg.data, msg.headers, fault
        )
        if rollout.task_id in self.state.outstanding:
            self.pool.pop(rollout.task_id, None)
            self.drop(rollout.task_id, "invalid")
            await self.save_state()
        await delivery.term(fault)
        self.changed.set()

    def drop(self, task_id: str, reason: str) -> None:
        """End an outstanding training task without training it, counted under `reason`."""
        if self.state.outstanding.pop(task_id, None) is None:
            return  # already batched or dropped: counted then
        self.issued_at.pop(task_id, None)
        self.state.dropped[reason] = self.state.dropped.get(reason, 0) + 1
        self.stats.dropped[reason] += 1
        count_dropped_task(reason)  # Prometheus (rlbus.obs.metrics)

    async def accept_rollout(self, delivery: Delivery[Rollout]) -> None:
        rollout = delivery.data
        if rollout.task_id not in self.state.outstanding:
            await delivery.ack()  # a duplicate of a task already batched or dropped
            return
        if rollout.task_id in self.pool:  # redelivered while pooled: keep the newest handle
            self.pool[rollout.task_id].delivery = delivery
            return
        reason = self.drop_reason(rollout)
        if reason == "zero_advantage":
            self.stats.no_signal_samples += rollout.samples
        if reason is not None:
            self.drop(rollout.task_id, reason)
            await self.save_state()
            await delivery.ack()
            log.debug("rollout_dropped", task_id=rollout.task_id, reason=reason)
            return
        rewards = [s.reward for s in rollout.samples]
        advantages = group_advantages(rewards, normalize=self.config.normalize_advantages)
        self.pool[rollout.task_id] = PooledGroup(rollout, delivery, advantages)
        self.stats.completion_tokens += sum(len(s.completion_token_ids) for s in rollout.samples)

    def drop_reason(self, rollout: Rollout) -> str | None:
        if rollout.error is not None or not rollout.samples:
            return "error"
        step = self.state.next_step
        if any(
            is_stale(step, s.policy_version, self.config.max_off_policy_steps)
            for s in rollout.samples
        ):
            return "stale"
        if self.config.filter_zero_advantage and not has_signal(
            [s.reward for s in rollout.samples]
        ):
            return "zero_advantage"
        return None

    def batch_ready(self) -> list[PooledGroup] | None:
        """The groups of the next batch (FIFO), or None if there are not enough yet."""
        chosen, num_samples, num_tokens = [], 0, 0
        for group in self.pool.values():
            chosen.append(group)
            num_samples += len(group.rollout.samples)
            num_tokens += sum(
                len(s.prompt_token_ids) + len(s.completion_token_ids) for s in group.rollout.samples
            )
            if self.config.token_budget is not None and num_tokens >= self.config.token_budget:
                return chosen
            if self.config.token_budget is None and num_samples >= self.config.batch_size:
                return chosen
        return None

    async def drop_stale_pooled(self) -> None:
        """Groups that waited in the pool until they became too old for the step being built."""
        step = self.state.next_step
        for task_id, group in list(self.pool.items()):
            if any(
                is_stale(step, s.policy_version, self.config.max_off_policy_steps)
                for s in group.rollout.samples
            ):
                del self.pool[task_id]
                self.drop(task_id, "stale")
                await self.save_state()
                await group.delivery.ack()

    async def build_batches(self) -> None:
        while not self.done.is_set() and self.state.next_step <= self.max_step():
            await self.drop_stale_pooled()
            groups = self.batch_ready()
            if not groups:
                return
            await self.publish_batch(groups)

    async def publish_batch(self, groups: list[PooledGroup]) -> None:
        step = self.state.next_step
        carriers = [{"traceparent": g.rollout.metadata.get("traceparent") or ""} for g in groups]
        links = [link for c in carriers if (link := tracing.link_from_headers(c)) is not None]
        with tracing.span(
            tracing.BATCH,
            context=self.traces.context(step),
            links=links,
            attributes={tracing.STEP_ATTR: step, "rlbus.batch.groups": len(groups)},
        ):
            batch = self.make_batch(step, groups)
            await self.bus.publish(
                self.bus.subjects.batch(step), batch, msg_id=self.bus.subjects.batch_msg_id(step)
            )
        for g in groups:
            del self.pool[g.rollout.task_id]
            if self.state.outstanding.pop(g.rollout.task_id, None) is not None:
                self.state.trained += 1
            self.issued_at.pop(g.rollout.task_id, None)
        self.state.next_step = step + 1
        await self.save_state()
        for g in groups:
            await g.delivery.ack()
        self.traces.end(step)
        await self.publish_metrics(step, batch.metrics)
        self.num_batches_published += 1
        record_batch(step, batch.metrics)  # Prometheus (rlbus.obs.metrics)
        log.info(
            "batch_published",
            step=step,
            num_samples=batch.num_samples,
            num_tokens=batch.num_tokens,
            reward_mean=round(batch.metrics.get("reward/mean", 0.0), 4),
        )
        self.stats = StepStats()
        if self.config.eval is not None and step % self.config.eval.interval == 0:
            self.tasks.spawn(f"eval_step_{step}", self.publish_eval_tasks(step))
        if self.config.max_steps is not None and step >= self.config.max_steps:
            self.done.set()

    def make_batch(self, step: int, groups: list[PooledGroup]) -> TrainBatch:
        samples = [s for g in groups for s in g.rollout.samples]
        train = [
            [
                make_train_sample(s, a, self.config.seq_len)
                for s, a in zip(g.rollout.samples, g.advantages, strict=True)
            ]
            for g in groups
        ]
        sequences = group_sequences(
            train, self.config.seq_len, share_prefixes=self.config.share_prefixes
        )
        micro = pack(sequences, seq_len=self.config.seq_len, num_ranks=self.config.num_train_ranks)
        versions = [s.policy_version for s in samples]
        return TrainBatch(
            step=step,
            micro_batches=micro,
            num_samples=len(samples),
            num_tokens=sum(len(seq) for seq in sequences),
            min_policy_version=min(versions),
            max_policy_version=max(versions),
            task_ids=[g.rollout.task_id for g in groups],
            metrics=self.step_metrics(step, samples, num_groups=len(groups)),
        )

    def step_metrics(self, step: int, samples, *, num_groups: int = 0) -> dict[str, float]:
        """The step's metrics; the task counts include the `num_groups` groups of this batch.

        `reward/*` describe every sample of the step: the batch's plus those of the groups
        dropped for zero advantage since the last batch (what other tools call the mean reward);
        `reward/trained_mean` is the batch's alone (docs/orchestrator.md, "Metrics")."""
        sampled = [*samples, *self.stats.no_signal_samples]
        rewards = [s.reward for s in sampled]
        lengths = [len(s.completion_token_ids) for s in samples]
        elapsed = max(time.monotonic() - self.stats.started, 1e-9)
        m: dict[str, float] = {
            "reward/mean": statistics.fmean(rewards),
            "reward/std": statistics.pstdev(rewards),
            "reward/min": min(rewards),
            "reward/max": max(rewards),
            "reward/trained_mean": statistics.fmean(s.reward for s in samples),
            "reward/num_samples": float(len(rewards)),
            "completion_len/mean": statistics.fmean(lengths),
            "completion_len/max": float(max(lengths)),
            "truncated/rate": sum(s.is_truncated for s in samples) / len(samples),
            "tasks/in_flight": float(len(self.state.outstanding) - len(self.pool)),
            "tokens_per_s": self.stats.completion_tokens / elapsed,
            "time/step_s": elapsed,
            "time/wait_weights_s": self.stats.wait_weights_s,
            "time/orchestrator_s": self.stats.own_s,
            "time/wait_rollouts_s": max(
                0.0, elapsed - self.stats.wait_weights_s - self.stats.own_s
            ),
            "weights/applied_version": float(self.applied_version),
        }
        for name in {k for s in sampled for k in s.reward_components}:
            m[f"reward/{name}/mean"] = statistics.fmean(
                s.reward_components.get(name, 0.0) for s in sampled
            )
        for lag, count in Counter(off_policy_lag(step, s.policy_version) for s in samples).items():
            m[f"off_policy_lag/{lag}"] = float(count)
        for reason in DROP_REASONS:
            m[f"dropped/{reason}"] = float(self.stats.dropped[reason])
            m[f"tasks/dropped/{reason}"] = float(self.state.dropped.get(reason, 0))
        m["tasks/issued"] = float(self.state.cursor)
        m["tasks/trained"] = float(self.state.trained + num_groups)
        m["tasks/outstanding"] = float(len(self.state.outstanding) - num_groups)
        return m

    async def publish_metrics(self, step: int, metrics: dict[str, float]) -> None:
        event = StepMetrics(service="orchestrator", step=step, metrics=metrics)
        await self.bus.publish(self.bus.subjects.metrics("orchestrator"), event)

    # ---- evaluation ----------------------------------------------------------------------

    async def publish_eval_tasks(self, step: int) -> None:
        ev = self.config.eval
        assert ev is not None
        env, args = self.envs[0]
        num = min(ev.num_examples, env.num_examples("eval") or ev.num_examples)
        self.eval_pending[step] = []
        tasks = [
            Task(
                task_id=f"eval-{step}-{i}",
                step=step,
                env_id=env.env_id,
                env_args=args,
                example_id=i,
                problem=env.example("eval", i),
                sampling=self.sampling_args(greedy=ev.greedy),
                group_size=1,
            )
            for i in range(num)
        ]
        await asyncio.gather(
            *(self.bus.publish(self.bus.subjects.tasks, t, msg_id=t.task_id) for t in tasks)
        )

    async def on_eval_rollout(self, delivery: Delivery[Rollout]) -> None:
        rollout = delivery.data
        step = validation.eval_step(rollout.task_id)
        await delivery.ack()
        rewards = self.eval_pending.get(step)
        if rewards is None:
            return  # an evaluation from before a restart
        rewards.extend(s.reward for s in rollout.samples)
        num = min(
            self.config.eval.num_examples,
            self.envs[0][0].num_examples("eval") or self.config.eval.num_examples,
        )
        if len(rewards) >= num:
            del self.eval_pending[step]
            metrics = {
                "eval/reward/mean": statistics.fmean(rewards),
                "eval/num_examples": float(len(rewards)),
            }
            self.eval_results[step] = metrics
            await self.publish_metrics(step, metrics)
            log.info("eval_done", step=step, reward_mean=round(metrics["eval/reward/mean"], 4))

    # ---- main ----------------------------------------------------------------------------

    def num_in_flight(self) -> int:
        """Training tasks issued whose rollouts have not come back yet."""
        return len(self.state.outstanding) - len(self.pool)

    async def drain(self) -> None:
        """Let the rollouts in flight come back (issue_tasks issues nothing while draining)."""
        log.info("coordinator_draining", in_flight=self.num_in_flight())
        while self.num_in_flight() > 0 and not self.done.is_set() and not self.service.stop_now:
            if self.service.left_of(DRAIN_TIMEOUT_S) <= 0:
                log.warning("coordinator_drain_timeout", in_flight=self.num_in_flight())
                return
            await self.tasks.wait(self.done, timeout_s=DRAIN_POLL_S)

    async def run(self, service: ServiceState | None = None) -> None:
        """Until `max_steps` is batched or the service is asked to stop (module docstring)."""
        self.service = service or self.service
        await self.load_state()
        if self.config.max_steps is not None and self.state.next_step > self.config.max_steps:
            log.info("coordinator_already_done", next_step=self.state.next_step)
            return
        s = self.bus.subjects
        consumer = self.bus.consumer(
            s.rollouts_stream,
            s.rollouts_durable,
            rollouts_wire.decoder,
            self.on_rollout,
            concurrency=64,
            auto_ack=False,
        )
        self.changed.set()
        try:
            async with self.tasks, consumer:
                self.tasks.spawn("issue_tasks", self.issue_tasks())
                self.tasks.spawn("watch_weights", self.watch_weights())
                self.tasks.spawn("expire_tasks", self.expire_tasks())
                await self.tasks.wait(self.service.stop_requested, self.done)
                if self.service.mode == "draining":
                    await self.drain()
                # pooled rollouts stay unacked (redelivered); a handler past the budget too
                await consumer.stop(
                    timeout_s=0 if self.service.stop_now else self.service.left_of(DRAIN_BUDGET_S)
                )
        finally:
            self.done.set()
            self.changed.set()
            self.traces.end_all()
        log.info(
            "coordinator_stopped",
            next_step=self.state.next_step,
            reason=self.service.reason or "max_steps",
        )
