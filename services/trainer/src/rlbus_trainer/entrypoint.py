"""`trainer`: parse TrainerConfig, set up logging, run the RL trainer (one process per rank).

`rl` starts it as `python -m torch.distributed.run --standalone --nproc-per-node N
-m rlbus_trainer.entrypoint @ <run_dir>/configs/trainer.toml`; a bare `trainer @ ...` is one rank.
torch is imported by `rlbus_trainer.service`, after parsing, so `--help` is instant.
"""

from rlbus.configs import TrainerConfig
from rlbus.configs.base import parse_cli
from rlbus.launch.entry import ensure_run_name, load_service_run, process_rank
from rlbus.obs.logging import setup_logging


def main(argv: list[str] | None = None) -> None:
    config = parse_cli(TrainerConfig, argv, prog="trainer")
    run_dir = ensure_run_name(config, "trainer")
    setup_logging(
        "trainer",
        run_dir=run_dir,
        run_id=config.bus.run_id or config.run.name,
        level=config.log.level,
        json_console=config.log.json_console,
        rank=process_rank(),
    )
    run = load_service_run("rlbus_trainer.service", command="trainer")
    run(config)


if __name__ == "__main__":
    main()
