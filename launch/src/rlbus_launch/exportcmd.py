"""`rl export RUN_DIR [--step N] [--out DIR] [--merged]`: a run's checkpoint as a model directory
that transformers and vLLM load (docs/export.md).

    rl export outputs/my-run                      # the newest checkpoint -> outputs/my-run/exports/step_<N>
    rl export outputs/my-run --step 20 --out /models/mine
    rl export outputs/my-lora-run --merged        # the adapter folded into the base's weights

Works on `rl` and `sft` run directories. The export runs in a trainer process
(`python -m rlbus_trainer.export_checkpoint`, one rank: this launcher imports no torch), which
loads the checkpoint into the run's model and writes a Hugging Face directory (sharded safetensors
past `export.max_shard_size`, config, generation config, tokenizer) or, for a LoRA run without
`--merged`, the PEFT adapter directory. Exit 0 with the directory's path printed; 2 with one line
for a directory that is no run or a step without a complete checkpoint; the exporter's exit code
when it fails.
"""

import argparse
import subprocess
import sys
from pathlib import Path

from rlbus.rundirs import CHECKPOINTS_DIR, FINAL_MODEL_DIR, complete_steps

PROG = "rl export"
EXPORTS_DIR = "exports"
"""Where `rl export` writes by default: `<run_dir>/exports/step_<N>[-merged]/`."""
RUN_CONFIGS = ("trainer.toml", "sft.toml")


class ExportError(Exception):
    """Nothing to export where the user pointed: printed as one line, exit 2."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="an rl or sft run directory")
    parser.add_argument(
        "--step", type=int, help="checkpoint step (default: the newest complete one)"
    )
    parser.add_argument(
        "--out", type=Path, help="directory to write (default: RUN_DIR/exports/step_N[-merged])"
    )
    parser.add_argument(
        "--merged", action="store_true", help="LoRA runs: fold the adapter into the base weights"
    )
    return parser.parse_args(argv)


def chosen_step(run_dir: Path, step: int | None) -> int:
    """`step`, checked, or the newest complete checkpoint."""
    if not run_dir.is_dir() or not any((run_dir / "configs" / f).is_file() for f in RUN_CONFIGS):
        raise ExportError(
            f"{run_dir} is not a run directory (it has no configs/trainer.toml or configs/sft.toml)"
        )
    steps = complete_steps(run_dir)
    if not steps:
        final = run_dir / FINAL_MODEL_DIR
        hint = (
            f"; its final model is {final}"
            if final.is_dir()
            else "; set ckpt.interval (a [ckpt] table) so runs keep checkpoints"
        )
        raise ExportError(
            f"{run_dir} has no complete checkpoint in {run_dir / CHECKPOINTS_DIR}{hint}"
        )
    if step is None:
        return steps[-1]
    if step not in steps:
        raise ExportError(
            f"--step {step}: {run_dir} has no complete checkpoint of that step "
            f"(complete: {', '.join(map(str, steps))})"
        )
    return step


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        step = chosen_step(args.run_dir, args.step)
    except ExportError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 2
    out = args.out or args.run_dir / EXPORTS_DIR / f"step_{step}{'-merged' if args.merged else ''}"
    print(f"{PROG}: writing step {step} of {args.run_dir} to {out}", file=sys.stderr, flush=True)
    argv = [sys.executable, "-m", "rlbus_trainer.export_checkpoint"]
    argv += [str(args.run_dir.absolute()), str(step), str(out.absolute())]
    done = subprocess.run([*argv, *(["--merged"] if args.merged else [])], check=False)
    return done.returncode
