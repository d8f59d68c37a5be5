"""The environments of a run: which one a training task is, and that environment's settings.

The data cursor picks the environment (`random.Random(f"{seed}/env/{cursor}")` draws an index of
`config.env` by the weights), so every part of the coordinator tells a task's environment, group
size and minimum group size from its id alone, the same before and after a restart: task issue
(what a task holds, how many samples are on the way), the rollout intake (how many samples a group
must have, whose drop it is) and the batcher. Nothing here loads an environment.

Settings of `[[orchestrator.env]]` entry i: its `sampling` over `orchestrator.sampling` (unset
fields fall back), its `group_size` or the orchestrator's, its episode limits (`max_turns`,
`max_total_tokens`, `episode_timeout_s` -> `Task.limits.deadline_s`). Metrics and Prometheus
labels use the entry's id: entries that share an id share their per-environment metrics.
"""

import random
from dataclasses import dataclass

from rlbus.configs.orchestrator import OrchestratorConfig, SamplingConfig
from rlbus.wire.tasks import EpisodeLimits, SamplingArgs
from rlbus_orchestrator import validation


def sampling_args(config: SamplingConfig, *, greedy: bool = False) -> SamplingArgs:
    """The wire form of a sampling config (greedy: temperature 0, top_p 1)."""
    return SamplingArgs(
        temperature=0.0 if greedy else config.temperature,
        top_p=1.0 if greedy else config.top_p,
        max_tokens=config.max_tokens,
        stop=list(config.stop),
        seed=config.seed,
        extra=dict(config.extra_body),
    )


@dataclass(frozen=True)
class EnvSettings:
    """What the tasks of one `[[orchestrator.env]]` entry carry, resolved against the defaults."""

    env_id: str
    weight: float
    group_size: int
    min_group_size: int
    sampling: SamplingArgs
    limits: EpisodeLimits


def env_settings(config: OrchestratorConfig) -> list[EnvSettings]:
    """The settings of each entry of `config.env`, in order."""
    return [
        EnvSettings(
            env_id=env.id,
            weight=env.weight,
            group_size=config.env_group_size(env),
            min_group_size=config.env_min_group_size(env),
            sampling=sampling_args(env.sampling.over(config.sampling)),
            limits=EpisodeLimits(
                max_turns=env.max_turns,
                # an episode never outgrows the sequence it is trained as (nor, with seq_len
                # pushed to max_model_len, the engine's context: a turn past it is a 400)
                max_total_tokens=env.max_total_tokens or config.seq_len,
                deadline_s=env.episode_timeout_s,
            ),
        )
        for env in config.env
    ]


class EnvMix:
    """The run's environments and the choice of one per data cursor (module docstring)."""

    def __init__(self, config: OrchestratorConfig) -> None:
        self.settings = env_settings(config)
        self.seed = config.seed

    def env_ids(self) -> list[str]:
        """The distinct environment ids, in config order (the per-environment metric keys)."""
        return list(dict.fromkeys(s.env_id for s in self.settings))

    def index(self, cursor: int) -> int:
        """The entry of `config.env` that training task `train-<cursor>` is drawn from."""
        if len(self.settings) == 1:
            return 0
        rng = random.Random(f"{self.seed}/env/{cursor}")
        return rng.choices(range(len(self.settings)), weights=[s.weight for s in self.settings])[0]

    def of_cursor(self, cursor: int) -> EnvSettings:
        return self.settings[self.index(cursor)]

    def of_task(self, task_id: str) -> EnvSettings | None:
        """The settings of a training task id (None for an eval or unknown id)."""
        cursor = validation.train_cursor(task_id)
        return None if cursor is None else self.of_cursor(cursor)

    def env_id_of(self, task_id: str) -> str:
        """The environment id of a training task, for metrics ("" when the id is no task's)."""
        settings = self.of_task(task_id)
        return "" if settings is None else settings.env_id
