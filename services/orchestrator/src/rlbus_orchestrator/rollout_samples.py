"""Samples of a step's batch kept for people to read: `<run_dir>/rollouts/step_<N>.jsonl`.

Every `orchestrator.samples.interval` steps (and step 1, to see the start), up to `per_env`
samples of each environment of the batch are written as rlbus.samples records with the
advantage each trained with: the first sample of every group first, then the second ones, so a
file shows as many different problems as it can. `rl rollouts RUN_DIR` prints them; the monitor
logs them as a wandb table when wandb is on (rlbus.obs.sinks).
"""

from pathlib import Path
from typing import Any

from rlbus.configs.orchestrator import SamplesConfig
from rlbus.rundirs import rollouts_file
from rlbus.samples import sample_record, write_records
from rlbus_orchestrator.group_pool import PooledGroup


def is_kept(config: SamplesConfig | None, step: int) -> bool:
    return config is not None and (step == 1 or step % config.interval == 0)


def kept_records(step: int, groups: list[PooledGroup], per_env: int) -> list[dict[str, Any]]:
    """Up to `per_env` records per environment (module docstring), environments in batch order."""
    picked: dict[str, list[dict[str, Any]]] = {}
    depth = max((len(g.rollout.samples) for g in groups), default=0)
    for j in range(depth):
        for g in groups:
            kept = picked.setdefault(g.rollout.env_id, [])
            if j < len(g.rollout.samples) and len(kept) < per_env:
                kept.append(sample_record(g.rollout, j, step=step, advantage=g.advantages[j]))
    return [record for records in picked.values() for record in records]


def write_step_samples(
    run_dir: Path, config: SamplesConfig, step: int, groups: list[PooledGroup]
) -> Path:
    return write_records(rollouts_file(run_dir, step), kept_records(step, groups, config.per_env))
