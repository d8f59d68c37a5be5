"""One evaluation: its tasks, the rollouts that come back, its metrics and its files.

The in-run evaluations (`eval_runner`) and the `eval` command (`evaluate`) are this same code:
the eval environments of an `[orchestrator.eval]` config (`eval_envs`), the tasks of one
evaluation (`Evaluation.tasks`, one per problem, `n` samples each, id `eval-<step>-<k>-<i>` for
problem i of eval environment k), the rollouts collected (`Evaluation.add`), the metrics per
environment (eval_metrics.py) and the files (`Evaluation.write`):

    <dir>/results.json    {"step", "envs": {<env>: {metric: value}}, "policy_versions": [min, max]}
    <dir>/samples.jsonl   every sample (rlbus.samples records, `advantage` null)

Sampling of an eval environment: its own `sampling` over `eval.sampling` over
`orchestrator.sampling`; with `eval.greedy` and one sample per problem, temperature 0 unless one
of the first two sets a temperature.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlbus.configs.orchestrator import EvalConfig, EvalEnvConfig, OrchestratorConfig
from rlbus.rundirs import EVAL_RESULTS_FILE, EVAL_SAMPLES_FILE
from rlbus.samples import sample_record, write_records
from rlbus.wire.rollouts import Rollout
from rlbus.wire.tasks import EpisodeLimits, SamplingArgs, Task
from rlbus_orchestrator import validation
from rlbus_orchestrator.env_mix import sampling_args
from rlbus_orchestrator.envs import Environment, load_environment
from rlbus_orchestrator.eval_metrics import eval_metrics

EVAL_TASK_PREFIX = "eval-"


def eval_task_id(step: int, env_index: int, example: int) -> str:
    return f"{EVAL_TASK_PREFIX}{step}-{env_index}-{example}"


@dataclass
class EvalEnv:
    """One eval environment, loaded and resolved against the defaults."""

    index: int
    """Its place in the eval environment list (the `k` of its task ids)."""
    config: EvalEnvConfig
    env: Environment
    num_examples: int
    n: int
    ks: list[int]
    threshold: float
    sampling: SamplingArgs
    limits: EpisodeLimits

    @property
    def label(self) -> str:
        return self.config.label

    def task(self, step: int, example: int) -> Task:
        return Task(
            task_id=eval_task_id(step, self.index, example),
            step=step,
            env_id=self.config.id,
            env_args=self.config.args,
            example_id=example,
            problem=self.env.example(self.config.split, example),
            sampling=self.sampling,
            group_size=self.n,
            limits=self.limits,
            min_policy_version=step,
        )


def eval_sampling(
    config: OrchestratorConfig, eval_config: EvalConfig, env: EvalEnvConfig
) -> SamplingArgs:
    """The sampling of `env`'s requests (module docstring)."""
    resolved = env.sampling.over(eval_config.sampling.over(config.sampling))
    n = env.rollouts_per_example or eval_config.rollouts_per_example
    temperature_set = (
        env.sampling.temperature is not None or eval_config.sampling.temperature is not None
    )
    return sampling_args(resolved, greedy=eval_config.greedy and n == 1 and not temperature_set)


def eval_envs(config: OrchestratorConfig) -> list[EvalEnv]:
    """The eval environments of `config.eval`, loaded (none without `[orchestrator.eval]`)."""
    eval_config = config.eval
    if eval_config is None:
        return []
    out = []
    for k, env_config in enumerate(eval_config.envs(config.env)):
        env = load_environment(env_config.id, env_config.args)
        wanted = env_config.num_examples or eval_config.num_examples
        available = env.num_examples(env_config.split)
        out.append(
            EvalEnv(
                index=k,
                config=env_config,
                env=env,
                num_examples=min(wanted, available) if available else wanted,
                n=env_config.rollouts_per_example or eval_config.rollouts_per_example,
                ks=list(env_config.pass_k or eval_config.pass_k),
                threshold=(
                    env_config.pass_threshold
                    if env_config.pass_threshold is not None
                    else eval_config.pass_threshold
                ),
                sampling=eval_sampling(config, eval_config, env_config),
                limits=EpisodeLimits(
                    max_turns=env_config.max_turns,
                    max_total_tokens=env_config.max_total_tokens or config.seq_len,
                    deadline_s=env_config.episode_timeout_s,
                ),
            )
        )
    return out


def parse_eval_task_id(task_id: str) -> tuple[int, int, int] | None:
    """(step, env index, example) of an eval task id, None for any other id."""
    match = validation.EVAL_TASK_ID.fullmatch(task_id)
    return (int(match[1]), int(match[2]), int(match[3])) if match else None


@dataclass
class Evaluation:
    """The evaluation of the weights of `step` on `envs` (module docstring)."""

    step: int
    envs: list[EvalEnv]
    rollouts: dict[int, dict[int, Rollout]] = field(default_factory=dict)
    """env index -> example -> its rollout (the first one in; a redelivery is ignored)."""

    def __post_init__(self) -> None:
        for env in self.envs:
            self.rollouts.setdefault(env.index, {})

    def tasks(self) -> list[Task]:
        return [env.task(self.step, i) for env in self.envs for i in range(env.num_examples)]

    def add(self, rollout: Rollout) -> bool:
        """Keep `rollout` if it is one of this evaluation's; True when it was new."""
        parsed = parse_eval_task_id(rollout.task_id)
        if parsed is None or parsed[0] != self.step or parsed[1] not in self.rollouts:
            return False
        got = self.rollouts[parsed[1]]
        if parsed[2] in got:
            return False
        got[parsed[2]] = rollout
        return True

    def env_done(self, env: EvalEnv) -> bool:
        return len(self.rollouts[env.index]) >= env.num_examples

    def is_complete(self) -> bool:
        return all(self.env_done(env) for env in self.envs)

    def metrics(self, env: EvalEnv) -> dict[str, float]:
        """`eval/<env>/*` from what came back so far (the rest counts as failed)."""
        return eval_metrics(
            env.label,
            list(self.rollouts[env.index].values()),
            num_expected=env.num_examples,
            ks=env.ks,
            n=env.n,
            threshold=env.threshold,
        )

    def records(self) -> list[dict[str, Any]]:
        """Every sample, env by env and problem by problem (rlbus.samples records)."""
        return [
            sample_record(rollout, j, step=self.step, env=env.label)
            for env in self.envs
            for _, rollout in sorted(self.rollouts[env.index].items())
            for j in range(len(rollout.samples))
        ]

    def policy_versions(self) -> list[int]:
        """[oldest, newest] weights version of the samples ([] without samples)."""
        versions = [
            s.policy_version
            for got in self.rollouts.values()
            for r in got.values()
            for s in r.samples
        ]
        return [min(versions), max(versions)] if versions else []

    def write(self, directory: Path, **extra: Any) -> Path:
        """`results.json` and `samples.jsonl` into `directory`; `extra` goes into results.json."""
        write_records(directory / EVAL_SAMPLES_FILE, self.records())
        results = {
            "step": self.step,
            **extra,
            "policy_versions": self.policy_versions(),
            "envs": {env.label: self.metrics(env) for env in self.envs},
        }
        path = directory / EVAL_RESULTS_FILE
        tmp = path.with_name(f".{EVAL_RESULTS_FILE}.tmp")
        tmp.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        tmp.replace(path)
        return path
