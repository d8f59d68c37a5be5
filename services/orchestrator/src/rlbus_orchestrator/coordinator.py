"""The coordinator: hands out tasks, turns rollouts into train batches, keeps the run resumable.

It is the wiring of named parts, each in a module of its own; this module holds the asyncio
tasks, the events they wait on and the lock they share, and the order of a shutdown.

    ┌──────────────── Coordinator.run() ────────────────────────────────────────────────────────┐
    │                                                                                           │
    │  watch_weights (WeightsWatcher) ──(applied version)──┐                                    │
    │                                                      ▼                                    │
    │  issue_tasks (TaskIssuer) ──tasks──▶ [tasks stream] ──▶ rollout workers ──▶ [rollouts]    │
    │      ▲  (wakes on `changed`)                                                    │         │
    │      │                                                                          ▼         │
    │      └──── changed ◀── on_rollout (consumer handler, RolloutIntake.consumer) ◀──┘         │
    │                          │ invalid (RolloutIntake): dead letter, term (counted)           │
    │                          │ eval task: EvalRunner, ack                                     │
    │                          │ duplicate / stale / error / no signal (RolloutIntake): ack     │
    │                          ▼ else: GroupPool (unacked, heartbeated by the consumer)         │
    │                      Batcher ──▶ [batches stream, subject per step]                       │
    │                          then: StateStore.save, ack the batch's rollouts, metrics,        │
    │                          after_batch: spawn eval_step_N (EvalRunner) / done at max_steps  │
    │  expire_tasks (TaskIssuer): overdue tasks dropped as `timeout` ──▶ changed                │
    └───────────────────────────────────────────────────────────────────────────────────────────┘

| asyncio task (part)            | waits on                    | unblocked by               |
| ------------------------------ | --------------------------- | -------------------------- |
| run                            | `stop_requested` or `done`  | a stop request; max_steps  |
| watch_weights (WeightsWatcher) | registry poll (1 s); events | a replica applying weights |
| issue_tasks (TaskIssuer)       | `changed`; `unpaused`       | a rollout, new weights, a  |
|                                |                             | batch, a timeout; `Resume` |
| expire_tasks (TaskIssuer)      | poll (timeout / 4, <= 5 s)  | -                          |
| rollouts (RolloutIntake)       | pull fetch (`coordinator`)  | a worker's rollout         |
|   handler (+ pool, Batcher)    | `lock` (one at a time)      | the holder releasing it    |
| eval_step_N (EvalRunner)       | its tasks' publish acks     | -                          |

Every change of the state, the pool or the step counters happens under `lock`: the handler holds it
while a rollout is checked, pooled and batched, `issue_tasks` while it issues, `expire_tasks`
while it drops. The parts: `state_store` (CoordinatorState, write-ahead cursors, accounting,
resume), `task_issue` (cursor, environments, which policy version to ask for, expiry),
`weights_watch` (applied version, how far ahead to work), `rollout_intake` (validate, quarantine,
dedup, drop), `group_pool` + `staleness` (pooling, staleness), `batcher` (packing into step
batches), `difficulty` (each prompt's outcomes, fed by the intake and the batcher; the prompts
task issue passes over), `step_metrics`, `step_traces`, `eval_runner`.

Pause (control `Pause`, until `Resume`): issue_tasks issues nothing; rollouts still in flight are
pooled and batched as usual. Drain (SIGTERM/SIGINT, control `Drain`): stop issuing, wait up to
DRAIN_TIMEOUT_S for the rollouts in flight to come back (batched or dropped), then the clean
shutdown. Stop (control `Stop`): the clean shutdown at once, without waiting for handlers.

Bus stalls: a state read or save that fails with a transient bus error (timeout, reconnecting) is
retried with a `coordinator_bus_retry` line for up to `bus.publish_retry_s` (publishes retry
themselves, rlbus.bus.core), so a NATS outage shorter than that is ridden out; past it the task
raises and the supervisor ends the service with exit 1 and one `service_task_failed` line.

Clean shutdown, in order: `run` wakes (stop requested, or `done` at `max_steps`); a drain waits
for the rollouts in flight; the consumer stops (handlers get what is left of DRAIN_BUDGET_S;
pooled rollouts stay unacked and are redelivered to the next coordinator); leaving the task
supervisor cancels issue_tasks, watch_weights, expire_tasks and evaluations; `done` is set and
the open step spans end. The state needs no final save: every change was saved under the lock
before it was acted on. A task that raises (TaskFailed) takes the same path minus the drain and
ends the service with exit 1.

Crash (kill -9): nothing more runs. The restart repairs it from the bus: the state store adopts
batches stored after the last save, task issue republishes the write-ahead cursors (deduplicated
by message id), unacked rollouts come back after AckWait and those of tasks no longer outstanding
are acked as duplicates; outstanding tasks restart their `task_timeout_s` clock.
"""

import asyncio
import time

import structlog

from rlbus.bus.client import Bus
from rlbus.bus.consumer import Delivery
from rlbus.configs.orchestrator import OrchestratorConfig
from rlbus.lifecycle import DRAIN_BUDGET_S, ServiceState, TaskSupervisor
from rlbus.rundirs import run_dir_of
from rlbus.wire.rollouts import Rollout
from rlbus_orchestrator import validation
from rlbus_orchestrator.batcher import Batcher
from rlbus_orchestrator.eval_runner import EvalRunner
from rlbus_orchestrator.evaluation import eval_envs
from rlbus_orchestrator.group_pool import GroupPool
from rlbus_orchestrator.rollout_intake import RolloutIntake
from rlbus_orchestrator.state_store import StateStore
from rlbus_orchestrator.step_metrics import StepStats, replay_lost_metrics
from rlbus_orchestrator.step_traces import StepTraces
from rlbus_orchestrator.task_issue import TaskIssuer, load_run_envs, make_difficulty_filter
from rlbus_orchestrator.weights_watch import WeightsWatcher

log = structlog.get_logger()

DRAIN_TIMEOUT_S = 20.0
"""How long a drain waits for the rollouts in flight, counted from the drain request; the rest of
rlbus.lifecycle.DRAIN_BUDGET_S is left to the consumers' handlers and the workers."""
DRAIN_POLL_S = 0.2


class Coordinator:
    """One per run: the parts, the events and lock they share, and the tasks (module docstring)."""

    def __init__(self, bus: Bus, config: OrchestratorConfig) -> None:
        self.bus = bus
        self.config = config
        self.changed = asyncio.Event()
        """Something that may make tasks due happened (issue_tasks wakes on it)."""
        self.lock = asyncio.Lock()
        self.done = asyncio.Event()
        """`max_steps` batched, or the coordinator is ending."""
        self.service = ServiceState("orchestrator")
        """Paused / draining / stopping: replaced by the service's own in `run`."""
        self.tasks = TaskSupervisor()
        """issue_tasks, watch_weights, expire_tasks and evaluations: one that raises ends the
        coordinator."""
        envs = load_run_envs(config)
        self.stats = StepStats()
        self.traces = StepTraces()
        self.store = StateStore(bus, retry_s=config.bus.publish_retry_s)
        self.pool = GroupPool()
        store, pool, stats = self.store, self.pool, self.stats
        self.difficulty = make_difficulty_filter(config, envs, store)
        difficulty = self.difficulty
        self.weights = WeightsWatcher(
            bus, config, store=store, stats=stats, on_new_version=self.changed.set
        )
        weights = self.weights
        self.issuer = TaskIssuer(
            bus,
            config,
            envs,
            store=store,
            pool=pool,
            weights=weights,
            traces=self.traces,
            stats=stats,
            difficulty=difficulty,
        )
        self.intake = RolloutIntake(
            bus, config, store=store, pool=pool, stats=stats, difficulty=difficulty
        )
        self.batcher = Batcher(
            bus,
            config,
            store=store,
            pool=pool,
            weights=weights,
            stats=stats,
            traces=self.traces,
            done=self.done,
            on_published=self.after_batch,
            difficulty=difficulty,
        )
        self.evals = EvalRunner(
            bus,
            config,
            eval_envs(config),
            weights=weights,
            run_dir=run_dir_of(config) if config.run.name else None,
        )

    async def load_state(self) -> None:
        """The saved state (stored batches adopted), and the interrupted publish redone."""
        state = await self.store.load()
        await replay_lost_metrics(self.bus, state.next_step - 1)
        await self.issuer.resume()
        log.info(
            "coordinator_state_loaded",
            next_step=state.next_step,
            cursor=state.cursor,
            outstanding=len(state.outstanding),
        )

    # ---- the asyncio tasks and the rollout handler -----------------------------------------

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
                await self.issuer.issue_due_tasks()
                self.stats.own_s += time.monotonic() - started

    async def expire_tasks(self) -> None:
        poll_s = self.issuer.expiry_poll_s()
        if poll_s is None:
            return
        while not self.done.is_set():
            await asyncio.sleep(poll_s)
            async with self.lock:
                if await self.issuer.expire_overdue_tasks():
                    self.changed.set()

    async def on_rollout(self, delivery: Delivery[Rollout]) -> None:
        """The rollouts consumer's handler (module docstring, the diagram)."""
        async with self.lock:
            if await self.intake.quarantine_if_invalid(delivery):
                self.changed.set()
                return
        if validation.eval_step(delivery.data.task_id) is not None:
            await self.evals.on_rollout(delivery)
            return
        async with self.lock:
            started = time.monotonic()
            await self.intake.accept(delivery)
            await self.batcher.build_batches()
            self.stats.own_s += time.monotonic() - started
        self.changed.set()

    def after_batch(self, step: int) -> None:
        """Step `step`'s batch is stored: start its evaluation if due; end at `max_steps`."""
        if self.evals.is_due(step):
            self.start_eval(step)
        if self.config.max_steps is not None and step >= self.config.max_steps:
            self.done.set()

    def start_eval(self, step: int) -> None:
        self.evals.start(step)
        self.tasks.spawn(f"eval_step_{step}", self.evals.evaluate(step))

    def start_missed_evals(self) -> None:
        """At start: the evaluation of the starting weights before the first batch, and of the
        last step once it is batched, unless they are recorded (eval_runner.py)."""
        last = self.store.state.next_step - 1
        steps = {0} if last == 0 else set()
        if last == self.config.max_steps:
            steps.add(last)
        for step in sorted(steps):
            if self.evals.is_due(step) and not self.evals.is_recorded(step):
                self.start_eval(step)

    # ---- run and shutdown ------------------------------------------------------------------

    def num_in_flight(self) -> int:
        """Training tasks issued whose rollouts have not come back yet."""
        return len(self.store.state.outstanding) - len(self.pool)

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
        next_step = self.store.state.next_step
        finished = self.config.max_steps is not None and next_step > self.config.max_steps
        last_eval_missing = self.evals.is_due(next_step - 1) and not self.evals.is_recorded(
            next_step - 1
        )
        if finished and not last_eval_missing:
            log.info("coordinator_already_done", next_step=next_step)
            return
        consumer = self.intake.consumer(self.on_rollout)
        self.changed.set()
        try:
            async with self.tasks, consumer:
                if finished:
                    self.done.set()
                else:
                    self.tasks.spawn("issue_tasks", self.issue_tasks())
                self.tasks.spawn("watch_weights", self.weights.watch())
                self.tasks.spawn("expire_tasks", self.expire_tasks())
                self.start_missed_evals()
                await self.tasks.wait(self.service.stop_requested, self.done)
                if self.done.is_set() and not self.evals.idle.is_set():
                    log.info("coordinator_waiting_for_evals", steps=sorted(self.evals.running))
                    await self.tasks.wait(self.service.stop_requested, self.evals.idle)
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
            next_step=self.store.state.next_step,
            reason=self.service.reason or "max_steps",
        )
