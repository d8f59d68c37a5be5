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
import uuid
from pathlib import Path
from typing import Any

import structlog

from rlbus.configs import SFTConfig
from rlbus.configs.base import exit_with_config_error, parse_cli
from rlbus.configs.inference import InferenceConfig
from rlbus.configs.paths import exit_if_paths_missing
from rlbus.lifecycle import EXIT_SERVICE_MISSING, config_inputs, errors_in_one_line
from rlbus.obs.logging import log_file_path, setup_logging
from rlbus.obs.sinks import check_sinks_installed
from rlbus.rundirs import sft_run_name
from rlbus_launch.evalcmd import local_server
from rlbus_launch.plan import python_module_argv, torchrun_argv
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
    config.run.name = config.run.name or sft_run_name(config.data.label, config.model.name)
    run = prepare_run_dir_or_exit(config, name_given=name_given)
    setup_logging("sft-launch", run_dir=run.run_dir, run_id=config.run.name, level=config.log.level)
    resolved = config.model_copy(deep=True)
    resolved.clean = False  # already applied; the ranks must never wipe the run directory
    resolved.dry_run = False
    resolved.slurm = None
    return resolved, run.run_dir


EVAL_SERVER = "eval-inference"
"""The inference server `sft` starts for its evaluations: configs/eval-inference.toml, its log."""


def eval_server_config(resolved: SFTConfig, run_dir: Path) -> InferenceConfig | None:
    """The evaluation server to start (None: no `[eval]`, or an attached `eval.inference_url`):
    `eval.inference` serving `model.name` on free loopback ports without a bus, loading weights
    from the run's broadcasts/; the ranks get its URLs in `eval.inference_url` / `admin_url`."""
    if resolved.eval is None or resolved.eval.inference_url is not None:
        return None
    server = local_server(resolved.eval.inference, resolved.model.name)
    server.run_dir = str(run_dir)
    resolved.eval.inference_url = f"http://127.0.0.1:{server.server.port}/v1"
    resolved.eval.admin_url = f"http://127.0.0.1:{server.backend_port}"
    return server


def plan_sft(
    config: SFTConfig, command: str
) -> tuple[ServiceProcess, ServiceProcess | None, list[Path], list[Path]]:
    """Name the run, prepare its directory, write the resolved configs and the scripts: the
    torchrun process, and the evaluation server when the run evaluates on environments."""
    resolved, run_dir = prepare_sft(config)
    server_config = eval_server_config(resolved, run_dir)
    server = None
    if server_config is not None:
        server = ServiceProcess(
            name=EVAL_SERVER,
            argv=python_module_argv(
                "rlbus_inference.entrypoint", config_path(run_dir, EVAL_SERVER).absolute()
            ),
            log_path=log_file_path(run_dir, EVAL_SERVER),
            cwd=Path.cwd(),
            launch_id=uuid.uuid4().hex,  # it dies with this launcher (process_marks)
        )
    process = ServiceProcess(
        name="sft",
        argv=torchrun_argv(
            config.num_processes, SFT_RANK_MODULE, config_path(run_dir, "sft").absolute()
        ),
        log_path=log_file_path(run_dir, "sft"),
        cwd=Path.cwd(),
    )
    services: dict[str, Any] = {"sft": resolved}
    if server_config is not None:
        services[EVAL_SERVER] = server_config
    processes = [process] if server is None else [server, process]
    configs, scripts = write_launch(run_dir, services, processes, command)
    return process, server, configs, scripts


def launch(process: ServiceProcess, server: ServiceProcess | None = None) -> int:
    """Run torchrun in the foreground (its output on this terminal); its exit code (128 + N
    when torchrun itself was killed by signal N). The evaluation server, if any, runs beside it
    and is stopped by its pid at the end."""
    if server is None:
        return run_ranks(process)
    server.start()
    log.info("sft_eval_server_started", pid=server.pid, log=str(server.log_path))
    try:
        return run_ranks(process)
    finally:
        server.stop()


def run_ranks(process: ServiceProcess) -> int:
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
        process, server, configs, scripts = plan_sft(config, command)
    if config.dry_run:
        print(describe_written(configs[0].parent.parent, configs, scripts))
        return
    with errors_in_one_line("sft", inputs=config_inputs(config)):
        code = launch(process, server)
    sys.exit(code)


if __name__ == "__main__":
    main()
