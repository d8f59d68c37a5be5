"""The batcher: pooled groups become the step batches the trainer reads.

While the next step is allowed (`next_step <= max_step()` of the weights watcher) and the pool
holds enough, `build_batches` drops the pooled groups that became too old for that step (`stale`),
takes the oldest groups reaching `batch_size` samples (or `token_budget` tokens), packs them
(packing.py) into per-rank micro-batches and publishes step N's batch. Then, in this order: the
state is saved (its tasks trained, `next_step = N + 1`), the groups' rollouts are acked, samples
of the step are written when it keeps them (rollout_samples.py), the step's span ends, its metrics are published, and `on_published(N)` tells the coordinator (which
starts an evaluation, or ends the run at `max_steps`). A crash between the publish and the save is
repaired by the state store on restart (the batch log is the truth); one before the acks gets the
rollouts redelivered, and they are acked as duplicates.
"""

import asyncio
from collections.abc import Callable

import structlog

from rlbus.bus.client import Bus
from rlbus.configs.orchestrator import OrchestratorConfig
from rlbus.obs import tracing
from rlbus.rundirs import run_dir_of
from rlbus.wire.batches import TrainBatch
from rlbus_orchestrator.difficulty import DifficultyFilter
from rlbus_orchestrator.env_mix import EnvMix
from rlbus_orchestrator.group_pool import GroupPool, PooledGroup
from rlbus_orchestrator.metrics import record_batch
from rlbus_orchestrator.packing import group_sequences, make_train_sample, pack
from rlbus_orchestrator.rollout_samples import is_kept, write_step_samples
from rlbus_orchestrator.state_store import StateStore
from rlbus_orchestrator.step_metrics import StepStats, publish_metrics, step_metrics
from rlbus_orchestrator.step_traces import StepTraces
from rlbus_orchestrator.weights_watch import WeightsWatcher

log = structlog.get_logger()


def pack_groups(
    step: int, groups: list[PooledGroup], config: OrchestratorConfig, metrics: dict[str, float]
) -> TrainBatch:
    """Step `step`'s batch of `groups`: their samples with advantages, packed per rank."""
    samples = [s for g in groups for s in g.rollout.samples]
    train = [
        [
            make_train_sample(s, a, config.seq_len)
            for s, a in zip(g.rollout.samples, g.advantages, strict=True)
        ]
        for g in groups
    ]
    sequences = group_sequences(train, config.seq_len, share_prefixes=config.share_prefixes)
    micro = pack(sequences, seq_len=config.seq_len, num_ranks=config.num_train_ranks)
    versions = [s.policy_version for s in samples]
    return TrainBatch(
        step=step,
        micro_batches=micro,
        num_samples=len(samples),
        num_tokens=sum(len(seq) for seq in sequences),
        min_policy_version=min(versions),
        max_policy_version=max(versions),
        task_ids=[g.task_id for g in groups],
        metrics=metrics,
    )


class Batcher:
    """Builds and publishes step batches from the pool (module docstring). Callers hold the
    coordinator's lock around `build_batches`."""

    def __init__(
        self,
        bus: Bus,
        config: OrchestratorConfig,
        *,
        store: StateStore,
        pool: GroupPool,
        weights: WeightsWatcher,
        stats: StepStats,
        traces: StepTraces,
        done: asyncio.Event,
        on_published: Callable[[int], None],
        difficulty: DifficultyFilter | None = None,
    ) -> None:
        self.bus = bus
        self.config = config
        self.store = store
        self.pool = pool
        self.weights = weights
        self.stats = stats
        self.traces = traces
        self.done = done
        """Set when the coordinator ends: no batch is started after it."""
        self.on_published = on_published
        self.difficulty = difficulty
        """Told the outcome of each trained group (None: no filtering)."""
        self.mix = EnvMix(config)
        self.run_dir = run_dir_of(config) if config.run.name else None
        """Where the kept samples go (None: a coordinator without a run name keeps none)."""

    async def build_batches(self) -> None:
        """Publish every batch the pool holds and the weights allow."""
        while not self.done.is_set() and self.store.state.next_step <= self.weights.max_step():
            await self.drop_stale_pooled()
            groups = self.pool.next_batch_groups(
                batch_size=self.config.batch_size, token_budget=self.config.token_budget
            )
            if not groups:
                return
            await self.publish_batch(groups)

    async def drop_stale_pooled(self) -> None:
        """Groups that waited in the pool until they became too old for the step being built."""
        step = self.store.state.next_step
        for group in self.pool.take_stale(step, self.config.max_off_policy_steps):
            if self.store.record_dropped(group.task_id, "stale", group.rollout.env_id):
                self.stats.count_drop("stale", group.rollout.env_id)
                self.record_outcome(group)
            await self.store.save()
            await group.delivery.ack()

    async def publish_batch(self, groups: list[PooledGroup]) -> None:
        step = self.store.state.next_step
        batch = await self.publish(step, groups)
        self.pool.remove(groups)
        self.store.record_trained([g.task_id for g in groups])
        for group in groups:
            self.record_outcome(group)
        self.store.state.next_step = step + 1
        await self.store.save()
        for g in groups:
            await g.delivery.ack()
        await self.keep_samples(step, groups)
        self.traces.end(step)
        await publish_metrics(self.bus, step, batch.metrics)
        record_batch(step, batch.metrics)  # Prometheus (rlbus.obs.metrics)
        log.info(
            "batch_published",
            step=step,
            num_samples=batch.num_samples,
            num_tokens=batch.num_tokens,
            reward_mean=round(batch.metrics.get("reward/mean", 0.0), 4),
        )
        self.stats.reset()
        self.on_published(step)

    async def keep_samples(self, step: int, groups: list[PooledGroup]) -> None:
        """The step's samples for reading (rollout_samples.py), when it is one that keeps them;
        a failed write is a warning, never the end of the run."""
        config = self.config.samples
        if self.run_dir is None or config is None or not is_kept(config, step):
            return
        try:
            await asyncio.to_thread(write_step_samples, self.run_dir, config, step, groups)
        except OSError as error:
            log.warning("rollout_samples_not_written", step=step, error=str(error))

    async def publish(self, step: int, groups: list[PooledGroup]) -> TrainBatch:
        """Make step `step`'s batch and store it (message id `batch-<step>`), in a span linked
        to every rollout span it uses."""
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
        return batch

    def record_outcome(self, group: PooledGroup) -> None:
        """The group's task ended: its outcome goes to the difficulty filter's history."""
        if self.difficulty is not None:
            self.difficulty.record(group.task_id, [s.reward for s in group.rollout.samples])

    def make_batch(self, step: int, groups: list[PooledGroup]) -> TrainBatch:
        skipped = None
        if self.difficulty is not None and self.difficulty.enabled:
            skipped = self.difficulty.num_skipped(step)
        metrics = step_metrics(
            step,
            [g.rollout for g in groups],
            stats=self.stats,
            state=self.store.state,
            num_pooled=len(self.pool),
            applied_version=self.weights.applied_version,
            num_groups=len(groups),
            env_ids=self.mix.env_ids(),
            skipped=skipped,
        )
        return pack_groups(step, groups, self.config, metrics)
