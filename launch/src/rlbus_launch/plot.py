"""`rl-plot RUN_DIR`: PNG charts of a run's `metrics.jsonl` (reward, loss, lag, tokens/s per step)
and, per environment, of its reward and its evaluations' reward.

metrics.jsonl holds one JSON object per step (trainer and orchestrator metrics joined by the
launcher's file monitor). Each chart picks the first metric key that exists from a short list of
candidates, so the plot keeps working as services add metrics. The per-environment charts draw
one line per environment: `env_reward.png` from the step metrics' `env/<id>/reward/mean`,
`eval_reward.png` from `evals.jsonl` (one row per evaluation of one environment, with its
`eval/<env>/reward/mean`); each only when the run has such keys.
"""

import argparse
import json
import sys
from pathlib import Path

from rlbus.rundirs import EVALS_FILE
from rlbus_launch.progress import mean_lag

# chart file stem -> (title, candidate metric keys in order of preference)
CHARTS: dict[str, tuple[str, list[str]]] = {
    "reward": ("Mean sampled reward", ["reward/mean", "reward_mean", "reward"]),
    "loss": ("Trainer loss", ["loss/mean", "loss", "train/loss"]),
    "lag": ("Off-policy lag (steps)", ["lag/mean", "off_policy_lag/mean", "lag"]),
    "tokens_per_s": (
        "Tokens per second",
        [
            "trainer/tokens_per_s",
            "tokens_per_s",
            "generate/tokens_per_s",
            "orchestrator/tokens_per_s",
        ],
    ),
}
METRICS_FILE = "metrics.jsonl"
# chart file stem -> (title, file of the run dir, key prefix, key suffix): one line per env of the
# `<prefix><env><suffix>` keys (evals.jsonl's rows of one step, one per env, join without clashing)
ENV_CHARTS: dict[str, tuple[str, str, str, str]] = {
    "env_reward": ("Mean sampled reward per environment", METRICS_FILE, "env/", "/reward/mean"),
    "eval_reward": ("Eval reward per environment", EVALS_FILE, "eval/", "/reward/mean"),
}

Lines = dict[str, tuple[list[int], list[float]]]
"""A chart's lines: label -> (steps, values)."""


def read_metrics(path: Path) -> list[dict]:
    """Rows of metrics.jsonl (or evals.jsonl) sorted by step; the rows of one step are joined,
    the last one winning for a repeated key."""
    by_step: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if "step" in row:
            by_step.setdefault(int(row["step"]), {}).update(row)
    return [with_mean_lag(by_step[step]) for step in sorted(by_step)]


def with_mean_lag(row: dict) -> dict:
    """Adds `lag/mean` from the lag histogram when the row has one."""
    if "lag/mean" not in row and (lag := mean_lag(row)) is not None:
        row["lag/mean"] = lag
    return row


def series(rows: list[dict], candidates: list[str]) -> tuple[str, list[int], list[float]] | None:
    """(key, steps, values) for the first candidate key present in any row."""
    for key in candidates:
        points = [
            (row["step"], float(row[key])) for row in rows if isinstance(row.get(key), (int, float))
        ]
        if points:
            steps, values = zip(*points, strict=True)
            return key, list(steps), list(values)
    return None


def env_series(rows: list[dict], prefix: str, suffix: str) -> Lines:
    """One line per environment `<env>` of the `<prefix><env><suffix>` keys of `rows`, sorted by
    env and step."""
    points: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, value in row.items():
            env = key.removeprefix(prefix).removesuffix(suffix)
            if key == f"{prefix}{env}{suffix}" and env and isinstance(value, (int, float)):
                points.setdefault(env, {})[row["step"]] = float(value)
    return {
        env: (sorted(by_step), [by_step[step] for step in sorted(by_step)])
        for env, by_step in sorted(points.items())
    }


def save_chart(path: Path, title: str, ylabel: str, lines: Lines, *, legend: bool = False) -> Path:
    """One PNG of `lines` over step, with their labels in a legend if `legend`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, (steps, values) in lines.items():
        ax.plot(steps, values, marker=".", linewidth=1, label=label)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Write one PNG per chart that has data; returns the files written."""
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{metrics_path} does not exist: is {run_dir} a run directory?")
    rows = read_metrics(metrics_path)
    out_dir = out_dir or run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, (title, candidates) in CHARTS.items():
        if found := series(rows, candidates):
            key, steps, values = found
            written.append(save_chart(out_dir / f"{stem}.png", title, key, {key: (steps, values)}))
    for stem, (title, file, prefix, suffix) in ENV_CHARTS.items():
        path = run_dir / file
        env_rows = read_metrics(path) if path.is_file() else []
        if lines := env_series(env_rows, prefix, suffix):
            ylabel = f"{prefix}<env>{suffix}"
            chart = save_chart(out_dir / f"{stem}.png", title, ylabel, lines, legend=True)
            written.append(chart)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rl-plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="run directory holding metrics.jsonl")
    parser.add_argument(
        "--out", type=Path, default=None, help="output folder (default: RUN_DIR/plots)"
    )
    args = parser.parse_args(argv)
    try:
        written = plot_run(args.run_dir, args.out)
    except FileNotFoundError as exc:
        sys.exit(f"rl-plot: {exc}")
    if not written:
        sys.exit(f"rl-plot: no known metric in {args.run_dir / 'metrics.jsonl'}")
    for path in written:
        print(path)


if __name__ == "__main__":
    main()
