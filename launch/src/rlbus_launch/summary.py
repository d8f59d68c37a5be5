"""What a run left behind, printed once by `rl` when it ends (finished, stopped or failed).

    run finished after 35s: outputs/reverse-text--tiny--1a2b
      steps    40 of 40
      reward   0.6812 at step 1, 0.9023 at step 40
      eval     step 40, reverse-text: reward/mean 0.41, num_examples 16, failed 0, pass@1 0.25
      model    outputs/reverse-text--tiny--1a2b/model
      samples  outputs/reverse-text--tiny--1a2b/rollouts
      logs     outputs/reverse-text--tiny--1a2b/logs

Everything is read from the run directory: steps and rewards from `metrics.jsonl` (rows merged by
step, as the progress lines read them), the last evaluation from `evals.jsonl` (one row per
environment evaluated, `eval/<env>/<metric>` keys), the model from the final `model/` (a run
that reached max_steps), else the newest weights broadcast, else the newest complete checkpoint
(rlbus.rundirs).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlbus.obs.logging import LOGS_DIR
from rlbus.rundirs import (
    CHECKPOINTS_DIR,
    EVALS_FILE,
    FINAL_MODEL_DIR,
    ROLLOUTS_DIR,
    broadcasts_dir,
    complete_steps,
    numbered_steps,
)
from rlbus.samples import read_records
from rlbus_launch.progress import MetricsTail, format_duration

REWARD_KEY = "reward/mean"


@dataclass
class RunSummary:
    outcome: str
    wall_s: float
    run_dir: Path
    max_steps: int | None
    steps_done: int
    """Newest step the trainer reported (its `loss`), 0 before the first."""
    rewards: list[tuple[int, float]]
    """(step, reward/mean) of every step that has one, ascending."""
    last_evals: list[dict[str, Any]]
    """The evals.jsonl rows of its highest step (one per environment); [] without any."""
    model: Path | None
    samples: Path | None


def outcome_of(exit_code: int, stopped_by: str | None = None) -> str:
    """`finished`, `stopped (<stopped_by>)` or `failed (exit code N)`. The signal is told, not
    read from the code: a service killed by SIGTERM also ends the run with 143."""
    if stopped_by is not None:
        return f"stopped ({stopped_by})"
    return "finished" if exit_code == 0 else f"failed (exit code {exit_code})"


def last_evals(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of evals.jsonl with its highest step, in file order ([] without the file)."""
    path = run_dir / EVALS_FILE
    rows = [row for row in read_records(path) if "step" in row] if path.exists() else []
    if not rows:
        return []
    newest = max(row["step"] for row in rows)
    return [row for row in rows if row["step"] == newest]


def model_dir(run_dir: Path) -> Path | None:
    """The final `model/`, else the newest `broadcasts/step_<N>/`, else the newest complete
    `checkpoints/step_<N>/`."""
    if (run_dir / FINAL_MODEL_DIR).is_dir():
        return run_dir / FINAL_MODEL_DIR
    broadcasts = numbered_steps(broadcasts_dir(run_dir))
    if broadcasts:
        return broadcasts_dir(run_dir) / f"step_{broadcasts[-1]}"
    checkpoints = complete_steps(run_dir)
    return run_dir / CHECKPOINTS_DIR / f"step_{checkpoints[-1]}" if checkpoints else None


def read_summary(
    run_dir: Path, *, outcome: str, wall_s: float, max_steps: int | None
) -> RunSummary:
    tail = MetricsTail(run_dir / "metrics.jsonl")
    tail.poll()
    rows = sorted(tail.steps.items())
    samples = run_dir / ROLLOUTS_DIR
    return RunSummary(
        outcome=outcome,
        wall_s=wall_s,
        run_dir=run_dir,
        max_steps=max_steps,
        steps_done=max((step for step, row in rows if "loss" in row), default=0),
        rewards=[(step, row[REWARD_KEY]) for step, row in rows if REWARD_KEY in row],
        last_evals=last_evals(run_dir),
        model=model_dir(run_dir),
        samples=samples if samples.is_dir() else None,
    )


def _number(value: Any) -> str:
    if isinstance(value, float) and not value.is_integer():
        return format(value, ".4g")
    return str(int(value)) if isinstance(value, (int, float)) else str(value)


SUMMARY_EVAL_METRICS = ("reward/mean", "num_examples", "failed")
"""What the summary shows of an evaluation besides its pass@k's (evals.jsonl has the rest)."""


def eval_lines(rows: list[dict[str, Any]]) -> list[str]:
    """`step 40, reverse-text: reward/mean 0.41, num_examples 16, failed 0, pass@1 0.25`, one per
    environment."""
    lines = []
    for row in rows:
        env = row.get("env", "?")
        prefix = f"eval/{env}/"
        shown = [prefix + name for name in SUMMARY_EVAL_METRICS]
        shown += sorted(key for key in row if key.startswith(prefix + "pass@"))
        metrics = ", ".join(
            f"{key.removeprefix(prefix)} {_number(row[key])}" for key in shown if key in row
        )
        lines.append(f"step {row['step']}, {env}: {metrics}")
    return lines


def render(summary: RunSummary) -> str:
    """The summary as aligned `label  value` lines under a headline."""
    steps = f"{summary.steps_done}" + (
        f" of {summary.max_steps}" if summary.max_steps is not None else ""
    )
    if summary.rewards:
        (first_step, first), (last_step, last) = summary.rewards[0], summary.rewards[-1]
        reward = f"{first:.4f} at step {first_step}, {last:.4f} at step {last_step}"
    else:
        reward = "none reported"
    evals = eval_lines(summary.last_evals) or ["no eval"]
    rows = [
        ("steps", steps),
        ("reward", reward),
        *[("eval" if i == 0 else "", line) for i, line in enumerate(evals)],
        ("model", str(summary.model) if summary.model else "none saved"),
        ("samples", str(summary.samples) if summary.samples else "none kept"),
        ("logs", str(summary.run_dir / LOGS_DIR)),
    ]
    headline = f"run {summary.outcome} after {format_duration(summary.wall_s)}: {summary.run_dir}"
    return "\n".join([headline, *(f"  {label:<8} {value}" for label, value in rows)])


def run_summary(run_dir: Path, *, outcome: str, wall_s: float, max_steps: int | None) -> str:
    """The lines `rl` prints when a run ends (module docstring); `outcome` from `outcome_of`."""
    return render(read_summary(run_dir, outcome=outcome, wall_s=wall_s, max_steps=max_steps))
