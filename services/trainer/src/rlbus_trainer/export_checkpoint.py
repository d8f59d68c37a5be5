"""`python -m rlbus_trainer.export_checkpoint RUN_DIR STEP OUT`: a trainer checkpoint as a model.

Builds the run's trainer (its `configs/trainer.toml`, one rank), loads the complete checkpoint
`RUN_DIR/checkpoints/step_<STEP>/` into it (DCP reshards one saved by several ranks), and writes
the weights as a Hugging Face directory OUT (LoRA adapters folded in), which vLLM serves. `rl eval
RUN_DIR --step N` runs it when step N's weights are not in `broadcasts/`. Exit 0 with OUT
written, 2 with one line when the run or the checkpoint is not there.
"""

import sys
from pathlib import Path

from rlbus.configs import TrainerConfig
from rlbus.configs.base import parse_cli
from rlbus.rundirs import complete_steps


def export(run_dir: Path, step: int, out: Path) -> Path:
    """Write step `step`'s checkpoint of `run_dir` as a model directory `out`."""
    from rlbus_trainer import ckpt
    from rlbus_trainer.engine import build_engine, setup_distributed, teardown_distributed
    from rlbus_trainer.hf_dir import write_hf_dir
    from rlbus_trainer.lora import merged_state_dict

    config = parse_cli(
        TrainerConfig, ["@", str(run_dir / "configs" / "trainer.toml")], prog="export_checkpoint"
    )
    world = setup_distributed()
    try:
        engine = build_engine(config, world)
        ckpt.load_checkpoint(engine, run_dir, step)
        state = engine.full_state_dict()
        if config.lora is not None:
            state = merged_state_dict(state, config.lora)
        return write_hf_dir(
            state, config.model.name, out, trust_remote_code=config.model.trust_remote_code
        )
    finally:
        teardown_distributed()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or not args[1].isdigit():
        print("usage: python -m rlbus_trainer.export_checkpoint RUN_DIR STEP OUT", file=sys.stderr)
        return 2
    run_dir, step, out = Path(args[0]), int(args[1]), Path(args[2])
    if not (run_dir / "configs" / "trainer.toml").exists():
        print(f"export_checkpoint: {run_dir} has no configs/trainer.toml", file=sys.stderr)
        return 2
    if step not in complete_steps(run_dir):
        steps = ", ".join(map(str, complete_steps(run_dir))) or "none"
        print(
            f"export_checkpoint: {run_dir} has no complete checkpoint of step {step} "
            f"(complete: {steps})",
            file=sys.stderr,
        )
        return 2
    print(export(run_dir, step, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
