"""Read a run's rollout samples as conversations: `rl rollouts RUN_DIR` (docs/rollouts.md).

    rl rollouts outputs/my-run                              # every sample of the newest step
    rl rollouts outputs/my-run --step 40 --env reverse-text --worst 3
    rl rollouts outputs/my-run --eval --best 2              # the newest evaluation's samples

The files are the sample records of rlbus.samples: `<run_dir>/rollouts/step_<N>.jsonl` (the
orchestrator writes them when `orchestrator.samples` is set) and, with `--eval`,
`<run_dir>/evals/step_<N>/samples.jsonl` (every evaluation, `orchestrator.eval`). Each sample is
printed as a header line, then its prompt and its conversation (or its completion), one role per
block. On a terminal the roles are coloured; piped, the output is plain text. Exit 0, or 2 with
one line for a run directory without samples, a missing step or an unknown environment.
"""

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from rlbus.rundirs import (
    EVAL_SAMPLES_FILE,
    EVALS_DIR,
    ROLLOUTS_DIR,
    eval_dir,
    numbered_steps,
    rollouts_file,
)
from rlbus.samples import read_records

PROG = "rl rollouts"
EXIT_OK = 0
EXIT_USAGE = 2
INDENT = "    "
ROLE_STYLES = {"system": "dim", "user": "cyan", "assistant": "green", "tool": "yellow"}
"""Role labels on a terminal; any other role (an environment's own) is magenta."""


class RolloutsError(Exception):
    """Nothing to read where the user pointed: printed as one line, exit 2."""


def available_steps(run_dir: Path, evals: bool) -> list[int]:
    """Steps with a samples file, ascending."""
    if evals:
        steps = numbered_steps(run_dir / EVALS_DIR)
        return [s for s in steps if (eval_dir(run_dir, s) / EVAL_SAMPLES_FILE).is_file()]
    return numbered_steps(run_dir / ROLLOUTS_DIR, ".jsonl")


def samples_path(run_dir: Path, step: int | None, evals: bool) -> Path:
    """The samples file of `step` (None: the newest one)."""
    steps = available_steps(run_dir, evals)
    if not steps:
        where = run_dir / (EVALS_DIR if evals else ROLLOUTS_DIR)
        writer = "an evaluation (orchestrator.eval)" if evals else "orchestrator.samples"
        problem = "does not exist" if not run_dir.is_dir() else f"has no samples in {where}"
        raise RolloutsError(f"{run_dir} {problem}: they are written by {writer}")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        kind = "evaluation" if evals else "rollout"
        raise RolloutsError(
            f"no {kind} samples of step {step} in {run_dir}; steps with samples: "
            + ", ".join(map(str, steps))
        )
    return eval_dir(run_dir, step) / EVAL_SAMPLES_FILE if evals else rollouts_file(run_dir, step)


def selected(
    records: list[dict[str, Any]], env: str | None, best: int | None, worst: int | None
) -> list[dict[str, Any]]:
    """The records of `env` (None: all), then the `best` highest or `worst` lowest rewards."""
    if env is not None:
        envs = sorted({str(r.get("env")) for r in records})
        if env not in envs:
            raise RolloutsError(
                f"no samples of environment {env!r}; environments here: {', '.join(envs) or 'none'}"
            )
        records = [r for r in records if r.get("env") == env]
    if best is not None:
        return sorted(records, key=lambda r: r["reward"], reverse=True)[:best]
    if worst is not None:
        return sorted(records, key=lambda r: r["reward"])[:worst]
    return records


def header(record: dict[str, Any]) -> Text:
    """One line: where the sample comes from and how it scored."""
    advantage = record.get("advantage")
    parts = [
        f"step {record.get('step')}",
        str(record.get("env")),
        f"task {record.get('task_id')}",
        f"sample {record.get('sample')}",
        f"reward {record['reward']:.4g}",
        "advantage -" if advantage is None else f"advantage {advantage:+.4g}",
        f"policy v{record.get('policy_version')}",
        f"turns {record.get('num_turns', 1)}, tool calls {record.get('num_tool_calls', 0)}",
    ]
    if record.get("stop_reason"):  # a multi-turn episode's end; one turn: the engine's
        parts.append(f"stop {record['stop_reason']}")
    elif record.get("finish_reason"):
        parts.append(f"finish {record['finish_reason']}")
    return Text("== " + " | ".join(parts), style="bold")


def role_label(message: dict[str, Any]) -> Text:
    """`user`, `assistant`, `tool get_weather (call_1)`, ..."""
    role = str(message.get("role", "?"))
    label = role
    if role == "tool":
        name = message.get("name")
        call_id = message.get("tool_call_id")
        label += "".join([f" {name}" if name else "", f" ({call_id})" if call_id else ""])
    return Text(f"[{label}]", style=ROLE_STYLES.get(role, "magenta"))


def indented(text: str, style: str = "") -> Text:
    return Text("\n".join(INDENT + line for line in text.splitlines() or [""]), style=style)


def print_message(console: Console, message: dict[str, Any]) -> None:
    """The role label, the content indented under it, then each tool call as `name(arguments)`."""
    console.print(role_label(message), soft_wrap=True)
    if message.get("content"):
        console.print(indented(str(message["content"])), soft_wrap=True)
    for call in message.get("tool_calls") or []:
        function = call.get("function", {})
        line = f"-> {function.get('name')}({function.get('arguments', '')})"
        console.print(indented(line, style="magenta"), soft_wrap=True)


def print_sample(console: Console, record: dict[str, Any]) -> None:
    """Header, prompt, then the episode's messages (multi-turn) or the completion (one turn)."""
    console.print(header(record), soft_wrap=True)
    for message in record.get("prompt") or []:
        print_message(console, message)
    messages = record.get("messages") or [
        {"role": "assistant", "content": record.get("completion", "")}
    ]
    for message in messages:
        print_message(console, message)
    console.print()


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive count")
    return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Print a run's rollout (or evaluation) samples as conversations."
    )
    parser.add_argument("run_dir", type=Path, help="the run directory")
    parser.add_argument("--step", type=int, help="the step to read (default: the newest)")
    parser.add_argument("--env", help="only the samples of this environment")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--best", type=positive, metavar="K", help="the K highest rewards")
    which.add_argument("--worst", type=positive, metavar="K", help="the K lowest rewards")
    parser.add_argument("--eval", action="store_true", help="read the evaluation's samples")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    """Print the samples (module docstring); returns the exit code."""
    args = parse_args(argv)
    try:
        path = samples_path(args.run_dir, args.step, args.eval)
        records = selected(read_records(path), args.env, args.best, args.worst)
    except RolloutsError as error:
        print(f"rollouts: {error}", file=sys.stderr)
        return EXIT_USAGE
    console = Console(highlight=False)
    for record in records:
        print_sample(console, record)
    if not records:
        print(f"no samples in {path}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
