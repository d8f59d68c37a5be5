"""`python -m rlbus_trainer.export_checkpoint RUN_DIR STEP OUT [--merged]`: a checkpoint as a model.

Builds the run's trainer from its resolved config (`configs/trainer.toml` of an `rl` run,
`configs/sft.toml` of an `sft` run; one rank), loads the complete checkpoint
`RUN_DIR/checkpoints/step_<STEP>/` into it (DCP reshards one saved by several ranks), and writes
it to OUT as export.py does: a Hugging Face model directory, or for a LoRA run its adapter
(`--merged`: the model with the adapter folded in). `rl export` runs it, and `rl eval RUN_DIR
--step N` (with `--merged`: it serves a whole model) when step N's weights are not in
`broadcasts/`. Exit 0 with OUT written (its path printed), 2 with one line when the run or the
checkpoint is not there.
"""

import sys
from pathlib import Path

from rlbus.configs import SFTConfig, TrainerConfig
from rlbus.configs.base import parse_cli
from rlbus.rundirs import complete_steps

CONFIG_FILES = {"trainer.toml": TrainerConfig, "sft.toml": SFTConfig}
"""A run's resolved trainer config, by the command that made the run (`rl`, `sft`)."""


def run_trainer_config(run_dir: Path) -> TrainerConfig | None:
    """The trainer config `run_dir` was trained with (None: not a run directory)."""
    for name, cls in CONFIG_FILES.items():
        path = run_dir / "configs" / name
        if path.is_file():
            return parse_cli(cls, ["@", str(path)], prog="export_checkpoint")
    return None


def export(run_dir: Path, step: int, out: Path, *, merged: bool = False) -> Path:
    """Write step `step`'s checkpoint of `run_dir` to `out` (export.write_model)."""
    from rlbus_trainer import ckpt
    from rlbus_trainer.engine import build_engine, setup_distributed, teardown_distributed
    from rlbus_trainer.export import write_model

    config = run_trainer_config(run_dir)
    assert config is not None, f"{run_dir} has no trainer config"
    world = setup_distributed()
    try:
        engine = build_engine(config, world)
        ckpt.load_checkpoint(engine, run_dir, step)
        return write_model(engine.full_state_dict(), config, out, merged=merged)
    finally:
        teardown_distributed()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    merged = "--merged" in args
    args = [a for a in args if a != "--merged"]
    if len(args) != 3 or not args[1].isdigit():
        print(
            "usage: python -m rlbus_trainer.export_checkpoint RUN_DIR STEP OUT [--merged]",
            file=sys.stderr,
        )
        return 2
    run_dir, step, out = Path(args[0]), int(args[1]), Path(args[2])
    if not any((run_dir / "configs" / name).is_file() for name in CONFIG_FILES):
        print(
            f"export_checkpoint: {run_dir} has no configs/trainer.toml or configs/sft.toml",
            file=sys.stderr,
        )
        return 2
    if step not in complete_steps(run_dir):
        steps = ", ".join(map(str, complete_steps(run_dir))) or "none"
        print(
            f"export_checkpoint: {run_dir} has no complete checkpoint of step {step} "
            f"(complete: {steps})",
            file=sys.stderr,
        )
        return 2
    print(export(run_dir, step, out, merged=merged))
    return 0


if __name__ == "__main__":
    sys.exit(main())
