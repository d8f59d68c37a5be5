"""Trainer throughput and peak memory: plain vs optim_cpu_offload vs full_offload, side by side.

    uv run python benchmarks/trainer.py [--steps 8] [--hidden-size 256] [--num-layers 4] [--seq-len 512]

Each mode runs in its own process (so peak memory is its own): a Qwen3 model built by
`rlbus-tiny-model` with the given sizes, the trainer engine (FSDP2 over one gloo rank, AdamW), and
`--steps` RL steps of random packed batches (`tests/trainer_support.py`: `make_train_batch`). The first
step is warm-up and not timed. Printed: tokens/s, peak memory (CUDA max allocated on a GPU, the
process's max RSS on CPU) and the ratio of each to the plain mode.

On a CPU-only machine the optimizer state is already in host memory, so optim_cpu_offload can
only cost a little; full_offload keeps FP32 masters on the host in addition to the model and
steps each parameter inside backward (fused CPU AdamW), so it trades memory for overlap. The
numbers that matter for offload are GPU numbers; run this there too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS)]  # + trainer_support (make_train_batch)

MODES = {
    "plain": {"optim_cpu_offload": False},
    "optim_cpu_offload": {"optim_cpu_offload": True},
    "full_offload": {"optim_cpu_offload": False, "full_offload": True},
}


def run_mode(mode: str, model_dir: str, steps: int, seq_len: int) -> dict:
    import resource
    import time

    import torch
    from trainer_support import make_train_batch

    from rlbus.configs.trainer import TrainerConfig
    from rlbus_trainer.engine import build_engine, setup_distributed
    from rlbus_trainer.loss import build_loss_fn

    config = TrainerConfig(
        model={"name": model_dir, **MODES[mode]},
        optim={"type": "adamw", "lr": 1e-4},
        loss={"mask_low": 1.0, "mask_high": 1.0},
        seq_len=seq_len,
        tokens_per_forward=2048,
    )
    engine = build_engine(config, setup_distributed())
    loss_fn = build_loss_fn(config.loss)
    num_sequences = max(1, seq_len // 12)
    batches = [
        make_train_batch(s, num_sequences=num_sequences).micro_batches[0] * 4 for s in range(steps)
    ]
    engine.train_step(batches[0], loss_fn)  # warm-up
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start, tokens = time.perf_counter(), 0
    for mbs in batches[1:]:
        tokens += engine.train_step(mbs, loss_fn).num_tokens
    elapsed = time.perf_counter() - start
    peak = (
        torch.cuda.max_memory_allocated()
        if torch.cuda.is_available()
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {
        "mode": mode,
        "tokens_per_s": tokens / elapsed,
        "peak_memory_mb": peak / 2**20,
        "step_s": elapsed / max(1, steps - 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--_mode", help=argparse.SUPPRESS)
    parser.add_argument("--_model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._mode:  # child process: one mode
        print(json.dumps(run_mode(args._mode, args._model, args.steps, args.seq_len)))
        return

    from rlbus_trainer.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(
            Path(tmp) / "model",
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            intermediate_size=3 * args.hidden_size,
            num_heads=args.hidden_size // 32,
            num_kv_heads=args.hidden_size // 32,
        )
        results = []
        for mode in MODES:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--_mode",
                    mode,
                    "--_model",
                    str(model),
                    "--steps",
                    str(args.steps),
                    "--seq-len",
                    str(args.seq_len),
                ],
                capture_output=True,
                text=True,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
                check=True,
            )
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = results[0]
    print(
        f"model hidden={args.hidden_size} layers={args.num_layers}, seq_len={args.seq_len}, {args.steps - 1} timed steps"
    )
    print(f"{'mode':<20}{'tokens/s':>12}{'x plain':>10}{'peak MiB':>12}{'x plain':>10}")
    for r in results:
        print(
            f"{r['mode']:<20}{r['tokens_per_s']:>12.0f}{r['tokens_per_s'] / base['tokens_per_s']:>10.2f}"
            f"{r['peak_memory_mb']:>12.0f}{r['peak_memory_mb'] / base['peak_memory_mb']:>10.2f}"
        )


if __name__ == "__main__":
    main()
