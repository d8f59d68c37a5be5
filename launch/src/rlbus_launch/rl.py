"""`rl`: one RL run = embedded NATS + inference + orchestrator + trainer, as subprocesses.

    rl @ examples/reverse-text/rl.toml [--flags]
      1. parse RLConfig (defaults < @ files < flags), name the run (`<envs>--<model>--<id>`);
         `--inference.attach [URL]` uses a running `inference` instead of starting vLLM
      2. apply the run-directory rules (rlbus.rundirs): fresh, --resume or --clean
      3. plan the processes (rlbus_launch.plan) and write configs/ and scripts/ into the run dir
      4. --dry-run: print where they are and stop; otherwise start them (rlbus_launch.supervisor)
         under a watchdog (rlbus_launch.watchdog) and the run-directory lock (rlbus_launch.lock),
         restart the ones that die (rlbus_launch.restarts), and stop all when the trainer
         finished, a restart budget is spent, or on Ctrl-C / SIGTERM / SIGHUP.

The launcher never imports a service package; it starts them by module name.
"""

import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import structlog

from rlbus.configs import RLConfig
from rlbus.configs.base import exit_with_config_error, parse_cli
from rlbus.configs.inference import attach_url_flags
from rlbus.configs.paths import exit_if_paths_missing
from rlbus.lifecycle import (
    DRAIN_BUDGET_S,
    EXIT_SIGNAL_BASE,
    Terminated,
    config_inputs,
    errors_in_one_line,
    raise_terminated,
)
from rlbus.obs.logging import setup_logging
from rlbus.obs.sinks import check_sinks_installed
from rlbus.rundirs import EVALS_FILE, RunPlan, resolve_run_dir, rl_run_name, run_id_of
from rlbus.samples import read_records
from rlbus.secrets import SecretError
from rlbus_launch.lock import refusal, remove_lock, write_lock
from rlbus_launch.metrics import count_restart
from rlbus_launch.plan import Launch, build_rl_launch
from rlbus_launch.progress import Progress
from rlbus_launch.restarts import (
    GiveUp,
    Restart,
    RestartPolicy,
    describe_exit,
    launcher_exit_code,
    rank_exit_code,
)
from rlbus_launch.rundir import prepare_run_dir_or_exit
from rlbus_launch.scrape import ScrapeTargets
from rlbus_launch.scripts import describe_written, write_launch
from rlbus_launch.summary import outcome_of, run_summary
from rlbus_launch.supervisor import ServiceProcess, Supervisor
from rlbus_launch.watchdog import Watchdog, start_watchdog

log = structlog.get_logger()

FINISHING_SERVICES = frozenset({"trainer", "orchestrator"})
"""Services that exit 0 when max_steps is reached; the run is over when the trainer has."""

LATEST_LINK = "latest"


def name_run(config: RLConfig) -> tuple[RLConfig, bool]:
    """(config with run.name set, whether the user gave the name)."""
    given = config.run.name is not None
    name = config.run.name or rl_run_name(config.env_ids(), config.model.name)
    return config.with_run_name(name), given


def refuse_if_in_use(run_dir: Path) -> None:
    """Exit 2 naming the live processes when another launch still runs in `run_dir` (its
    `launcher.json`, rlbus_launch.lock), before anything touches the directory."""
    message = refusal(run_dir)
    if message is not None:
        exit_with_config_error(message, title="Run directory in use")


def prepare_rl(config: RLConfig) -> tuple[RLConfig, RunPlan]:
    """Steps 1-2: the named config and its prepared run directory (logging into it)."""
    config, name_given = name_run(config)
    refuse_if_in_use(resolve_run_dir(config.output_dir, config.run.name, config.run.dir))
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
    return config, run


def plan_rl(config: RLConfig, command: str = "rl") -> Launch:
    """Steps 1-3 for an already parsed config: returns the written launch."""
    config, run = prepare_rl(config)
    try:
        launch = build_rl_launch(config, run.run_dir)
    except SecretError as error:  # a token/password file that is missing or readable by others
        exit_with_config_error(str(error))
    launch.config_files, launch.script_files = write_launch(
        run.run_dir, launch.configs, launch.processes, command, launch.files, launch.secret_files
    )
    return launch


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


DRAIN_WAIT_S = DRAIN_BUDGET_S + 5.0
"""How long a drained service may take to exit by itself: its own budget plus the margin of a
loaded machine."""


def drain_and_wait(
    launch: Launch, supervisor: Supervisor, skip: str | None = None, wait_s: float = DRAIN_WAIT_S
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


FINAL_EVAL_MARGIN_S = 60.0
"""Besides the evaluation's own `eval.timeout_s` (twice: waiting for the last weights, then for
the rollouts), how long the launcher waits for the orchestrator to end after the trainer."""


def wait_for_final_eval(launch: Launch, supervisor: Supervisor, progress: Progress) -> None:
    """After the trainer finished: when the run evaluates its last step, let the orchestrator
    finish that evaluation and end by itself (it exits once the results are out), then give
    the monitor time to write their rows to evals.jsonl."""
    config = launch.config
    eval_config = config.orchestrator.eval
    if eval_config is None or not eval_config.eval_last_step or config.max_steps is None:
        return
    orchestrator = next((p for p in supervisor.services if p.name == "orchestrator"), None)
    if orchestrator is None:
        return
    progress.note(f"evaluating step {config.max_steps}")
    deadline = time.monotonic() + 2 * eval_config.timeout_s + FINAL_EVAL_MARGIN_S
    while orchestrator.poll() is None and time.monotonic() < deadline:
        progress.update()
        time.sleep(0.25)
    labels = {e.label for e in eval_config.envs(config.orchestrator.env)}
    path = launch.run_dir / EVALS_FILE
    row_deadline = time.monotonic() + 20.0
    while time.monotonic() < row_deadline:
        written = {r.get("env") for r in read_records(path) if r.get("step") == config.max_steps}
        if labels <= written:
            return
        time.sleep(0.25)
    log.warning("final_eval_rows_missing", step=config.max_steps, path=str(path))


EXIT_HANGUP = EXIT_SIGNAL_BASE + signal.SIGHUP
HANGUP_GRACE_S = 3.0
"""After SIGHUP: SIGTERM every process, SIGKILL what is left this much later (no drain)."""


class StopNow(Exception):
    """Stop every process now, without a drain: a second Ctrl-C/SIGTERM, or a SIGHUP."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_stop_now(signum: int, frame: FrameType | None) -> None:
    raise StopNow(signum)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def arm_stop_now() -> None:
    """From now on (a drain or a stop is under way) any further Ctrl-C, SIGTERM or SIGHUP kills
    every process at once instead of being ignored: the stop can be cut short, never into
    orphans (`Supervisor.stop_now` kills every group and every marked process)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, raise_stop_now)


def watch(
    launch: Launch,
    supervisor: Supervisor,
    progress: Progress,
    policy: RestartPolicy,
    poll_s: float = 0.5,
) -> int:
    """Show progress and heal: a service that exits unexpectedly is restarted alone, with its
    argv, after the policy's backoff (its leftovers ended first). Returns 0 when the trainer
    finished, or the exit code of the run when a service cannot be (or may no longer be)
    restarted, after draining the others."""
    pending: dict[str, tuple[ServiceProcess, float]] = {}
    while True:
        progress.update()
        trainer = next((p for p in supervisor.services if p.name == "trainer"), None)
        if trainer is not None and "trainer" not in pending and trainer.poll() == 0:
            wait_for_last_row(progress, launch.config.max_steps)
            wait_for_final_eval(launch, supervisor, progress)
            log.info("run_finished", run_dir=str(launch.run_dir))
            return 0
        for service in supervisor.services:
            code = service.poll()
            if service.name in pending or code is None:
                continue
            if code == 0 and service.name in FINISHING_SERVICES:
                continue
            code = rank_exit_code(code, service.argv, service.tail(80))
            decision = policy.decide(service.name, code, time.monotonic())
            if isinstance(decision, GiveUp):
                report_failure(service, code, decision.reason, progress)
                drain_and_wait(launch, supervisor, skip=service.name)
                return launcher_exit_code(code)
            schedule_restart(service, code, decision, policy, progress)
            pending[service.name] = (service, time.monotonic() + decision.delay_s)
        for name, (service, due) in list(pending.items()):
            if time.monotonic() >= due:
                del pending[name]
                service.start()
                log.info("service_restarted", service=name, pid=service.pid)
                count_restart(name)  # Prometheus (rlbus.obs.metrics)
                progress.note(f"{name} is back (pid {service.pid})")
        time.sleep(poll_s)


def exit_fields(code: int) -> dict[str, object]:
    """`exit_code=N`, or `signal=SIGNAME` for a process killed by a signal (Popen's -N)."""
    if code < 0:
        return {"signal": describe_exit(code).removeprefix("killed by ")}
    return {"exit_code": code}


def schedule_restart(
    service: ServiceProcess, code: int, restart: Restart, policy: RestartPolicy, progress: Progress
) -> None:
    """Log and show the death, and end what the dead service left behind (the restart comes
    after the backoff, from `watch`)."""
    log.warning(
        "service_died",
        service=service.name,
        pid=service.pid,
        **exit_fields(code),
        restart=restart.number,
        of=restart.budget,
        in_s=restart.delay_s,
        log=str(service.log_path),
    )
    service.end_leftovers()
    progress.note(
        f"{service.name} died ({describe_exit(code)}); restarting in {restart.delay_s:g} s "
        f"(restart {restart.number} of {restart.budget} in {policy.config.window_s:g} s)"
    )


@dataclass
class SupervisedLaunch:
    """One supervised launch: its processes, progress, restart policy and /metrics targets, and
    where it stands: the exit code so far, whether it is still watching (a SIGHUP then is the
    first signal: 129; later it only cuts a stop short), which signal stopped it, if any, and
    whether every process was stopped."""

    launch: Launch
    launch_id: str
    supervisor: Supervisor
    progress: Progress
    policy: RestartPolicy
    targets: ScrapeTargets
    code: int = 1
    watching: bool = True
    stopped_by: str | None = None
    stopped: bool = False

    def start_and_watch(self, poll_s: float) -> None:
        """Start every process in order and watch them (`watch`) until the run ends; Ctrl-C or
        SIGTERM drain instead (130, 143)."""
        try:
            for process in self.launch.processes:
                process.launch_id = self.launch_id
                self.supervisor.start(process)
                self.targets.started(process.name)
            self.code = watch(self.launch, self.supervisor, self.progress, self.policy, poll_s)
            self.watching = False
        except (KeyboardInterrupt, Terminated) as interrupt:
            sig = signal.SIGINT if isinstance(interrupt, KeyboardInterrupt) else signal.SIGTERM
            self.code = EXIT_SIGNAL_BASE + sig
            self.watching = False
            self.stopped_by = "Ctrl-C" if sig == signal.SIGINT else sig.name
            log.warning(
                "interrupted",
                signal=sig.name,
                hint="draining, then stopping every service (Ctrl-C again: stop now)",
            )
            arm_stop_now()
            drain_and_wait(self.launch, self.supervisor)

    def run(self, poll_s: float) -> None:
        """Start, watch, then stop every process; a further signal (`StopNow`) stops them at
        once (a first SIGHUP with a grace and exit code 129)."""
        try:
            self.start_and_watch(poll_s)
            arm_stop_now()
            self.supervisor.stop_all()
        except StopNow as stop:
            first = stop.signum == signal.SIGHUP and self.watching
            if first:
                self.code = EXIT_HANGUP
                self.stopped_by = "SIGHUP"
            ignore_stop_signals()
            log.warning(
                "stopping_now", signal=signal.Signals(stop.signum).name, exit_code=self.code
            )
            self.supervisor.stop_now(grace_s=HANGUP_GRACE_S if first else 0.0)
        self.stopped = True

    def close(self, watchdog: Watchdog) -> None:
        """Stop serving /metrics and progress (the live panel ends here, after the last log line
        of the stop); once every process is stopped, drop the lock and dismiss the watchdog
        (otherwise it sees its pipe close when we exit, and ends what is left)."""
        self.targets.close()
        try:
            self.progress.close()
        except OSError:  # the terminal is gone (SIGHUP)
            pass
        if self.stopped:
            remove_lock(self.launch.run_dir, self.launch_id)
            watchdog.done()

    def print_summary(self, wall_s: float) -> None:
        """What the run left behind (rlbus_launch.summary), on stdout, terminal or not: once,
        after the panel is gone."""
        outcome = outcome_of(self.code, self.stopped_by)
        config = self.launch.config
        text = run_summary(
            self.launch.run_dir, outcome=outcome, wall_s=wall_s, max_steps=config.max_steps
        )
        try:
            print(f"\n{text}", flush=True)
        except OSError:  # the terminal is gone (SIGHUP)
            pass


SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None
"""What `signal.getsignal` returns."""


def take_stop_signals() -> dict[signal.Signals, SignalHandler]:
    """Route Ctrl-C, SIGTERM and SIGHUP to the launcher's stop paths; returns the previous
    handlers. Ctrl-C / SIGINT drains even when rl was started as a shell's background job (which
    inherits SIGINT ignored, so Python would never raise KeyboardInterrupt): `kill -INT` always
    works."""
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, raise_terminated)
    signal.signal(signal.SIGHUP, raise_stop_now)
    return previous


def ignore_stop_signals() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def supervise(launch: Launch, poll_s: float = 0.5) -> int:
    """Start every process in order, show progress and restart what dies (`watch`); returns the
    launcher's exit code: 0 when the trainer finished; a failed service's code (128 + N when it
    was killed by signal N) when it may not be restarted; 130 on Ctrl-C, 143 on SIGTERM (both
    drain first), 129 on SIGHUP (no drain). Every path stops all and checks that no process of
    the launch survives; the watchdog (`rlbus_launch.watchdog`) covers the launcher's own death."""
    started = time.monotonic()
    launch_id = uuid.uuid4().hex
    names = [p.name for p in launch.processes]
    progress = Progress(
        launch.run_dir / "metrics.jsonl",
        # --log.json-console asks for machine-read console output: plain lines, no panel
        tty=sys.stdout.isatty() and not launch.config.log.json_console,
        services=names,
        max_steps=launch.config.max_steps,
    )
    policy = RestartPolicy(launch.config.supervision)
    previous = take_stop_signals()
    watchdog = start_watchdog(launch_id, launch.run_dir)
    write_lock(launch.run_dir, launch_id)
    log.info("launch_started", launch_id=launch_id, watchdog_pid=watchdog.popen.pid)
    targets = ScrapeTargets.for_launch(launch)  # our /metrics, and <run_dir>/metrics/targets.json
    session = SupervisedLaunch(launch, launch_id, Supervisor(), progress, policy, targets)
    try:
        session.run(poll_s)
    finally:
        ignore_stop_signals()
        session.close(watchdog)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        log.info("launcher_exit", exit_code=session.code, run_dir=str(launch.run_dir))
        session.print_summary(time.monotonic() - started)
    return session.code


def report_failure(service: ServiceProcess, code: int, reason: str, progress: Progress) -> None:
    """Say which service ended the run and why, and show the end of its log."""
    log.error(
        "service_failed",
        service=service.name,
        **exit_fields(code),
        reason=reason,
        log=str(service.log_path),
    )
    progress.note(f"{reason}; see {service.log_path}")
    sys.stderr.write(
        f"\n{service.name} {describe_exit(code)}; the other services are being stopped.\n"
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


SUBCOMMANDS = {
    "compose-gpus": "rlbus_launch.composegpus",
    "dead-letters": "rlbus_launch.deadletters",
    "env": "rlbus_launch.envinstall",
    "eval": "rlbus_launch.evalcmd",
    "export": "rlbus_launch.exportcmd",
    "migrate-config": "rlbus_launch.migrate_config",
    "rollouts": "rlbus_launch.rollouts",
}
"""`rl <subcommand> ...`: tools about a run, each a module with `main(argv) -> exit code`."""


def check_attach_ports(config: RLConfig) -> None:
    """Several attached servers are found by port (replica i at the attach ports + i): the
    URLs must name their ports."""
    attach = config.inference.attach
    if attach is None or config.deployment.num_infer_replicas == 1:
        return
    try:
        attach.shifted(config.deployment.num_infer_replicas - 1)
    except ValueError as error:
        exit_with_config_error(f"--inference.attach with deployment.num_infer_replicas: {error}")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in SUBCOMMANDS:
        import importlib

        sys.exit(importlib.import_module(SUBCOMMANDS[args[0]]).main(args[1:]))
    config = parse_cli(RLConfig, attach_url_flags(args, "--inference.attach"), prog="rl")
    check_attach_ports(config)
    # A dry run or a SLURM job only plans here: relative paths may be built before they run.
    exit_if_paths_missing(config, strict=not config.dry_run and config.slurm is None)
    check_sinks_installed(config.monitors)
    command = "rl " + " ".join(sys.argv[1:] if argv is None else argv)
    with errors_in_one_line("rl", inputs=config_inputs(config)):
        if config.slurm is not None:  # render and submit a batch job instead (rlbus_launch.slurm)
            from rlbus_launch.slurm import submit_rl

            config, run = prepare_rl(config)
            sys.exit(submit_rl(config, run.run_dir, command))
        launch = plan_rl(config, command=command)
    if config.dry_run:
        print(describe_written(launch.run_dir, launch.config_files, launch.script_files))
        return
    point_latest(launch.run_dir)  # only runs that start move it (a dry run starts nothing)
    with errors_in_one_line("rl", inputs=config_inputs(config)):
        code = supervise(launch)
    sys.exit(code)


if __name__ == "__main__":
    main()
