"""`trainer`: parse TrainerConfig, then the service shell (rlbus.runtime) runs the RL trainer
(one process per rank).

`rl` starts it as `python -m torch.distributed.run --standalone --nproc-per-node N
-m rlbus_trainer.entrypoint @ <run_dir>/configs/trainer.toml`; a bare `trainer @ ...` is one rank.
torch is imported by `rlbus_trainer.service`, after parsing, so `--help` is instant.
"""

from rlbus import runtime
from rlbus.configs import TrainerConfig
from rlbus.configs.base import parse_cli
from rlbus.runs import ensure_run_name, run_id_of


def main(argv: list[str] | None = None) -> None:
    config = parse_cli(TrainerConfig, argv, prog="trainer")
    run_dir = ensure_run_name(config, "trainer")
    runtime.main(
        "trainer",
        config,
        "rlbus_trainer.service",
        command="trainer",
        run_dir=run_dir,
        run_id=run_id_of(config.bus.run_id, config.run.name),
        rank=runtime.process_rank(),
    )


if __name__ == "__main__":
    main()
