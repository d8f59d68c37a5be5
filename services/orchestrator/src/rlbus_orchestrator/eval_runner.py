"""The eval runner: in-run evaluations through the rollout workers, with a budget of their own.

An evaluation of step N scores the weights of step N (0: the weights the run starts from) on
the eval environments due at N (`EvalConfig.is_due`: every `interval` steps, step 0 with
`eval_base_model`, the last step with `eval_last_step`). The coordinator starts it when step N's
batch is stored (step 0: when it starts); it waits until inference has applied version N, then
publishes its tasks (rlbus_orchestrator.evaluation) on the eval tasks subject, which the workers
serve with `eval.max_concurrency` samples in flight of their own: evaluations never hold back
training tasks, and training tasks never hold back an evaluation.

Its rollouts come back on the rollouts stream; the coordinator hands them here once they pass
validation, and they are acked at once (never pooled, never trained). When all are in, or
`eval.timeout_s` after the tasks went out (the missing ones then count as `failed`), each
environment's `eval/<env>/*` goes out as an `EvalResult` event (the monitor writes it to
`evals.jsonl` and wandb), to Prometheus, and with the samples to `<run_dir>/evals/step_<N>/`.

The results file is the record that an evaluation is done: a coordinator that starts again
evaluates step 0 (when the run has not trained yet) and the last step (once it is batched)
unless their results are there. Any other evaluation interrupted by a restart is not repeated
(its late rollouts are acked and ignored). Inference may move to newer weights while an
evaluation runs (training goes on); each sample records its version, and results.json the
oldest and newest (`policy_versions`).
"""

import asyncio
import time
from pathlib import Path

import structlog

from rlbus.bus.client import Bus
from rlbus.bus.consumer import Delivery
from rlbus.configs.orchestrator import OrchestratorConfig
from rlbus.rundirs import EVAL_RESULTS_FILE, eval_dir
from rlbus.wire.events import EvalResult
from rlbus.wire.rollouts import Rollout
from rlbus_orchestrator.evaluation import EvalEnv, Evaluation, parse_eval_task_id
from rlbus_orchestrator.metrics import observe_eval
from rlbus_orchestrator.weights_watch import WeightsWatcher

log = structlog.get_logger()

WEIGHTS_WAIT_POLL_S = 0.5


class EvalRunner:
    """The evaluations of one run (module docstring)."""

    def __init__(
        self,
        bus: Bus,
        config: OrchestratorConfig,
        envs: list[EvalEnv],
        *,
        weights: WeightsWatcher,
        run_dir: Path | None,
    ) -> None:
        self.bus = bus
        self.config = config
        self.envs = envs
        self.weights = weights
        self.run_dir = run_dir
        self.running: dict[int, Evaluation] = {}
        """step -> its evaluation, from its start (waiting for weights) to its results."""
        self.complete: dict[int, asyncio.Event] = {}
        self.idle = asyncio.Event()
        """Set while no evaluation runs."""
        self.idle.set()
        self.results: dict[int, dict[str, dict[str, float]]] = {}
        """step -> env -> the metrics of its finished evaluation."""

    def due_envs(self, step: int) -> list[EvalEnv]:
        eval_config = self.config.eval
        if eval_config is None:
            return []
        return [e for e in self.envs if eval_config.is_due(e.config, step, self.config.max_steps)]

    def is_due(self, step: int) -> bool:
        return bool(self.due_envs(step))

    def is_recorded(self, step: int) -> bool:
        """Whether the evaluation of `step` finished before (its results file is there)."""
        return (
            self.run_dir is not None and (eval_dir(self.run_dir, step) / EVAL_RESULTS_FILE).exists()
        )

    def start(self, step: int) -> Evaluation:
        """Register the evaluation of `step` (the caller then runs `evaluate(step)` as a task)."""
        evaluation = self.running[step] = Evaluation(step, self.due_envs(step))
        self.complete[step] = asyncio.Event()
        self.idle.clear()
        return evaluation

    async def evaluate(self, step: int) -> None:
        """Wait for the weights of `step`, publish the tasks, wait for the rollouts (or the
        timeout), then report."""
        evaluation = self.running.get(step) or self.start(step)
        assert self.config.eval is not None
        timeout_s = self.config.eval.timeout_s
        try:
            waited = time.monotonic()
            while self.weights.applied_version < step:
                if time.monotonic() - waited > timeout_s:
                    log.warning(
                        "eval_weights_missing",
                        step=step,
                        applied_version=self.weights.applied_version,
                        waited_s=round(timeout_s),
                    )
                    break
                await asyncio.sleep(WEIGHTS_WAIT_POLL_S)
            tasks = evaluation.tasks()
            started = time.monotonic()
            await asyncio.gather(
                *(
                    self.bus.publish(self.bus.subjects.eval_tasks, t, msg_id=t.task_id)
                    for t in tasks
                )
            )
            log.info(
                "eval_started", step=step, tasks=len(tasks), envs=[e.label for e in evaluation.envs]
            )
            try:
                await asyncio.wait_for(self.complete[step].wait(), timeout_s)
            except TimeoutError:
                log.warning(
                    "eval_timeout",
                    step=step,
                    waited_s=round(time.monotonic() - started, 1),
                    missing=sum(
                        e.num_examples - len(evaluation.rollouts[e.index]) for e in evaluation.envs
                    ),
                )
            await self.report(evaluation)
        finally:
            self.running.pop(step, None)
            self.complete.pop(step, None)
            if not self.running:
                self.idle.set()

    async def on_rollout(self, delivery: Delivery[Rollout]) -> None:
        """Ack an evaluation rollout and keep it; wake its evaluation once all are in."""
        rollout = delivery.data
        parsed = parse_eval_task_id(rollout.task_id)
        assert parsed is not None, "the coordinator routes eval-<step>-<k>-<i> rollouts only"
        await delivery.ack()
        evaluation = self.running.get(parsed[0])
        if evaluation is None:
            return  # an evaluation from before a restart, or one already reported
        if evaluation.add(rollout) and evaluation.is_complete():
            self.complete[parsed[0]].set()

    async def report(self, evaluation: Evaluation) -> None:
        """Publish, count and write the evaluation (module docstring)."""
        step = evaluation.step
        self.results[step] = {}
        for env in evaluation.envs:
            metrics = evaluation.metrics(env)
            self.results[step][env.label] = metrics
            observe_eval(env.label, metrics)  # Prometheus
            await self.bus.publish(
                self.bus.subjects.evals("orchestrator"),
                EvalResult(service="orchestrator", step=step, env=env.label, metrics=metrics),
            )
            log.info(
                "eval_done",
                step=step,
                env=env.label,
                reward_mean=round(metrics.get(f"eval/{env.label}/reward/mean", float("nan")), 4),
                failed=int(metrics[f"eval/{env.label}/failed"]),
            )
        if self.run_dir is not None:
            await asyncio.to_thread(
                evaluation.write, eval_dir(self.run_dir, step), model=self.config.model.name
            )
