"""`rl`: one RL run = embedded NATS + inference + orchestrator + trainer, as subprocesses.

    rl @ examples/reverse-text/rl.toml [--flags]
      1. parse RLConfig (defaults < @ files < flags), name the run (`<envs>--<model>--<id>`)
      2. apply the run-directory rules (rlbus.runs): fresh, --resume or --clean
      3. plan the processes (rlbus.launch.plan) and write configs/ and scripts/ into the run dir
      4. --dry-run: print where they are and stop; otherwise start them (rlbus.launch.supervisor),
         watch them, and stop all when one fails or the trainer finishes.

The launcher never imports a service package; it starts them by module name.
"""

import sys
import time

import structlog

from rlbus.configs import RLConfig
from rlbus.configs.base import exit_with_config_error, parse_cli
from rlbus.launch.plan import Launch, build_rl_launch
from rlbus.launch.scripts import describe_written, write_launch
from rlbus.launch.supervisor import Supervisor
from rlbus.obs.logging import setup_logging
from rlbus.runs import RunDirError, prepare_run_dir, rl_run_name

log = structlog.get_logger()

FINISHING_SERVICES = frozenset({"trainer", "orchestrator"})
"""Services that exit 0 when max_steps is reached; the run is over when the trainer has."""


def name_run(config: RLConfig) -> tuple[RLConfig, bool]:
    """(config with run.name set, whether the user gave the name)."""
    given = config.run.name is not None
    name = config.run.name or rl_run_name(config.env_ids(), config.model.name)
    return config.with_run_name(name), given


def plan_rl(config: RLConfig, command: str = "rl") -> Launch:
    """Steps 1-3 for an already parsed config: returns the written launch."""
    config, name_given = name_run(config)
    if config.deployment.type != "local":
        exit_with_config_error(
            f"deployment.type {config.deployment.type!r} is not supported by this launcher yet: "
            "use --deployment.type local, or --dry-run and submit the scripts yourself"
        )
    try:
        run = prepare_run_dir(
            config.output_dir,
            config.run.name,
            config.run.dir,
            resume=config.resume is not None,
            resume_step=config.resume.step if config.resume else None,
            clean=config.clean,
            name_was_given=name_given,
            ckpt_enabled=config.ckpt is not None,
        )
    except RunDirError as error:
        exit_with_config_error(str(error), title="Run directory")
    setup_logging(
        "rl",
        run_dir=run.run_dir,
        run_id=config.bus.run_id,
        level=config.log.level,
        json_console=config.log.json_console,
    )
    if run.resuming and not run.save_checkpoints:
        log.warning("resume_without_ckpt", hint="the run loads its checkpoint but saves no new ones: add [ckpt]")
    launch = build_rl_launch(config, run.run_dir)
    launch.config_files, launch.script_files = write_launch(
        run.run_dir, launch.configs, launch.processes, command, launch.files
    )
    return launch


def supervise(launch: Launch, poll_s: float = 0.5) -> int:
    """Start every process in order; stop all when one fails (its exit code) or the trainer
    finishes (0). Ctrl-C stops all (130)."""
    supervisor = Supervisor()
    try:
        for process in launch.processes:
            supervisor.start(process)
        while True:
            failure = supervisor.first_failure(expected_to_exit=FINISHING_SERVICES)
            if failure is not None:
                service, code = failure
                log.error("service_failed", service=service.name, exit_code=code, log=str(service.log_path))
                sys.stderr.write(f"\n--- last lines of {service.log_path} ---\n{service.tail()}\n")
                return code or 1
            trainer = next((p for p in supervisor.services if p.name == "trainer"), None)
            if trainer is not None and trainer.poll() == 0:
                log.info("run_finished", run_dir=str(launch.run_dir))
                return 0
            time.sleep(poll_s)
    except KeyboardInterrupt:
        log.warning("interrupted")
        return 130
    finally:
        supervisor.stop_all()


def main(argv: list[str] | None = None) -> None:
    config = parse_cli(RLConfig, argv, prog="rl")
    launch = plan_rl(config, command="rl " + " ".join(sys.argv[1:] if argv is None else argv))
    if config.dry_run:
        print(describe_written(launch.run_dir, launch.config_files, launch.script_files))
        return
    sys.exit(supervise(launch))


if __name__ == "__main__":
    main()
