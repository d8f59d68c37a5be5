"""`python -m rlbus_orchestrator.evaluate CONFIG --step N --out DIR`: one evaluation, no bus.

What `rl eval` runs once an inference server answers (docs/evaluating.md): the eval environments
of an orchestrator config (its `[orchestrator.eval]`, every environment whatever its interval),
played against `inference_urls` through the rollout workers' own group player, with
`eval.max_concurrency` samples in flight, then `results.json` and `samples.jsonl` written into
DIR (rlbus_orchestrator.evaluation: the same tasks, metrics and files as the in-run
evaluations). Exit 0 when the results are written (failed problems are counted in them), 2 on a
bad config.
"""

import argparse
import asyncio
import sys
from pathlib import Path

import structlog

from rlbus.configs.base import parse_cli
from rlbus.configs.orchestrator import OrchestratorConfig
from rlbus.obs.logging import setup_logging
from rlbus.wire.rollouts import Rollout
from rlbus.wire.tasks import Task
from rlbus_orchestrator.client import (
    InferenceClient,
    ReplicaPool,
    make_http_client,
    static_replicas,
)
from rlbus_orchestrator.evaluation import Evaluation, eval_envs
from rlbus_orchestrator.worker import GroupPlayer, SampleSlots

log = structlog.get_logger()


async def evaluate(config: OrchestratorConfig, step: int, out: Path) -> Path:
    """Play every task of the evaluation of `step` and write its files into `out`."""
    assert config.eval is not None, "the caller checks for [orchestrator.eval]"
    envs = eval_envs(config)
    evaluation = Evaluation(step, envs)
    pool = ReplicaPool.from_config(config.http)
    pool.update(static_replicas(config.inference_urls, config.model.name))
    async with make_http_client(config.http, config.eval.max_concurrency) as http:
        client = InferenceClient(
            pool, http, config.model.name, max_attempts=config.http.max_attempts
        )
        player = GroupPlayer(
            client,
            SampleSlots(config.eval.max_concurrency),
            worker_id="eval",
            no_replica_wait_s=config.http.no_replica_wait_s,
        )
        tasks = evaluation.tasks()
        log.info("eval_started", step=step, tasks=len(tasks), envs=[e.label for e in envs])
        try:
            rollouts = await asyncio.wait_for(
                asyncio.gather(*(played(player, task) for task in tasks)), config.eval.timeout_s
            )
        except TimeoutError:
            log.warning("eval_timeout", step=step, waited_s=config.eval.timeout_s)
            rollouts = []
        finally:
            await player.envs.aclose()
    for rollout in rollouts:
        if rollout is not None:
            evaluation.add(rollout)
    path = evaluation.write(out, model=config.model.name)
    for env in envs:
        metrics = evaluation.metrics(env)
        log.info(
            "eval_done",
            step=step,
            env=env.label,
            reward_mean=metrics.get(f"eval/{env.label}/reward/mean"),
            failed=int(metrics[f"eval/{env.label}/failed"]),
        )
    return path


async def played(player: GroupPlayer, task: Task) -> Rollout | None:
    """The task's rollout; None when no replica answered for `no_replica_wait_s` (counted as
    failed)."""
    return await player.roll_out_when_a_replica_answers(task)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlbus_orchestrator.evaluate")
    parser.add_argument("config", type=Path, help="an orchestrator config (TOML)")
    parser.add_argument("--step", type=int, default=0, help="the step the weights are of")
    parser.add_argument("--out", type=Path, required=True, help="where results.json goes")
    args = parser.parse_args(argv)
    config = parse_cli(OrchestratorConfig, ["@", str(args.config)], prog=parser.prog)
    if config.eval is None:
        print(f"{args.config}: no [eval] section: nothing to evaluate", file=sys.stderr)
        return 2
    setup_logging("evaluate", run_dir=None, run_id=None, level=config.log.level)
    asyncio.run(evaluate(config, args.step, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
