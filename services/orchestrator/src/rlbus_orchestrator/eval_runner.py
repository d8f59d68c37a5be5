"""The eval runner: in-run evaluations through the same rollout workers as training.

Every `eval.interval` steps (once that step's batch is stored) the coordinator starts one: the
first `eval.num_examples` examples of the first environment's eval split go out as tasks
`eval-<step>-<i>` (group 1, greedy unless `eval.greedy = false`). Their rollouts come back on the
rollouts stream; the coordinator hands them here once they pass validation, and they are acked at
once (never pooled, never trained). When all are in, `eval/reward/mean` and `eval/num_examples`
are published as the step's `StepMetrics`. Training never waits for an evaluation, and one
interrupted by a restart is not repeated (its late rollouts are acked and ignored).
"""

import asyncio
import statistics

import structlog

from rlbus.bus.client import Bus
from rlbus.bus.consumer import Delivery
from rlbus.configs.orchestrator import EvalConfig, SamplingConfig
from rlbus.wire.rollouts import Rollout
from rlbus.wire.tasks import Task
from rlbus_orchestrator import validation
from rlbus_orchestrator.step_metrics import publish_metrics
from rlbus_orchestrator.task_issue import RunEnv, sampling_args

log = structlog.get_logger()


class EvalRunner:
    """Evaluations of one run: `publish_tasks(step)` starts one, `on_rollout` collects it."""

    def __init__(
        self, bus: Bus, config: EvalConfig | None, sampling: SamplingConfig, run_env: RunEnv
    ) -> None:
        self.bus = bus
        self.config = config
        self.sampling = sampling
        self.run_env = run_env
        self.pending: dict[int, list[float]] = {}
        """step -> rewards of its evaluation so far, while it runs."""
        self.results: dict[int, dict[str, float]] = {}
        """step -> the metrics of its finished evaluation."""

    def is_due(self, step: int) -> bool:
        """Whether the batch of `step` starts an evaluation."""
        return self.config is not None and step % self.config.interval == 0

    def num_examples(self) -> int:
        assert self.config is not None
        available = self.run_env.env.num_examples("eval")
        return min(self.config.num_examples, available or self.config.num_examples)

    async def publish_tasks(self, step: int) -> None:
        assert self.config is not None
        env = self.run_env.env
        self.pending[step] = []
        tasks = [
            Task(
                task_id=f"eval-{step}-{i}",
                step=step,
                env_id=env.env_id,
                env_args=self.run_env.args,
                example_id=i,
                problem=env.example("eval", i),
                sampling=sampling_args(self.sampling, greedy=self.config.greedy),
                group_size=1,
            )
            for i in range(self.num_examples())
        ]
        await asyncio.gather(
            *(self.bus.publish(self.bus.subjects.tasks, t, msg_id=t.task_id) for t in tasks)
        )

    async def on_rollout(self, delivery: Delivery[Rollout]) -> None:
        """Ack an evaluation rollout and count it; publish the result once all are in."""
        rollout = delivery.data
        step = validation.eval_step(rollout.task_id)
        assert step is not None, "the coordinator routes eval-<step>-<i> rollouts only"
        await delivery.ack()
        rewards = self.pending.get(step)
        if rewards is None:
            return  # an evaluation from before a restart
        rewards.extend(s.reward for s in rollout.samples)
        if len(rewards) >= self.num_examples():
            del self.pending[step]
            await self.publish_result(step, rewards)

    async def publish_result(self, step: int, rewards: list[float]) -> None:
        metrics = {
            "eval/reward/mean": statistics.fmean(rewards),
            "eval/num_examples": float(len(rewards)),
        }
        self.results[step] = metrics
        await publish_metrics(self.bus, step, metrics)
        log.info("eval_done", step=step, reward_mean=round(metrics["eval/reward/mean"], 4))
