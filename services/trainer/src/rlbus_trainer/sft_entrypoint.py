"""`sft`: supervised fine-tuning; launches torchrun itself (never call torchrun by hand).

    sft @ examples/reverse-text/sft.toml [--flags] [--dry-run]

The same module plays two parts:
- launcher (no torchrun variables in the environment): parse SFTConfig, name the run
  (`<dataset>--<model>--<short-id>`), apply the run-directory rules, write the resolved config to
  `<run_dir>/configs/sft.toml` and the torchrun command to `<run_dir>/scripts/sft.sh`, then
  run that command (or, with `--dry-run`, print where it is and stop);
- rank (started by torchrun with that config): set up logging and call `rlbus_trainer.sft.run`.
torch is imported only by the rank body, so `sft --help` and `sft --dry-run` stay instant.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import structlog

from rlbus.configs import SFTConfig
from rlbus.configs.base import exit_with_config_error, parse_cli
from rlbus.launch.entry import (
    EXIT_SERVICE_MISSING,
    ensure_run_name,
    load_service_run,
    prepare_run_dir_or_exit,
    process_rank,
    under_torchrun,
)
from rlbus.launch.plan import torchrun_argv
from rlbus.launch.scripts import config_path, describe_written, write_launch
from rlbus.launch.supervisor import ServiceProcess
from rlbus.monitors.sinks import check_sinks_installed
from rlbus.obs.logging import log_file_path, setup_logging
from rlbus.runs import sft_run_name

log = structlog.get_logger()

SFT_MODULE = "rlbus_trainer.sft"


def run_rank(config: SFTConfig) -> None:
    """One torchrun rank: logging to `<run_dir>/logs/sft.log` (rank r: `sft-rank<r>.log`), then train."""
    run_dir = ensure_run_name(config, "sft")
    setup_logging(
        "sft",
        run_dir=run_dir,
        run_id=config.run.name,
        level=config.log.level,
        json_console=config.log.json_console,
        rank=process_rank(),
    )
    run = load_service_run(SFT_MODULE, command="sft")
    run(config)


def plan_sft(config: SFTConfig, command: str) -> tuple[ServiceProcess, list[Path], list[Path]]:
    """Name the run, prepare its directory, write the resolved config and the torchrun script."""
    name_given = config.run.name is not None
    config = config.model_copy(deep=True)
    config.run.name = config.run.name or sft_run_name(config.data.path, config.model.name)
    run = prepare_run_dir_or_exit(config, name_given=name_given)
    setup_logging("sft-launch", run_dir=run.run_dir, run_id=config.run.name, level=config.log.level)
    resolved = config.model_copy(deep=True)
    resolved.clean = False  # already applied; the ranks must never wipe the run directory
    resolved.dry_run = False
    process = ServiceProcess(
        name="sft",
        argv=torchrun_argv(
            config.num_processes,
            "rlbus_trainer.sft_entrypoint",
            config_path(run.run_dir, "sft").absolute(),
        ),
        log_path=log_file_path(run.run_dir, "sft"),
        cwd=Path.cwd(),
    )
    configs, scripts = write_launch(run.run_dir, {"sft": resolved}, [process], command)
    return process, configs, scripts


def launch(process: ServiceProcess) -> int:
    """Run torchrun in the foreground (its output on this terminal); its exit code."""
    if importlib.util.find_spec(SFT_MODULE) is None:
        exit_with_config_error(
            f"{SFT_MODULE} is not in this installation, so SFT cannot train yet",
            title="Service not available",
            code=EXIT_SERVICE_MISSING,
        )
    log.info("sft_started", argv=process.argv)
    child = subprocess.Popen(process.argv, cwd=process.cwd)
    try:
        return child.wait()
    except KeyboardInterrupt:  # the ranks got the same SIGINT from the terminal
        return child.wait()


def main(argv: list[str] | None = None) -> None:
    config = parse_cli(SFTConfig, argv, prog="sft")
    check_sinks_installed(config.monitors)
    if under_torchrun():
        run_rank(config)
        return
    command = "sft " + " ".join(sys.argv[1:] if argv is None else argv)
    process, configs, scripts = plan_sft(config, command)
    if config.dry_run:
        print(describe_written(configs[0].parent.parent, configs, scripts))
        return
    sys.exit(launch(process))


if __name__ == "__main__":
    main()
