"""`rl`: one RL run = embedded NATS + inference + orchestrator + trainer, as subprocesses.

    rl @ examples/reverse-text/rl.toml [--flags]
      1. parse RLConfig (defaults < @ files < flags), name the run (`<envs>--<model>--<id>`)
      2. apply the run-directory rules (rlbus.runs): fresh, --resume or --clean
      3. plan the processes (rlbus.launch.plan) and write configs/ and scripts/ into the run dir
      4. --dry-run: print where they are and stop; otherwise take the run directory's lock
         (rlbus.launch.lock), start the watchdog (rlbus.launch.watchdog) and the services
         (rlbus.launch.supervisor), watch them, restart one that dies (budget and backoff from
         `[supervision]`), and stop all when the trainer finishes, a budget is spent, or on a
         signal (docs/launcher.md, "Supervision").

The launcher never imports a service package; it starts them by module name.
"""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import structlog

from rlbus.configs import RLConfig
from rlbus.configs.base import EXIT_CONFIG_ERROR, exit_with_config_error, parse_cli
from rlbus.launch.lock import refuse_if_live, remove_lock, write_lock
from rlbus.launch.plan import Launch, build_rl_launch
from rlbus.launch.progress import Progress
from rlbus.launch.scripts import describe_written, write_launch
from rlbus.launch.supervisor import (
    RestartPolicy,
    ServiceProcess,
    Supervisor,
    describe_exit,
    launcher_exit_code,
)
from rlbus.monitors.sinks import check_sinks_installed
from rlbus.obs.logging import setup_logging
from rlbus.runs import (
    RunDirError,
    prepare_run_dir_or_exit,
    resolve_run_dir,
    rl_run_name,
    run_id_of,
)
from rlbus.runtime import EXIT_SERVICE_MISSING, EXIT_SIGNAL_BASE, Terminated, raise_terminated

log = structlog.get_logger()

FINISHING_SERVICES = frozenset({"trainer", "orchestrator"})
"""Services that exit 0 when max_steps is reached; the run is over when the trainer has."""

LATEST_LINK = "latest"


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
    try:  # before the run-directory rules: --clean must never wipe a directory in use
        refuse_if_live(resolve_run_dir(config.output_dir, config.run.name, config.run.dir))
    except RunDirError as error:
        exit_with_config_error(str(error), title="Run directory")
    run = prepare_run_dir_or_exit(config, name_given=name_given)
    setup_logging(
        "rl",
        run_dir=run.run_dir,
        run_id=config.bus.run_id,
        level=config.log.level,
        json_console=config.log.json_console,
    )
    if run.resuming and not run.save_checkpoints:
        log.warning(
            "resume_without_ckpt",
            hint="the run loads its checkpoint but saves no new ones: add [ckpt]",
        )
    launch = build_rl_launch(config, run.run_dir)
    launch.config_files, launch.script_files = write_launch(
        run.run_dir, launch.configs, launch.processes, command, launch.files
    )
    return launch


EXIT_INTERRUPTED = EXIT_SIGNAL_BASE + signal.SIGINT
EXIT_TERMINATED = EXIT_SIGNAL_BASE + signal.SIGTERM
DRAINED_SERVICES = ("orchestrator", "trainer")
"""Services that answer a control `Drain` (finish the step in hand, then exit), in drain order."""
STOPPED_AFTER_FAILURE = frozenset({"orchestrator"})
"""After a failure these get `Stop`, not `Drain`: their in-flight rollouts may never come back."""


def drain_over_bus(
    launch: Launch, services: list[str], *, failed: bool = False, timeout_s: float = 5.0
) -> dict[str, str]:
    """Ask each service to drain (or, after a failure, the orchestrator to stop) over the bus;
    returns service -> outcome.

    Best effort: a service that is gone or does not answer gets the signals of `stop_all` anyway.
    """
    import asyncio

    from rlbus.bus import Bus
    from rlbus.wire import control

    bus_config = launch.configs["trainer"].bus  # the resolved one (embedded server URL)
    run_id = run_id_of(bus_config.run_id, launch.config.run.name)

    async def drain_all() -> dict[str, str]:
        outcomes: dict[str, str] = {}
        try:
            bus = await asyncio.wait_for(
                Bus.connect(bus_config, run_id=run_id, name="rl-launcher", ensure=False), timeout_s
            )
        except Exception as error:
            return {name: f"no bus ({type(error).__name__})" for name in services}
        try:
            for name in services:
                try:
                    stop = failed and name in STOPPED_AFTER_FAILURE
                    request = (control.Stop if stop else control.Drain)(reason="launcher")
                    reply = await bus.request(name, request, timeout_s=timeout_s)
                    outcomes[name] = reply.state or (
                        "ok" if reply.ok else reply.message or "refused"
                    )
                except Exception as error:
                    outcomes[name] = f"no answer ({type(error).__name__})"
        finally:
            await bus.close()
        return outcomes

    return asyncio.run(drain_all())


def drain_and_wait(
    launch: Launch, supervisor: Supervisor, skip: str | None = None, wait_s: float = 30.0
) -> None:
    """Drain the running orchestrator/trainer over the bus and give them `wait_s` to exit by
    themselves (the trainer finishes its step); `stop_all` then signals whatever is left.
    `skip` is the service that failed, if any (the orchestrator is then stopped, not drained)."""
    running = [
        s.name
        for s in supervisor.services
        if s.name in DRAINED_SERVICES and s.name != skip and s.poll() is None
    ]
    embedded_nats_gone = launch.config.bus.url is None and not any(
        s.name == "nats" and s.poll() is None for s in supervisor.services
    )
    if not running or embedded_nats_gone:
        return
    outcomes = drain_over_bus(launch, running, failed=skip is not None)
    log.info("drain_requested", **outcomes)
    deadline = time.monotonic() + wait_s
    waiting = [s for s in supervisor.services if s.name in running]
    while time.monotonic() < deadline and any(s.poll() is None for s in waiting):
        time.sleep(0.2)


def wait_for_last_row(progress: Progress, max_steps: int | None, timeout_s: float = 20.0) -> None:
    """After the trainer finished: give the monitor time to write the last step's row."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        progress.update()
        if max_steps is None or max_steps in progress.printed:
            return
        time.sleep(0.25)


EXIT_HANGUP = EXIT_SIGNAL_BASE + signal.SIGHUP
NEVER_RESTARTED = frozenset({EXIT_CONFIG_ERROR, EXIT_SERVICE_MISSING})
"""A config error or a missing package fails the same way every time: the run stops instead."""


class Hangup(Terminated):
    """SIGHUP: the terminal (or ssh session) is gone; stop now, without the drain."""


def raise_hangup(signum, frame) -> None:
    raise Hangup()


class SecondInterrupt(Exception):
    """A second Ctrl-C while draining or stopping: stop now."""


def start_watchdog(launch_id: str, run_dir: Path) -> tuple[subprocess.Popen, int]:
    """The watchdog (rlbus.launch.watchdog) in its own session, and the write end of its pipe."""
    read_end, write_end = os.pipe()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLBUS_LAUNCH_")}
    watchdog = subprocess.Popen(
        [sys.executable, "-m", "rlbus.launch.watchdog", launch_id, str(run_dir)],
        stdin=read_end,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    os.close(read_end)
    return watchdog, write_end


def stop_watchdog(watchdog: subprocess.Popen, write_end: int) -> None:
    """Tell the watchdog the launcher ends cleanly (nothing for it to do)."""
    try:
        os.write(write_end, b"done")
        os.close(write_end)
        watchdog.wait(10)
    except (OSError, subprocess.TimeoutExpired):
        watchdog.kill()


class Healer:
    """Restarts services that die, within each one's budget (`[supervision]`)."""

    def __init__(self, launch: Launch, supervisor: Supervisor, progress: Progress):
        self.config = launch.config.supervision
        self.supervisor = supervisor
        self.progress = progress
        self.policies: dict[str, RestartPolicy] = {}

    def policy(self, name: str) -> RestartPolicy:
        if name not in self.policies:
            c = self.config
            self.policies[name] = RestartPolicy(
                c.max_restarts, c.window_s, c.backoff_s, c.max_backoff_s
            )
        return self.policies[name]

    def on_death(self, service: ServiceProcess, code: int) -> bool:
        """A service died with `code`: schedule its restart (True) or give up (False)."""
        why = describe_exit(code)
        log.warning("service_died", service=service.name, pid=service.pid, exit_code=code, why=why)
        if not self.config.enabled:
            return False
        if code in NEVER_RESTARTED:
            self.progress.emit(
                f"{service.name} died ({why}): a config or install error is not restarted"
            )
            return False
        policy = self.policy(service.name)
        delay = policy.next_delay(time.monotonic())
        if delay is None:
            log.error(
                "restart_budget_spent",
                service=service.name,
                max_restarts=self.config.max_restarts,
                window_s=self.config.window_s,
            )
            self.progress.emit(
                f"{service.name} died ({why}) after {policy.used} restarts in "
                f"{self.config.window_s:.0f} s (supervision.max_restarts = "
                f"{self.config.max_restarts}); giving up; see {service.log_path}"
            )
            return False
        service.end_leftovers()
        service.restart_at = time.monotonic() + delay
        log.info("service_restart_scheduled", service=service.name, in_s=delay, restart=policy.used)
        self.progress.emit(
            f"{service.name} died ({why}); restarting in {delay:.0f} s (restart {policy.used} of "
            f"{self.config.max_restarts} in {self.config.window_s:.0f} s)"
        )
        return True

    def restart_due(self) -> None:
        now = time.monotonic()
        for service in self.supervisor.services:
            if service.restart_at is not None and now >= service.restart_at:
                service.start()
                log.info("service_restarted", service=service.name, pid=service.pid)
                self.progress.emit(f"{service.name} is back (pid {service.pid})")


def supervise(launch: Launch, poll_s: float = 0.5) -> int:
    """Start every process in order, show progress, heal; returns the launcher's exit code:
    0 when the trainer finished; the code of a service that could not be healed (128 + N when
    signal N killed it); 130 on Ctrl-C, 143 on SIGTERM, 129 on SIGHUP. Every path drains (but
    SIGHUP and a second Ctrl-C), then stops all and checks that no process of the run survives."""
    supervisor = Supervisor()
    names = [p.name for p in launch.processes]
    metrics = launch.run_dir / "metrics.jsonl"
    progress = Progress(metrics, tty=sys.stdout.isatty(), services=names)
    healer = Healer(launch, supervisor, progress)
    launch_id = uuid.uuid4().hex
    write_lock(launch.run_dir, launch_id)
    watchdog, watchdog_pipe = start_watchdog(launch_id, launch.run_dir)
    previous_term = signal.signal(signal.SIGTERM, raise_terminated)
    previous_hup = signal.signal(signal.SIGHUP, raise_hangup)
    code = 1
    hurry = False
    try:
        for process in launch.processes:
            process.launch_id = launch_id
            supervisor.start(process)
        while True:
            progress.update()
            healer.restart_due()
            for service in supervisor.services:
                exit_code = service.poll() if service.restart_at is None else None
                if exit_code is None:
                    continue
                if service.name == "trainer" and exit_code == 0:
                    wait_for_last_row(progress, launch.config.max_steps)
                    log.info("run_finished", run_dir=str(launch.run_dir))
                    code = 0
                    return code
                if exit_code == 0 and service.name in FINISHING_SERVICES:
                    continue  # the orchestrator published its last batch
                if not healer.on_death(service, exit_code):
                    code = launcher_exit_code(exit_code)
                    report_failure(service, exit_code)
                    drain_and_wait(launch, supervisor, skip=service.name)
                    return code
            time.sleep(poll_s)
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
        log.warning("interrupted", signal="SIGINT", hint="draining; Ctrl-C again to stop now")
        hurry = not drain_interruptibly(launch, supervisor)
        return code
    except Hangup:
        code = EXIT_HANGUP
        log.warning("interrupted", signal="SIGHUP", hint="stopping every service now (no drain)")
        hurry = True
        return code
    except Terminated:
        code = EXIT_TERMINATED
        log.warning("interrupted", signal="SIGTERM", hint="draining, then stopping every service")
        drain_and_wait(launch, supervisor)
        return code
    finally:
        # Stopping must not be cut short into orphans: a second Ctrl-C only makes it faster
        # (SIGKILL now), SIGTERM/SIGHUP are ignored until every process is gone.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        try:
            stop_everything(supervisor, hurry)
            progress.close()
        finally:
            remove_lock(launch.run_dir, launch_id)
            stop_watchdog(watchdog, watchdog_pipe)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, previous_term)
            signal.signal(signal.SIGHUP, previous_hup)
        log.info("launcher_exit", exit_code=code, run_dir=str(launch.run_dir))


def drain_interruptibly(launch: Launch, supervisor: Supervisor) -> bool:
    """Drain after a first Ctrl-C; False when a second Ctrl-C cut it short (stop now)."""
    try:
        drain_and_wait(launch, supervisor)
        return True
    except KeyboardInterrupt:
        log.warning("second_interrupt", hint="stopping every service now")
        return False


def stop_everything(supervisor: Supervisor, hurry: bool) -> None:
    """`stop_all` (SIGTERM, wait, SIGKILL), or `kill_all` at once when hurried; a Ctrl-C during
    `stop_all` switches to `kill_all`."""
    if not hurry:
        try:
            supervisor.stop_all()
            return
        except KeyboardInterrupt:
            log.warning("second_interrupt", hint="killing every service now")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    supervisor.kill_all()


def report_failure(service, code: int) -> None:
    """Say which service died and show the end of its log."""
    log.error("service_failed", service=service.name, exit_code=code, log=str(service.log_path))
    sys.stderr.write(
        f"\n{service.name} ended ({describe_exit(code)}); the other services are being stopped.\n"
        f"--- last lines of {service.log_path} ---\n{service.tail()}\n--- end of {service.name} log ---\n"
    )
    sys.stderr.flush()


def point_latest(run_dir: Path) -> None:
    """`<output_dir>/latest` -> this run's directory (relative symlink), so that
    `outputs/latest/logs/trainer.log` always shows the newest launch. Never replaces a real file."""
    link = run_dir.parent / LATEST_LINK
    if link.exists() and not link.is_symlink():
        log.warning(
            "latest_link_skipped", path=str(link), reason="a real file or directory has that name"
        )
        return
    tmp = run_dir.parent / f".{LATEST_LINK}.{os.getpid()}"
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(run_dir.name)
        os.replace(tmp, link)
    except OSError as error:
        log.warning("latest_link_failed", path=str(link), error=str(error))


def main(argv: list[str] | None = None) -> None:
    config = parse_cli(RLConfig, argv, prog="rl")
    check_sinks_installed(config.monitors)
    launch = plan_rl(config, command="rl " + " ".join(sys.argv[1:] if argv is None else argv))
    if config.dry_run:
        print(describe_written(launch.run_dir, launch.config_files, launch.script_files))
        return
    point_latest(launch.run_dir)  # only runs that start move it (a dry run starts nothing)
    sys.exit(supervise(launch))


if __name__ == "__main__":
    main()
