"""`trainer`: parse TrainerConfig, then the service shell (rlbus.lifecycle) runs the RL trainer
(one process per rank).

`rl` starts it as `python -m torch.distributed.run --standalone --nproc-per-node N
-m rlbus_trainer.entrypoint @ <run_dir>/configs/trainer.toml`; a bare `trainer @ ...` is one rank.
torch is imported by `rlbus_trainer.service`, after parsing, so `--help` is instant.

Under torchrun each rank first asks the kernel for SIGKILL when its parent (torchrun's agent)
dies (rlbus.process_marks.die_with_parent): the ranks live in sessions of their own, so a SIGKILLed agent
would otherwise leave them running. A bare `trainer` (no torchrun) keeps its parent's rules.
"""

import os
import signal

from rlbus import lifecycle
from rlbus.configs import TrainerConfig
from rlbus.configs.base import exit_with_config_error, parse_cli
from rlbus.configs.paths import exit_if_paths_missing
from rlbus.process_marks import die_with_parent
from rlbus.rundirs import ensure_run_name, run_id_of

TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"
"""Set by torchrun's agent in every rank it starts."""


def die_with_agent() -> None:
    """Under torchrun: SIGKILL this rank when the agent that started it exits."""
    if TORCHRUN_ENV in os.environ:
        die_with_parent(signal.SIGKILL)


def main(argv: list[str] | None = None) -> None:
    die_with_agent()
    config = parse_cli(TrainerConfig, argv, prog="trainer")
    if config.data.fake is not None and config.max_steps is None:
        exit_with_config_error("--max-steps: fake data never ends: set max_steps (--max-steps N)")
    exit_if_paths_missing(config)
    run_dir = ensure_run_name(config, "trainer")
    lifecycle.main(
        "trainer",
        config,
        # `[data.fake]`: random rollouts, no bus (a throughput run, fake_rollouts.py).
        "rlbus_trainer.service" if config.data.fake is None else "rlbus_trainer.fake_rollouts",
        command="trainer",
        run_dir=run_dir,
        run_id=run_id_of(config.bus.run_id, config.run.name),
        rank=lifecycle.process_rank(),
    )


if __name__ == "__main__":
    main()
