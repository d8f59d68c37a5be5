"""Rollout intake: each rollout from the `coordinator` durable, decoded, checked and either pooled,
dropped or quarantined.

In order (callers hold the coordinator's lock):
1. `quarantine_if_invalid`: a rollout that breaks what batching and training assume
   (validation.py) goes to the dead letters, is terminated (never redelivered) and its task is
   dropped as `invalid`; a replacement task follows.
2. evaluation rollouts go to the eval runner (the coordinator routes them).
3. `accept`: a rollout of a task no longer outstanding (already batched or dropped: a duplicate,
   or a late one) is acked and ignored; one redelivered while pooled refreshes the pooled handle;
   the episodes its worker left out are counted (`Rollout.dropped`); a failed group, or one left
   with fewer samples than its environment's min_group_size (dropped as `error` or `timeout`,
   whichever left out more episodes), a stale or a flat group (no signal, with
   `filter_zero_advantage`) is dropped with that reason and acked; anything else is pooled with
   the advantages of its samples (the survivors of a partial group), unacked until its batch is
   stored.
"""

from collections import Counter
from collections.abc import Awaitable, Callable

import structlog

from rlbus.bus.client import Bus
from rlbus.bus.consumer import Consumer, Delivery
from rlbus.configs.orchestrator import OrchestratorConfig
from rlbus.wire import rollouts as rollouts_wire
from rlbus.wire.rollouts import Rollout
from rlbus_orchestrator import validation
from rlbus_orchestrator.advantages import group_advantages, has_signal
from rlbus_orchestrator.difficulty import DifficultyFilter
from rlbus_orchestrator.env_mix import EnvMix
from rlbus_orchestrator.group_pool import GroupPool, PooledGroup
from rlbus_orchestrator.staleness import has_stale_sample
from rlbus_orchestrator.state_store import EPISODE_DROP_REASONS, StateStore
from rlbus_orchestrator.step_metrics import StepStats

log = structlog.get_logger()

STALLED_EVERY = 100
"""Groups dropped in a row (none kept) between two `no_group_kept` warnings."""

HANDLER_CONCURRENCY = 64
"""Rollouts handled at once (they queue on the coordinator's lock; the rest wait in the stream)."""


class RolloutIntake:
    """Validation, deduplication and the drop decisions for arriving rollouts."""

    def __init__(
        self,
        bus: Bus,
        config: OrchestratorConfig,
        *,
        store: StateStore,
        pool: GroupPool,
        stats: StepStats,
        difficulty: DifficultyFilter | None = None,
    ) -> None:
        self.bus = bus
        self.config = config
        self.store = store
        self.pool = pool
        self.stats = stats
        self.mix = EnvMix(config)
        self.difficulty = difficulty
        """Told the outcome of each group dropped with known rewards (None: no filtering)."""
        self.dropped_in_a_row: Counter[str] = Counter()
        """Groups dropped since the last one kept, by reason (STALLED_EVERY)."""

    def consumer(
        self, handler: Callable[[Delivery[Rollout]], Awaitable[None]]
    ) -> Consumer[Rollout]:
        """The rollouts consumer (manual acks: a pooled rollout is acked after its batch)."""
        s = self.bus.subjects
        return self.bus.consumer(
            s.rollouts_stream,
            s.rollouts_durable,
            rollouts_wire.decoder,
            handler,
            concurrency=HANDLER_CONCURRENCY,
            auto_ack=False,
        )

    async def quarantine_if_invalid(self, delivery: Delivery[Rollout]) -> bool:
        """Whether the rollout was unusable and is quarantined now (module docstring, 1)."""
        env = self.mix.of_task(delivery.data.task_id)
        fault = validation.problem(
            delivery.data,
            issued_cursor=self.store.state.cursor,
            group_size=self.config.group_size if env is None else env.group_size,
            next_step=self.store.state.next_step,
            env_id=None if env is None else env.env_id,
        )
        if fault is not None:
            await self.quarantine(delivery, fault)
        return fault is not None

    async def quarantine(self, delivery: Delivery[Rollout], fault: str) -> None:
        """A rollout that cannot be used: to the dead letters, never redelivered, its task
        dropped as `invalid` (a replacement task is issued; see docs/orchestrator.md)."""
        rollout = delivery.data
        log.error("rollout_quarantined", task_id=rollout.task_id, reason=fault)
        msg = delivery.msg
        await self.bus.dead_letter(
            self.bus.subjects.rollouts_stream, msg.subject, msg.data, msg.headers, fault
        )
        if self.store.is_outstanding(rollout.task_id):
            self.pool.pop(rollout.task_id)
            self.drop(rollout.task_id, "invalid")
            await self.store.save()
        await delivery.term(fault)

    def drop(self, task_id: str, reason: str) -> None:
        env_id = self.mix.env_id_of(task_id)
        if self.store.record_dropped(task_id, reason, env_id):
            self.stats.count_drop(reason, env_id)

    async def accept(self, delivery: Delivery[Rollout]) -> None:
        """Pool a valid training rollout, or ack it as a duplicate or a drop (module docstring, 3)."""
        rollout = delivery.data
        if not self.store.is_outstanding(rollout.task_id):
            await delivery.ack()  # a duplicate of a task already batched or dropped
            return
        if rollout.task_id in self.pool:
            self.pool.refresh_delivery(delivery)
            return
        self.stats.count_dropped_episodes(rollout)
        reason = self.drop_reason(rollout)
        if reason == "zero_advantage":
            self.stats.no_signal.append(rollout)
        if reason is not None:
            self.drop(rollout.task_id, reason)
            if reason in ("zero_advantage", "stale") and self.difficulty is not None:
                self.difficulty.record(rollout.task_id, [s.reward for s in rollout.samples])
            await self.store.save()
            await delivery.ack()
            error = rollout.error or rollout.metadata.get("episode_error")
            log.debug("rollout_dropped", task_id=rollout.task_id, reason=reason, error=error)
            self.count_drop_in_a_row(reason, rollout.env_id, error)
            return
        self.dropped_in_a_row.clear()
        rewards = [s.reward for s in rollout.samples]
        advantages = group_advantages(rewards, normalize=self.config.normalize_advantages)
        self.pool.add(PooledGroup(rollout, delivery, advantages))
        self.stats.completion_tokens += sum(len(s.completion_token_ids) for s in rollout.samples)

    def count_drop_in_a_row(self, reason: str, env_id: str, error: str | None) -> None:
        """Every STALLED_EVERY groups dropped with none kept in between, one warning that says
        why: a run whose model scores the same on every sample of every group (or whose
        episodes all fail) otherwise samples forever without a step or a line."""
        self.dropped_in_a_row[reason] += 1
        total = sum(self.dropped_in_a_row.values())
        if total % STALLED_EVERY:
            return
        hints = {
            "zero_advantage": "every sample of these groups scored the same, so they teach "
            "nothing (orchestrator.filter_zero_advantage drops them): check that the model can "
            "earn a reward on the environment, or set filter_zero_advantage = false",
            "error": f"their episodes failed; the last error: {error}",
            "timeout": "their episodes timed out (env episode_timeout_s, orchestrator.http)",
            "stale": "they were too far behind the trainer (orchestrator.max_off_policy_steps)",
        }
        main = self.dropped_in_a_row.most_common(1)[0][0]
        log.warning(
            "no_group_kept",
            dropped_in_a_row=total,
            by_reason=dict(self.dropped_in_a_row),
            env_id=env_id,
            next_step=self.store.state.next_step,
            why=hints.get(main, main),
        )

    def drop_reason(self, rollout: Rollout) -> str | None:
        """Why a training group is dropped on arrival (`error` or `timeout`: failed, or too few
        samples left; `stale`, `zero_advantage`), or None."""
        env = self.mix.of_task(rollout.task_id)
        min_samples = 1 if env is None else env.min_group_size
        if rollout.error is not None or len(rollout.samples) < max(1, min_samples):
            return failure_reason(rollout.dropped)
        step = self.store.state.next_step
        if has_stale_sample(step, rollout.samples, self.config.max_off_policy_steps):
            return "stale"
        if self.config.filter_zero_advantage and not has_signal(
            [s.reward for s in rollout.samples]
        ):
            return "zero_advantage"
        return None


def failure_reason(dropped: dict[str, int]) -> str:
    """The drop reason of a group that failed: the reason of most of its left-out episodes
    (`error` on a tie, or when none were reported)."""
    return max(EPISODE_DROP_REASONS, key=lambda reason: dropped.get(reason, 0))
