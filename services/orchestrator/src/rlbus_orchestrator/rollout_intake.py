"""Rollout intake: each rollout from the `coordinator` durable, decoded, checked and either pooled,
dropped or quarantined.

In order (callers hold the coordinator's lock):
1. `quarantine_if_invalid`: a rollout that breaks what batching and training assume
   (validation.py) goes to the dead letters, is terminated (never redelivered) and its task is
   dropped as `invalid`; a replacement task follows.
2. evaluation rollouts go to the eval runner (the coordinator routes them).
3. `accept`: a rollout of a task no longer outstanding (already batched or dropped: a duplicate,
   or a late one) is acked and ignored; one redelivered while pooled refreshes the pooled handle;
   a failed, stale or flat group (no signal, with `filter_zero_advantage`) is dropped with that
   reason and acked; anything else is pooled with its advantages, unacked until its batch is
   stored.
"""

from collections.abc import Awaitable, Callable

import structlog

from rlbus.bus.client import Bus
from rlbus.bus.consumer import Consumer, Delivery
from rlbus.configs.orchestrator import OrchestratorConfig
from rlbus.wire import rollouts as rollouts_wire
from rlbus.wire.rollouts import Rollout
from rlbus_orchestrator import validation
from rlbus_orchestrator.advantages import group_advantages, has_signal
from rlbus_orchestrator.group_pool import GroupPool, PooledGroup
from rlbus_orchestrator.staleness import has_stale_sample
from rlbus_orchestrator.state_store import StateStore
from rlbus_orchestrator.step_metrics import StepStats

log = structlog.get_logger()

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
    ) -> None:
        self.bus = bus
        self.config = config
        self.store = store
        self.pool = pool
        self.stats = stats

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
        fault = validation.problem(
            delivery.data,
            issued_cursor=self.store.state.cursor,
            group_size=self.config.group_size,
            next_step=self.store.state.next_step,
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
        if self.store.record_dropped(task_id, reason):
            self.stats.dropped[reason] += 1

    async def accept(self, delivery: Delivery[Rollout]) -> None:
        """Pool a valid training rollout, or ack it as a duplicate or a drop (module docstring, 3)."""
        rollout = delivery.data
        if not self.store.is_outstanding(rollout.task_id):
            await delivery.ack()  # a duplicate of a task already batched or dropped
            return
        if rollout.task_id in self.pool:
            self.pool.refresh_delivery(delivery)
            return
        reason = self.drop_reason(rollout)
        if reason == "zero_advantage":
            self.stats.no_signal_samples += rollout.samples
        if reason is not None:
            self.drop(rollout.task_id, reason)
            await self.store.save()
            await delivery.ack()
            log.debug("rollout_dropped", task_id=rollout.task_id, reason=reason)
            return
        rewards = [s.reward for s in rollout.samples]
        advantages = group_advantages(rewards, normalize=self.config.normalize_advantages)
        self.pool.add(PooledGroup(rollout, delivery, advantages))
        self.stats.completion_tokens += sum(len(s.completion_token_ids) for s in rollout.samples)

    def drop_reason(self, rollout: Rollout) -> str | None:
        """Why a training group is dropped on arrival (`error`, `stale`, `zero_advantage`), or None."""
        if rollout.error is not None or not rollout.samples:
            return "error"
        step = self.store.state.next_step
        if has_stale_sample(step, rollout.samples, self.config.max_off_policy_steps):
            return "stale"
        if self.config.filter_zero_advantage and not has_signal(
            [s.reward for s in rollout.samples]
        ):
            return "zero_advantage"
        return None
