"""What a rollout must satisfy before the coordinator pools it (else it is quarantined).

A rollout that decodes but breaks what batching and training assume would otherwise fail inside
`packing.make_train_sample` (unequal lengths), poison the trainer's loss (non-finite reward or
logprob, token ids < 0), or wait for a task that was never issued. `problem(rollout, ...)` names
the first such fault in one short sentence (the dead-letter reason), or returns None.

Checked, in order: the task id (`train-<cursor>` issued by this run, or `eval-<step>-<k>-<i>`), the
environment (a training task's is the one its cursor drew), the episodes left out (`dropped`:
reasons `error` and `timeout` only), the group (samples plus left-out episodes = the
environment's group size), then each sample: completion token ids,
logprobs and mask of equal length, token ids >= 0, mask values 0/1, finite reward, reward
components, logprobs (<= 0) and temperature, and a policy version in `0 .. next_step - 1` (the
trainer cannot have made weights for a step that was never batched).
"""

import math
import re

from rlbus.wire.rollouts import Rollout, RolloutSample
from rlbus_orchestrator.state_store import EPISODE_DROP_REASONS

TRAIN_TASK_ID = re.compile(r"train-(\d+)")
EVAL_TASK_ID = re.compile(r"eval-(\d+)-(\d+)-(\d+)")
"""`eval-<step>-<eval env index>-<example>` (rlbus_orchestrator.evaluation)."""
LOGPROB_SLACK = 1e-3
"""Logprobs a hair above 0 are rounding; more is not a log-probability."""


def train_cursor(task_id: str) -> int | None:
    """The data cursor of a training task id, None for any other id."""
    match = TRAIN_TASK_ID.fullmatch(task_id)
    return int(match.group(1)) if match else None


def eval_step(task_id: str) -> int | None:
    """The step of an evaluation task id, None for any other id."""
    match = EVAL_TASK_ID.fullmatch(task_id)
    return int(match.group(1)) if match else None


def problem(
    rollout: Rollout,
    *,
    issued_cursor: int,
    group_size: int,
    next_step: int,
    env_id: str | None = None,
) -> str | None:
    """Why `rollout` cannot be used (module docstring), or None when it can. `group_size` and
    `env_id` (None: not checked) are those of the training task's environment."""
    cursor = train_cursor(rollout.task_id)
    is_eval = eval_step(rollout.task_id) is not None
    if cursor is None and not is_eval:
        return f"unknown task id {rollout.task_id!r} (expected train-<n> or eval-<step>-<k>-<i>)"
    if cursor is not None and cursor >= issued_cursor:
        return f"task {rollout.task_id} was never issued (the next cursor is {issued_cursor})"
    if cursor is not None and env_id is not None and rollout.env_id != env_id:
        return f"env_id {rollout.env_id!r}, but task {rollout.task_id} is of {env_id!r}"
    unknown = sorted(set(rollout.dropped) - set(EPISODE_DROP_REASONS))
    if unknown:
        return f"dropped episodes of unknown reason {unknown[0]!r} (expected error or timeout)"
    if rollout.error is not None and not rollout.samples:
        return None  # a reported failure: dropped as `error`, not poison
    num_dropped = sum(rollout.dropped.values())
    if cursor is not None and rollout.samples and len(rollout.samples) + num_dropped != group_size:
        left_out = f" and {num_dropped} dropped episodes" if num_dropped else ""
        return (
            f"group of {len(rollout.samples)} samples{left_out}, expected group_size={group_size}"
        )
    for i, sample in enumerate(rollout.samples):
        fault = sample_problem(sample, next_step=next_step)
        if fault is not None:
            return f"sample {i}: {fault}"
    return None


def sample_problem(sample: RolloutSample, *, next_step: int) -> str | None:
    num = len(sample.completion_token_ids)
    if not (num == len(sample.completion_logprobs) == len(sample.completion_mask)):
        return (
            f"{num} completion tokens, {len(sample.completion_logprobs)} logprobs and "
            f"{len(sample.completion_mask)} mask values (must be equal)"
        )
    if not sample.prompt_token_ids and not num:
        return "no tokens"
    if any(t < 0 for t in sample.prompt_token_ids) or any(
        t < 0 for t in sample.completion_token_ids
    ):
        return "negative token id"
    if any(m not in (0, 1) for m in sample.completion_mask):
        return "completion_mask values must be 0 or 1"
    if not math.isfinite(sample.reward):
        return f"reward is {sample.reward}"
    for name, value in sample.reward_components.items():
        if not math.isfinite(value):
            return f"reward component {name!r} is {value}"
    if any(not math.isfinite(lp) or lp > LOGPROB_SLACK for lp in sample.completion_logprobs):
        return "a completion logprob is not finite or > 0"
    if not math.isfinite(sample.temperature) or sample.temperature < 0:
        return f"temperature is {sample.temperature}"
    if not 0 <= sample.policy_version <= next_step - 1:
        return (
            f"policy_version {sample.policy_version} outside 0..{next_step - 1} "
            f"(the coordinator is building step {next_step})"
        )
    return None
