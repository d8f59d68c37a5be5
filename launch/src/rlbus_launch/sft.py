"""`sft`: supervised fine-tuning; launches torchrun itself (never call torchrun by hand).

    sft @ examples/reverse-text/sft.toml [--flags] [--dry-run]

Parse SFTConfig, name the run (`<dataset>--<model>--<short-id>`), apply the run-directory rules,
write the resolved config to `<run_dir>/configs/sft.toml` and the torchrun command to
`<run_dir>/scripts/sft.sh`, then run that command (or, with `--dry-run`, print where it is and
stop). The ranks run `rlbus_trainer.sft_entrypoint` (trainer package), started by module name:
this launcher never imports the trainer, so `sft --help` and `sft --dry-run` stay instant.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import structlog

from rlbus.configs import SFTConfig
from rlbus.configs.base import exit_with_config_error, parse_cli
from rlbus.configs.paths import exit_if_paths_missing
from rlbus.lifecycle import EXIT_SERVICE_MISSING, config_inputs, errors_in_one_line
from rlbus.obs.logging import log_file_path, setup_logging
from rlbus.obs.sinks import check_sinks_installed
from rlbus.rundirs import sft_run_name
from rlbus_launch.plan import torchrun_argv
from rlbus_launch.restarts import shell_exit_code
from rlbus_launch.rundir import prepare_run_dir_or_exit
from rlbus_launch.scripts import config_path, describe_written, write_launch
from rlbus_launch.supervisor import ServiceProcess

log = structlog.get_logger()

SFT_RANK_MODULE = "rlbus_trainer.sft_entrypoint"
"""What torchrun runs on every rank (parse, service shell, `rlbus_trainer.sft.run`)."""


def prepare_sft(config: SFTConfig) -> tuple[SFTConfig, Path]:
    """Name the run and prepare its directory; returns the config the ranks get (no `clean`,
    `dry_run` or `slurm`: a rank never wipes, plans or resubmits its run) and the directory."""
    name_given = config.run.name is not None
    config = config.model_copy(deep=True)
    config.run.name = config.run.name or sft_run_name(config.data.path, config.model.name)
    run = prepare_run_dir_or_exit(config, name_given=name_given)
    setup_logging("sft-launch", run_dir=run.run_dir, run_id=config.run.name, level=config.log.level)
    resolved = config.model_copy(deep=True)
    resolved.clean = False  # already applied; the ranks must never wipe the run directory
    resolved.dry_run = False
    resolved.slurm = None
    return resolved, run.run_dir


def plan_sft(config: SFTConfig, command: str) -> tuple[ServiceProcess, list[Path], list[Path]]:
    """Name the run, prepare its directory, write the resolved config and the torchrun script."""
    resolved, run_dir = prepare_sft(config)
    process = ServiceProcess(
        name="sft",
        argv=torchrun_argv(
            config.num_processes, SFT_RANK_MODULE, config_path(run_dir, "sft").absolute()
        ),
        log_path=log_file_path(run_dir, "sft"),
        cwd=Path.cwd(),
    )
    configs, scripts = write_launch(run_dir, {"sft": resolved}, [process], command)
    return process, configs, scripts


def launch(process: ServiceProcess) -> int:
    """Run torchrun in the foreground (its output on this terminal); its exit code (128 + N
    when torchrun itself was killed by signal N)."""
    if importlib.util.find_spec("rlbus_trainer") is None:
        exit_with_config_error(
            f"{SFT_RANK_MODULE} is not in this installation, so SFT cannot train: "
            "install the trainer package (uv sync --all-packages)",
            title="Service not available",
            code=EXIT_SERVICE_MISSING,
        )
    log.info("sft_started", argv=process.argv)
    child = subprocess.Popen(process.argv, cwd=process.cwd)
    try:
        return shell_exit_code(child.wait())
    except KeyboardInterrupt:  # the ranks got the same SIGINT from the terminal
        return shell_exit_code(child.wait())


def main(argv: list[str] | None = None) -> None:
    config = parse_cli(SFTConfig, argv, prog="sft")
    # A dry run or a SLURM job only plans here: relative paths may be built before they run.
    exit_if_paths_missing(config, strict=not config.dry_run and config.slurm is None)
    check_sinks_installed(config.monitors)
    command = "sft " + " ".join(sys.argv[1:] if argv is None else argv)
    with errors_in_one_line("sft", inputs=config_inputs(config)):
        if config.slurm is not None:  # render and submit a batch job instead (rlbus_launch.slurm)
            from rlbus_launch.slurm import submit_sft

            resolved, run_dir = prepare_sft(config)
            sys.exit(submit_sft(config, resolved, run_dir, command))
        process, configs, scripts = plan_sft(config, command)
    if config.dry_run:
        print(describe_written(configs[0].parent.parent, configs, scripts))
        return
    with errors_in_one_line("sft", inputs=config_inputs(config)):
        code = launch(process)
    sys.exit(code)


if __name__ == "__main__":
    main()
