"""The loss variants (`trainer.loss.type`, docs/algorithms.md) side by side on one task.

    uv run python benchmarks/algorithms.py [--max-steps 40] [--config C] [--variants a,b] [--keep] [-- rl flags]

Each variant is one `rl @ CONFIG --max-steps S --trainer.loss.type X ...` run (default config
examples/reverse-text/rl.toml: same model, seeds, sampling and optimizer for every variant) in a
fresh output dir, one after another. From each run's metrics.jsonl it prints one table row: the
mean sampled reward (`reward/mean`) averaged over the 5 steps ending at steps 10, 20 and 40 (one
step's mean over 16 groups is noisy), the median step time (end to end of consecutive trained
steps, after the first 2), the trainer's loss-specific metrics at the last step, and the exit code.
Steps beyond --max-steps print as "-". Exit 0 when every run exited 0.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rlbus import process_marks

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STOP_WAIT_S = 60.0
REPORT_STEPS = (10, 20, 40)
TRAILING = 5

VARIANTS: dict[str, list[str]] = {
    "default": ["--trainer.loss.type", "default"],
    "dr_grpo": ["--trainer.loss.type", "dr_grpo"],
    "gspo": ["--trainer.loss.type", "gspo"],
    "dapo": ["--trainer.loss.type", "dapo"],
    "default+ref_kl": ["--trainer.loss.type", "default", "--trainer.loss.ref-kl-coef", "0.05"],
}
"""Name -> the `rl` flags that select it (everything else comes from the config)."""


def run_variant(config: Path, work: Path, name: str, flags: list[str], max_steps: int) -> int:
    """One `rl` run in its own process group, console in `<work>/<name>.console.txt`."""
    argv = [
        str(BIN / "rl"),
        "@",
        str(config),
        "--output-dir",
        str(work),
        "--run.name",
        name,
        "--max-steps",
        str(max_steps),
        *flags,
    ]
    with open(work / f"{name}.console.txt", "wb") as out:
        proc = subprocess.Popen(
            argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait()
        finally:
            if proc.poll() is None:
                process_marks.stop_group(proc, STOP_WAIT_S)


def trained_rows(work: Path, name: str) -> list[dict]:
    """metrics.jsonl rows with both the trainer's part (`loss`) and the reward, by step."""
    from rlbus_launch.plot import read_metrics

    path = work / name / "metrics.jsonl"
    rows = read_metrics(path) if path.exists() else []
    return sorted(
        (r for r in rows if "loss" in r and "reward/mean" in r and "time" in r),
        key=lambda r: r["step"],
    )


def trailing_reward(rows: list[dict], step: int) -> float | None:
    """Mean `reward/mean` over the TRAILING steps ending at `step` (None: not reached)."""
    window = [r["reward/mean"] for r in rows if step - TRAILING < r["step"] <= step]
    return statistics.fmean(window) if any(r["step"] == step for r in rows) else None


def median_step_s(rows: list[dict]) -> float | None:
    times = [float(r["time"]) for r in rows[2:]]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return statistics.median(gaps) if gaps else None


def row_cells(name: str, rows: list[dict], code: int) -> list[str]:
    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    last = rows[-1] if rows else {}
    extra = [f"{k}={last[k]:.3g}" for k in ("clipped_frac", "ref_kl") if k in last]
    return [
        name,
        *(fmt(trailing_reward(rows, s), ".3f") for s in REPORT_STEPS),
        fmt(median_step_s(rows), ".2f"),
        str(len(rows)),
        " ".join(extra) or "-",
        str(code),
    ]


def format_table(cells: list[list[str]]) -> str:
    header = [
        "variant",
        *(f"reward@{s}" for s in REPORT_STEPS),
        "s/step",
        "steps",
        "last step",
        "exit",
    ]
    lines = [header, *cells]
    widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
    out = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in lines
    ]
    out.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--config", type=Path, default=REPO / "examples/reverse-text/rl.toml")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names")
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    parser.add_argument("extra", nargs="*", help="after --: flags for every rl run")
    opts = parser.parse_args()
    names = opts.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    work = Path(tempfile.mkdtemp(prefix="rlbus-algorithms-"))
    cells, codes = [], []
    for name in names:
        code = run_variant(opts.config, work, name, VARIANTS[name] + opts.extra, opts.max_steps)
        rows = trained_rows(work, name)
        cells.append(row_cells(name, rows, code))
        codes.append(code)
        print(f"{name}: exit {code}, {len(rows)} steps", file=sys.stderr, flush=True)
    print(format_table(cells))
    print(
        f"\nreward: mean of `reward/mean` over the {TRAILING} steps ending at the step; s/step: "
        f"median over steps 3..{opts.max_steps}; config {opts.config}; runs in {work}"
    )
    if not opts.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
