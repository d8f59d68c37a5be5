"""Sample records: one rollout sample as a JSON object people read (`rl rollouts`, wandb tables).

The orchestrator writes the samples of a step's batch to `<run_dir>/rollouts/step_<N>.jsonl`
(`orchestrator.samples`), and every evaluation writes its samples to
`<run_dir>/evals/step_<N>/samples.jsonl` (rlbus.rundirs). Both hold one `sample_record` per line:

| key               | what                                                                  |
| ----------------- | --------------------------------------------------------------------- |
| `step`            | the training step (an evaluation: the step of the weights it scored)  |
| `env`             | the environment's name (its id, or the eval environment's `name`)     |
| `task_id`         | the task the sample belongs to (`train-<n>`, `eval-<step>-<k>-<i>`)   |
| `example_id`      | the problem's index in its split                                      |
| `sample`          | the sample's index in its group                                       |
| `prompt`          | the problem's messages: `[{"role", "content"}, ...]`                  |
| `messages`        | a multi-turn episode after the prompt (assistant turns with their     |
|                   | `tool_calls`, tool and environment messages); [] for one turn         |
| `completion`      | the text of the last model turn                                       |
| `reward`          | the reward; `reward_components` its named parts                       |
| `advantage`       | the advantage it trained with (None: an evaluation sample)            |
| `policy_version`  | the weights version that generated it                                 |
| `num_turns`, `num_tool_calls`, `num_tool_errors`, `stop_reason`, `finish_reason`,          |
| `is_truncated`, `completion_tokens` (loss-masked tokens included), `trained_tokens`       |
"""

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from rlbus.wire.rollouts import Rollout, RolloutSample


def sample_record(
    rollout: Rollout,
    index: int,
    *,
    step: int,
    env: str | None = None,
    advantage: float | None = None,
) -> dict[str, Any]:
    """The record of `rollout.samples[index]` (module docstring); `env` defaults to the
    rollout's environment id."""
    sample: RolloutSample = rollout.samples[index]
    return {
        "step": step,
        "env": env or rollout.env_id,
        "task_id": rollout.task_id,
        "example_id": rollout.example_id,
        "sample": index,
        "prompt": msgspec.to_builtins(rollout.prompt),
        "messages": msgspec.to_builtins(sample.messages),
        "completion": sample.completion_text or "",
        "reward": sample.reward,
        "reward_components": dict(sample.reward_components),
        "advantage": advantage,
        "policy_version": sample.policy_version,
        "num_turns": sample.num_turns,
        "num_tool_calls": sample.num_tool_calls,
        "num_tool_errors": sample.num_tool_errors,
        "stop_reason": sample.stop_reason,
        "finish_reason": sample.finish_reason,
        "is_truncated": sample.is_truncated,
        "completion_tokens": len(sample.completion_token_ids),
        "trained_tokens": sum(sample.completion_mask),
    }


def write_records(path: Path, records: Iterable[dict[str, Any]]) -> Path:
    """Write `records` as JSON lines to `path`, atomically (a temp file renamed into place), so a
    reader never sees half a file and a rewrite of the same step replaces it whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_records(path: Path | None) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file (samples, metrics.jsonl, evals.jsonl), in file
    order: a line that is not one (a torn last line of a killed writer) is skipped, a missing
    file has none."""
    if path is None or not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
