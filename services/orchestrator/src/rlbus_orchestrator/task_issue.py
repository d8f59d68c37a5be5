"""Task issue: which training tasks to publish, what each holds, and when one is overdue.

Issuing rule: keep `pooled + in_flight >= batch_size * (max_step - next_step + 1)` samples on
the way, where a task in flight counts its environment's group size and `max_step` is the weights
watcher's (never more than `async_level` steps ahead of the newest applied weights, never past
`max_steps`). New cursors are issued one by one until their groups cover what is missing; with
the difficulty filter on, a cursor whose prompt is skipped is passed over (difficulty.py: counted
in the state's `skipped`, never issued).

A task is `train-<cursor>`: the data cursor picks the environment (env_mix.py: seeded by the
cursor, by the environments' weights) and its example (`dataset_index`), so a task republished
after a crash is the same message with the same id, and the bus deduplicates it. It carries its
environment's sampling, group size and episode limits, and asks for weights no older than
`min_policy_version` of the step it is issued for. The cursors of a publish are saved
before it (the state store's write-ahead cursors) and republished by `resume` after a restart.

A task whose rollout has not come back `task_timeout_s` after its issue is overdue: the coordinator
drops it as `timeout` and a replacement is issued (its clock restarts with the coordinator).
"""

import asyncio
import functools
import random
import time
from dataclasses import dataclass
from typing import Any

import structlog

from rlbus.bus.client import Bus
from rlbus.configs.orchestrator import DifficultyFilterConfig, OrchestratorConfig
from rlbus.obs import tracing
from rlbus.wire.tasks import Task
from rlbus_orchestrator.difficulty import DifficultyFilter, Prompt, Selection
from rlbus_orchestrator.env_mix import EnvMix, EnvSettings, env_settings
from rlbus_orchestrator.env_mix import sampling_args as sampling_args  # eval_runner's import
from rlbus_orchestrator.envs import Environment, load_environment
from rlbus_orchestrator.group_pool import GroupPool
from rlbus_orchestrator.staleness import min_policy_version
from rlbus_orchestrator.state_store import StateStore
from rlbus_orchestrator.step_metrics import StepStats
from rlbus_orchestrator.step_traces import StepTraces
from rlbus_orchestrator.weights_watch import WeightsWatcher

log = structlog.get_logger()


@dataclass
class RunEnv:
    """One environment of the run (`config.env[i]`), loaded."""

    env: Environment
    args: dict[str, Any]
    weight: float
    """Relative share of the training tasks."""
    settings: EnvSettings
    """Its id (the config's), sampling, group size and episode limits (env_mix.py)."""


def load_run_envs(config: OrchestratorConfig) -> list[RunEnv]:
    return [
        RunEnv(load_environment(e.id, e.args), e.args, e.weight, settings)
        for e, settings in zip(config.env, env_settings(config), strict=True)
    ]


def dataset_index(cursor: int, num_examples: int | None, seed: int) -> int:
    """Example index of a data cursor: the cursor itself for generated data, else a per-epoch shuffle."""
    if num_examples is None:
        return cursor
    epoch, pos = divmod(cursor, num_examples)
    return epoch_order(num_examples, seed, epoch)[pos]


@functools.lru_cache(maxsize=8)
def epoch_order(num_examples: int, seed: int, epoch: int) -> tuple[int, ...]:
    """The example indices of one epoch in their shuffled order (kept: the difficulty filter
    looks at many cursors of the same epoch when it passes skipped prompts over)."""
    order = list(range(num_examples))
    random.Random(f"{seed}/{epoch}").shuffle(order)
    return tuple(order)


def make_difficulty_filter(
    config: OrchestratorConfig, envs: list[RunEnv], store: StateStore
) -> DifficultyFilter:
    """The run's difficulty filter: prompts of the environments with a finite train set, each
    environment with its own settings (env[].difficulty_filter over the orchestrator's)."""
    mix = EnvMix(config)
    sizes = [run_env.env.num_examples("train") for run_env in envs]

    def prompt_of(cursor: int) -> Prompt | None:
        entry = mix.index(cursor)
        size = sizes[entry]
        if size is None:
            return None
        return envs[entry].settings.env_id, dataset_index(cursor, size, config.seed)

    # entries sharing an id share their prompts: the first entry's size and filter count
    num_prompts: dict[str, int] = {}
    configs: dict[str, DifficultyFilterConfig] = {}
    for env, size, settings in zip(config.env, sizes, mix.settings, strict=True):
        if size is not None:
            num_prompts.setdefault(settings.env_id, size)
            configs.setdefault(settings.env_id, config.env_difficulty_filter(env))
    return DifficultyFilter(configs, store, prompt_of=prompt_of, num_prompts=num_prompts)


def task_id_of(cursor: int) -> str:
    return f"train-{cursor}"


class TaskIssuer:
    """Publishes the training tasks that are due and times out those that never come back.
    Callers hold the coordinator's lock around `issue_due_tasks` and `expire_overdue_tasks`."""

    def __init__(
        self,
        bus: Bus,
        config: OrchestratorConfig,
        envs: list[RunEnv],
        *,
        store: StateStore,
        pool: GroupPool,
        weights: WeightsWatcher,
        traces: StepTraces,
        stats: StepStats,
        difficulty: DifficultyFilter | None = None,
    ) -> None:
        self.bus = bus
        self.config = config
        self.envs = envs
        self.store = store
        self.difficulty = difficulty or make_difficulty_filter(config, envs, store)
        """Which prompts to pass over (difficulty.py; skips nothing unless enabled)."""
        self.pool = pool
        self.weights = weights
        self.traces = traces
        self.stats = stats
        self.mix = EnvMix(config)
        self.issued_at: dict[str, float] = {}
        """task_id -> monotonic time it was issued (or the coordinator started, after a restart);
        entries of tasks no longer outstanding are ignored, and pruned as tasks are issued."""

    def make_task(self, cursor: int) -> Task:
        run_env = self.envs[self.mix.index(cursor)]
        settings = run_env.settings
        index = dataset_index(cursor, run_env.env.num_examples("train"), self.config.seed)
        step = self.store.state.next_step
        return Task(
            task_id=task_id_of(cursor),
            step=step,
            env_id=settings.env_id,
            env_args=run_env.args,
            example_id=index,
            problem=run_env.env.example("train", index),
            sampling=settings.sampling,
            group_size=settings.group_size,
            limits=settings.limits,
            min_policy_version=min_policy_version(step, self.config.max_off_policy_steps),
        )

    def samples_on_the_way(self) -> int:
        """Samples pooled, plus the full groups of the tasks in flight (issued, not pooled)."""
        state = self.store.state
        in_flight = [c for t, c in state.outstanding.items() if t not in self.pool]
        return self.pool.num_samples() + sum(self.mix.of_cursor(c).group_size for c in in_flight)

    def num_tasks_to_issue(self) -> int:
        return len(self.cursors_to_issue()[0])

    def cursors_to_issue(self) -> tuple[list[int], int, Selection]:
        """The cursors due now, the cursor after them, and the difficulty filter's skips: from
        the data cursor on, the cursors of skipped prompts are passed over."""
        state = self.store.state
        selection = self.difficulty.selection(state.next_step)
        steps_ahead = self.weights.max_step() - state.next_step + 1
        if steps_ahead <= 0:
            return [], state.cursor, selection
        missing = self.config.batch_size * steps_ahead - self.samples_on_the_way()
        cursors, cursor = [], state.cursor
        while missing > 0:  # each next cursor's group, whatever its environment's size
            if not selection.passes_over(cursor):
                cursors.append(cursor)
                missing -= self.mix.of_cursor(cursor).group_size
            cursor += 1
        return cursors, cursor, selection

    def expected_steps(self, cursors: list[int]) -> list[int]:
        """The step the groups of `cursors` (just recorded as issued) should land in: batches
        take groups first in, first out, after those pooled and in flight (a guess for tracing:
        a dropped or partial group moves the later ones on)."""
        state = self.store.state
        new = set(map(task_id_of, cursors))
        in_flight = [c for t, c in state.outstanding.items() if t not in self.pool and t not in new]
        ahead = self.pool.num_samples() + sum(self.mix.of_cursor(c).group_size for c in in_flight)
        steps = []
        for cursor in cursors:
            steps.append(state.next_step + ahead // self.config.batch_size)
            ahead += self.mix.of_cursor(cursor).group_size
        return steps

    async def issue_due_tasks(self) -> int:
        """Publish the tasks due now (write-ahead cursors saved first); returns how many."""
        cursors, next_cursor, selection = self.cursors_to_issue()
        num = len(cursors)
        if not num:
            return 0
        self.stats.count_skips(selection.num_skips, selection.num_forced)
        self.store.record_issued({task_id_of(c): c for c in cursors}, next_cursor)
        self.forget_ended_tasks()
        self.issued_at.update(dict.fromkeys(map(task_id_of, cursors), time.monotonic()))
        await self.store.save_write_ahead(cursors)
        await self.publish_tasks(cursors)
        await self.store.save_published()
        log.debug("tasks_published", num_tasks=num, cursor=self.store.state.cursor)
        return num

    async def publish_tasks(self, cursors: list[int]) -> None:
        """Publish concurrently (one round trip, not one per task); ids make a retry a no-op.
        Each task is published in the trace of the step its group is expected to land in."""
        tasks = [self.make_task(cursor) for cursor in cursors]

        async def publish(task: Task, step: int) -> None:
            with tracing.use_context(self.traces.context(step)):
                await self.bus.publish(self.bus.subjects.tasks, task, msg_id=task.task_id)

        await asyncio.gather(
            *(publish(t, step) for t, step in zip(tasks, self.expected_steps(cursors), strict=True))
        )

    async def resume(self) -> None:
        """After the state is loaded: the outstanding tasks' clocks start now, and a publish
        that a crash interrupted is done again (deduplicated by message id)."""
        self.issued_at = dict.fromkeys(self.store.state.outstanding, time.monotonic())
        if self.store.state.publishing:
            await self.publish_tasks(self.store.state.publishing)

    def forget_ended_tasks(self) -> None:
        """Drop the issue times of tasks batched or dropped since (they are never overdue)."""
        outstanding = self.store.state.outstanding
        self.issued_at = {t: at for t, at in self.issued_at.items() if t in outstanding}

    def overdue_tasks(self, now: float) -> list[str]:
        """In-flight tasks (issued, no rollout pooled) older than `task_timeout_s`."""
        timeout = self.config.task_timeout_s
        if timeout is None:
            return []
        return [
            task_id
            for task_id in self.store.state.outstanding
            if task_id not in self.pool and now - self.issued_at.get(task_id, now) > timeout
        ]

    async def expire_overdue_tasks(self) -> int:
        """Drop overdue tasks as `timeout` (replacements follow); returns how many."""
        overdue = self.overdue_tasks(time.monotonic())
        for task_id in overdue:
            env_id = self.mix.env_id_of(task_id)
            if self.store.record_dropped(task_id, "timeout", env_id):
                self.stats.count_drop("timeout", env_id)
        self.forget_ended_tasks()
        if overdue:
            log.warning("tasks_timed_out", num_tasks=len(overdue), first=overdue[0])
            await self.store.save()
        return len(overdue)

    def expiry_poll_s(self) -> float | None:
        """How often to look for overdue tasks (None: tasks never time out)."""
        timeout = self.config.task_timeout_s
        return None if timeout is None else min(timeout / 4, 5.0)
