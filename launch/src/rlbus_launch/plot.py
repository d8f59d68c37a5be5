"""`rl-plot RUN_DIR`: PNG charts of a run's `metrics.jsonl` (reward, loss, lag, tokens/s per step).

metrics.jsonl holds one JSON object per step (trainer and orchestrator metrics joined by the
launcher's file monitor). Each chart picks the first metric key that exists from a short list of
candidates, so the plot keeps working as services add metrics.
"""

import argparse
import json
import sys
from pathlib import Path

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


def read_metrics(path: Path) -> list[dict]:
    """Rows of metrics.jsonl sorted by step; the last row wins for a repeated step."""
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


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Write one PNG per chart that has data; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{metrics_path} does not exist: is {run_dir} a run directory?")
    rows = read_metrics(metrics_path)
    out_dir = out_dir or run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, (title, candidates) in CHARTS.items():
        found = series(rows, candidates)
        if found is None:
            continue
        key, steps, values = found
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, values, marker=".", linewidth=1)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"{stem}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
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
