"""rlbus against TRL's GRPOTrainer on the same task, side by side (issue 16, goal P1).

    uv run python benchmarks/vs_trl.py [--pairs N] [--max-steps S] [--target 0.85] [--keep] [-- rl flags]

Each pair runs TRL, then rlbus, back to back (N pairs alternate the same way), from one resolved
`rl` config (default examples/reverse-text/rl.toml, with the extra rl flags):

- rlbus: `rl @ CONFIG --max-steps S` as a subprocess in a fresh output dir (`rl_argv`). Per step:
  the metrics.jsonl row's `time` (the later of the orchestrator's and the trainer's event, i.e. the
  trainer's step end) since `rl` was started, and the mean sampled reward `reward/mean` (the
  output says when a kept run is older than that meaning: it then averaged the trained groups).
- TRL: benchmarks/vs_trl_grpo.py in its own venv (`ensure_trl_venv`: trl, transformers,
  accelerate, datasets and the project's torch build, made once with uv and reused), on a job
  file written here: the config's model, the config's environment's first S x (batch/group)
  training prompts in the orchestrator's order, and its samples per step, sampling and optimizer
  settings. HF generate, float32, CPU. Per step: wall time since the process was started, and
  TRL's logged `reward` (mean over the step's sampled completions).

Printed per tool (medians over pairs) and as rlbus/TRL: start-up (process start to the end of the
first trained step), median step time (steps after the first 2, end to end of consecutive steps),
wall time to the first step whose trailing 10-step mean reward reaches the target (and 0.80), and
the trailing 10-step mean at step 40. Exit 0 when every run of both tools exited 0.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from rlbus import process_marks

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TRL_SCRIPT = Path(__file__).resolve().parent / "vs_trl_grpo.py"
DEFAULT_VENV = Path.home() / ".cache" / "rlbus" / "vs-trl"
STAMP = "rlbus-vs-trl.json"
TRL_PACKAGES = ("trl", "transformers", "accelerate", "datasets", "torch")
SECOND_TARGET = 0.80
STOP_WAIT_S = 60.0


@dataclass(frozen=True)
class Step:
    """One trained step of either tool."""

    step: int
    elapsed_s: float
    """Wall time of the step's end since the tool's process was started."""
    reward: float
    """Mean reward of the step's sampled completions."""


# ---- per-step logs -------------------------------------------------------------------------


def reward_key(rows: list[dict]) -> str:
    """How the run's `reward/mean` reads: every sample of the step (runs that also write
    `reward/trained_mean`), or, in runs from before 2026-12-04, the trained groups alone."""
    if any("reward/trained_mean" in r for r in rows):
        return "reward/mean"
    return "reward/mean (an older run: the trained groups' mean)"


def rlbus_steps(rows: list[dict], t0: float) -> tuple[list[Step], str]:
    """Steps of metrics.jsonl rows (sorted, joined by step) that have both the trainer's part
    (`loss`) and the reward; returns them and the reward key read."""
    steps = [
        Step(int(r["step"]), float(r["time"]) - t0, float(r["reward/mean"]))
        for r in rows
        if "loss" in r and "reward/mean" in r and "time" in r
    ]
    return steps, reward_key(rows)


def trl_steps(text: str) -> list[Step]:
    """Steps of vs_trl_grpo.py's JSONL output."""
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [Step(int(r["step"]), float(r["elapsed_s"]), float(r["reward"])) for r in rows]


# ---- measures ------------------------------------------------------------------------------


def trailing_means(steps: list[Step], window: int) -> list[float | None]:
    """Per step, the mean reward of it and the `window - 1` steps before it (None until enough)."""
    rewards = [s.reward for s in steps]
    return [
        statistics.fmean(rewards[i + 1 - window : i + 1]) if i + 1 >= window else None
        for i in range(len(rewards))
    ]


def time_to_reward(steps: list[Step], target: float, window: int) -> float | None:
    """Wall time of the first step whose trailing `window`-step mean reward is >= `target`."""
    for step, mean in zip(steps, trailing_means(steps, window), strict=True):
        if mean is not None and mean >= target:
            return step.elapsed_s
    return None


def reward_at(steps: list[Step], at_step: int, window: int) -> float | None:
    """The trailing `window`-step mean reward at step `at_step` (None when the run is shorter)."""
    for step, mean in zip(steps, trailing_means(steps, window), strict=True):
        if step.step == at_step:
            return mean
    return None


def median_step_s(steps: list[Step], skip: int = 2) -> float | None:
    """Median time between the ends of consecutive steps, over the steps after the first `skip`."""
    periods = [
        b.elapsed_s - a.elapsed_s
        for a, b in zip(steps, steps[1:], strict=False)
        if b.step > skip and b.step == a.step + 1
    ]
    return statistics.median(periods) if periods else None


@dataclass(frozen=True)
class Measures:
    startup_s: float | None
    step_s: float | None
    to_target_s: float | None
    to_second_s: float | None
    reward_at: float | None


def measure(steps: list[Step], opts) -> Measures:
    return Measures(
        startup_s=steps[0].elapsed_s if steps else None,
        step_s=median_step_s(steps),
        to_target_s=time_to_reward(steps, opts.target, opts.window),
        to_second_s=time_to_reward(steps, SECOND_TARGET, opts.window),
        reward_at=reward_at(steps, opts.reward_step, opts.window),
    )


# ---- table ---------------------------------------------------------------------------------


def median_or_none(values: list[float | None]) -> float | None:
    """Median of the values, None when any is None (a pair that did not reach counts as missing)."""
    return None if not values or None in values else statistics.median(values)


def ratio(rlbus: float | None, trl: float | None) -> float | None:
    return None if rlbus is None or trl is None or trl == 0 else rlbus / trl


def table_rows(trl: list[Measures], rlbus: list[Measures], opts) -> list[tuple[str, ...]]:
    """(name, TRL, rlbus, rlbus/TRL, per-pair ratios) per measure, as printed."""
    missing = f"not reached in {opts.max_steps} steps"
    fields = [
        ("start-up to step 1 (s)", "startup_s", "n/a", "{:.1f}"),
        ("median step (s, steps > 2)", "step_s", "n/a", "{:.2f}"),
        (f"time to {opts.target:.2f} (s)", "to_target_s", missing, "{:.1f}"),
        (f"time to {SECOND_TARGET:.2f} (s)", "to_second_s", missing, "{:.1f}"),
        (f"reward @ step {opts.reward_step}", "reward_at", "n/a", "{:.3f}"),
    ]
    rows = []
    for name, attr, none_text, fmt in fields:
        a = [getattr(m, attr) for m in trl]
        b = [getattr(m, attr) for m in rlbus]
        pair_ratios = [ratio(y, x) for x, y in zip(a, b, strict=True)]
        cells = [median_or_none(a), median_or_none(b), median_or_none(pair_ratios)]
        text = [none_text if c is None else fmt.format(c) for c in cells[:2]]
        text.append("-" if cells[2] is None else f"{cells[2]:.2f}x")
        text.append(", ".join("-" if r is None else f"{r:.2f}x" for r in pair_ratios))
        rows.append((name, *text))
    return rows


def format_table(rows: list[tuple[str, ...]]) -> str:
    header = ("", "TRL", "rlbus", "rlbus/TRL", "per pair")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [header, *rows]
    )


# ---- the two tools -------------------------------------------------------------------------


def run_process(argv: list[str], console: Path, env: dict | None = None) -> int:
    """Run `argv` in its own process group, output to `console`; stopped if we are interrupted."""
    with open(console, "wb") as out:
        proc = subprocess.Popen(
            argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        try:
            return proc.wait()
        finally:
            if proc.poll() is None:
                process_marks.stop_group(proc, STOP_WAIT_S)


def rl_argv(config: Path, output_dir: Path, run_name: str, max_steps: int, extra: list[str]):
    """The `rl` command of one rlbus run. Against an already running server, pass
    `-- --inference.attach` (started as `inference @ CONFIG`; docs/inference.md)."""
    return [
        str(BIN / "rl"),
        "@",
        str(config),
        "--output-dir",
        str(output_dir),
        "--run.name",
        run_name,
        "--max-steps",
        str(max_steps),
        *extra,
    ]


def start_time(work: Path, name: str) -> float:
    """Now, kept in `<name>.t0` so that `--reuse` can measure the kept run again."""
    t0 = time.time()
    (work / f"{name}.t0").write_text(repr(t0))
    return t0


def read_rlbus(work: Path, name: str) -> tuple[list[Step], str]:
    from rlbus_launch.plot import read_metrics

    metrics = work / name / "metrics.jsonl"
    rows = read_metrics(metrics) if metrics.exists() else []
    return rlbus_steps(rows, float((work / f"{name}.t0").read_text()))


def run_rlbus(opts, work: Path, name: str) -> int:
    argv = rl_argv(opts.config, work, name, opts.max_steps, opts.extra)
    start_time(work, name)
    return run_process(argv, work / f"{name}.console.txt")


def read_trl(work: Path, name: str) -> list[Step]:
    path = work / f"{name}.steps.jsonl"
    return trl_steps(path.read_text()) if path.exists() else []


def run_trl(work: Path, name: str, python: Path, job: Path) -> int:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = start_time(work, name)
    argv = [str(python), str(TRL_SCRIPT), str(job), str(work / f"{name}.steps.jsonl"), repr(t0)]
    return run_process(argv, work / f"{name}.console.txt", env=env)


# ---- the TRL job and venv ------------------------------------------------------------------


def resolved_config(opts):
    """The RLConfig `rl` will run, so that the TRL job is built from the same values."""
    from rlbus.configs.base import parse_cli
    from rlbus.configs.rl import RLConfig

    return parse_cli(
        RLConfig, ["@", str(opts.config), "--max-steps", str(opts.max_steps), *opts.extra]
    )


def training_examples(config, count: int) -> list[dict]:
    """The first `count` training problems in the orchestrator's order (one environment only)."""
    from rlbus_orchestrator.envs.base import problem_messages
    from rlbus_orchestrator.envs.registry import load_environment
    from rlbus_orchestrator.task_issue import dataset_index

    orch = config.orchestrator
    if len(orch.env) != 1:
        sys.exit(f"vs_trl: needs exactly one [[orchestrator.env]], the config has {len(orch.env)}")
    env = load_environment(orch.env[0].id, orch.env[0].args)
    examples = []
    for cursor in range(count):
        problem = env.example("train", dataset_index(cursor, env.num_examples("train"), orch.seed))
        examples.append({"prompt": problem_messages(problem), "answer": problem.answer})
    return examples


def trl_job(config, output_dir: Path) -> dict:
    """What vs_trl_grpo.py needs, from the resolved rl config."""
    orch, optim = config.orchestrator, config.trainer.optim
    prompts_per_step = orch.batch_size // orch.group_size
    model = Path(config.model.name)
    return {
        "model": str(model if model.is_absolute() else REPO / model),
        "output_dir": str(output_dir),
        "max_steps": config.max_steps,
        "prompts_per_step": prompts_per_step,
        "num_generations": orch.group_size,
        "max_completion_length": orch.sampling.max_tokens,
        "temperature": orch.sampling.temperature,
        "top_p": orch.sampling.top_p,
        "lr": optim.lr,
        "weight_decay": optim.weight_decay,
        "betas": list(optim.betas),
        "eps": optim.eps,
        "max_norm": optim.max_norm,
        # rlbus's only KL-like term is loss.kl_tau (0 in the example); TRL's is beta.
        "kl_beta": getattr(config.trainer.loss, "kl_tau", 0.0),
        "scale_rewards": "group" if orch.normalize_advantages else "none",
        "seed": orch.seed,
        "examples": training_examples(config, config.max_steps * prompts_per_step),
    }


def trl_requirements() -> list[str]:
    """The TRL venv's packages: the latest of each, torch pinned to the project's own build."""
    return [*TRL_PACKAGES[:-1], f"torch=={version('torch')}"]


def venv_versions(python: Path) -> dict[str, str] | None:
    """Installed versions of TRL_PACKAGES in the venv of `python`, None when it is broken."""
    code = (
        "import importlib.metadata as m, json, sys; "
        "print(json.dumps({p: m.version(p) for p in sys.argv[1:]}))"
    )
    done = subprocess.run([str(python), "-c", code, *TRL_PACKAGES], capture_output=True, text=True)
    return json.loads(done.stdout) if done.returncode == 0 else None


def ensure_trl_venv(venv: Path, reinstall: bool) -> tuple[Path, dict[str, str]]:
    """The TRL venv's python and package versions; made with uv when missing or out of date.
    Bytecode is compiled at install, as pip does by default for a TRL user."""
    python, stamp = venv / "bin" / "python", venv / STAMP
    wanted = trl_requirements()
    if not reinstall and stamp.exists() and json.loads(stamp.read_text()) == wanted:
        versions = venv_versions(python)
        if versions and versions["torch"] == version("torch"):
            return python, versions
    if venv.exists() and not (venv / "pyvenv.cfg").exists():
        sys.exit(f"vs_trl: --venv {venv} exists and is not a venv; pass another --venv path")
    uvw = str(REPO / "uvw")
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    print(f"vs_trl: making the TRL venv {venv} ({' '.join(wanted)})", flush=True)
    for argv in (
        [uvw, "venv", "--clear", "--python", py, str(venv)],
        [uvw, "pip", "install", "--python", str(python), "--compile-bytecode", *wanted],
    ):
        if (code := subprocess.run(argv).returncode) != 0:
            sys.exit(f"vs_trl: `{' '.join(argv[1:3])}` exited {code} making the TRL venv (above)")
    versions = venv_versions(python)
    if not versions:
        sys.exit(
            f"vs_trl: the TRL venv {venv} does not import its packages; rerun with --reinstall"
        )
    stamp.write_text(json.dumps(wanted))
    return python, versions


# ---- main ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=REPO / "examples/reverse-text/rl.toml")
    parser.add_argument("--pairs", type=int, default=1, help="TRL/rlbus pairs, back to back")
    parser.add_argument("--max-steps", type=int, default=60, help="steps of each run")
    parser.add_argument("--target", type=float, default=0.85, help="trailing mean reward to reach")
    parser.add_argument("--window", type=int, default=10, help="steps of the trailing mean")
    parser.add_argument("--reward-step", type=int, default=40, help="step of the reward column")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="the TRL venv")
    parser.add_argument("--reinstall", action="store_true", help="make the TRL venv again")
    parser.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    parser.add_argument(
        "--reuse", type=Path, help="measure the kept runs in this directory again (no launch)"
    )
    parser.add_argument("extra", nargs="*", help="more rl flags, after --")
    opts = parser.parse_args(argv)
    for flag, value in (("--pairs", opts.pairs), ("--max-steps", opts.max_steps)):
        if value < 1:
            parser.error(f"{flag} must be at least 1 (got {value})")
    if opts.window < 1 or opts.window > opts.max_steps:
        parser.error(f"--window must be between 1 and --max-steps {opts.max_steps}")
    return opts


@contextmanager
def announced(what: str):
    """Print `what` with its wall time and the 1-minute load average before and after: numbers
    from a busy machine are only comparable with the load they ran under."""
    print(f"{what} ... (load {os.getloadavg()[0]:.1f})", flush=True)
    started = time.monotonic()
    yield
    print(f"{what}: {time.monotonic() - started:.0f} s (load {os.getloadavg()[0]:.1f})", flush=True)


def main() -> None:
    opts = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the `finally`s that stop runs
    if opts.reuse:
        versions = json.loads((opts.reuse / "versions.json").read_text())
        work = opts.reuse
    else:
        python, versions = ensure_trl_venv(opts.venv, opts.reinstall)
        work = Path(tempfile.mkdtemp(prefix="rlbus-vs-trl-"))
        (work / "versions.json").write_text(json.dumps(versions))
        job = work / "trl-job.json"
        job.write_text(json.dumps(trl_job(resolved_config(opts), work / "trl-out")))
    trl, rlbus, failed, key = [], [], [], "reward/mean"
    try:
        for pair in range(opts.pairs):
            if not opts.reuse:
                with announced(f"pair {pair + 1}/{opts.pairs}: TRL"):
                    failed += [f"trl-{pair}"] if run_trl(work, f"trl-{pair}", python, job) else []
            trl.append(measure(read_trl(work, f"trl-{pair}"), opts))
            if not opts.reuse:
                with announced(f"pair {pair + 1}/{opts.pairs}: rlbus"):
                    failed += [f"rlbus-{pair}"] if run_rlbus(opts, work, f"rlbus-{pair}") else []
            steps, key = read_rlbus(work, f"rlbus-{pair}")
            rlbus.append(measure(steps, opts))
    finally:
        print_report(opts, trl, rlbus, versions, key)
        if failed or opts.keep or opts.reuse:
            print(f"runs kept in {work}")
        else:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    if failed:
        sys.exit(f"vs_trl: {', '.join(failed)} exited non-zero; see <run>.console.txt in {work}")


def print_report(opts, trl: list[Measures], rlbus: list[Measures], versions, key: str) -> None:
    pairs = min(len(trl), len(rlbus))
    if not pairs:
        return
    print(
        f"\n{opts.config.name}, {opts.max_steps} steps per run, {pairs} pair(s); "
        f"TRL {versions['trl']} (transformers {versions['transformers']}, torch {versions['torch']})"
    )
    print(
        f"reward: rlbus `{key}` of metrics.jsonl, TRL's logged `reward`; trailing "
        f"{opts.window}-step means; medians over pairs\n"
    )
    print(format_table(table_rows(trl[:pairs], rlbus[:pairs], opts)))


if __name__ == "__main__":
    main()
