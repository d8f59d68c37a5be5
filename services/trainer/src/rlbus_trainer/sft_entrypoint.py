"""One SFT rank, as torchrun starts it: parse SFTConfig, then the service shell (rlbus.lifecycle)
runs `rlbus_trainer.sft.run`.

    python -m torch.distributed.run ... -m rlbus_trainer.sft_entrypoint @ <run_dir>/configs/sft.toml

The `sft` command (rlbus_launch.sft) writes that config and starts torchrun; do not start ranks
by hand. Logs go to `<run_dir>/logs/sft.log` (rank r: `sft-rank<r>.log`).
"""

from rlbus import lifecycle
from rlbus.configs import SFTConfig
from rlbus.configs.base import parse_cli
from rlbus.configs.paths import exit_if_paths_missing
from rlbus.rundirs import ensure_run_name
from rlbus_trainer.entrypoint import die_with_agent


def main(argv: list[str] | None = None) -> None:
    die_with_agent()  # a SIGKILLed torchrun agent takes its ranks along
    config = parse_cli(SFTConfig, argv, prog="sft")
    exit_if_paths_missing(config)
    run_dir = ensure_run_name(config, "sft")
    lifecycle.main(
        "sft",
        config,
        "rlbus_trainer.sft",
        command="sft",
        run_dir=run_dir,
        run_id=config.run.name,
        rank=lifecycle.process_rank(),
    )


if __name__ == "__main__":
    main()
