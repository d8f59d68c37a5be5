"""The service shell: what every rlbus service process does the same way (docs/launcher.md).

    main(service, config, module, ...)      entry point of inference, orchestrator, trainer, sft
      1. structlog + OpenTelemetry, once, from the config's `log` and `otel` blocks
      2. import `module.run` lazily (a missing service: one message, exit 3)
      3. run(config) -> run_service(body): asyncio loop, signals, supervised tasks
      4. an error that escapes: one `service_error` line and its exit code (`exit_code_for`:
         4 a missing input, 5 the bus unreachable, 1 anything else); `--debug` keeps the traceback

Signals: the first SIGTERM/SIGINT asks the service to drain (finish the work in hand, then exit 0);
a second one exits at once with 128 + the signal number (130 for SIGINT, 143 for SIGTERM).
Control requests (`rlbus.wire.control`) reach the same `ServiceState`: `Drain` like a signal,
`Stop` to stop without waiting, `Pause`/`Resume` where the service supports them.

Background asyncio tasks are started through a `TaskSupervisor`: the first task that raises ends
its owner with `TaskFailed`, and `run_service` turns that into one `service_task_failed` log line
naming the task and the error, then exit code 1. Nothing fails silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import signal
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Literal

import structlog

log = structlog.get_logger()

EXIT_TASK_FAILED = 1
"""A supervised background task raised (the log line `service_task_failed` names it)."""
EXIT_SERVICE_MISSING = 3
"""The command parsed its config but its service module (or its `run`) is not installed."""
EXIT_INPUT_MISSING = 4
"""A file or resource the run needs is missing or unusable once it runs (an OSError): a model
that is neither a local directory nor in the hub cache, data, a run directory that cannot be
written, a full disk."""
EXIT_BUS_UNREACHABLE = 5
"""No NATS server answered within bus.connect_retry_s, or the server refused the credentials."""
EXIT_SIGNAL_BASE = 128
"""A second SIGTERM/SIGINT exits at once with 128 + the signal number (143 / 130)."""

Mode = Literal["running", "paused", "draining", "stopping"]


# ---- process facts -------------------------------------------------------------------------


def process_rank() -> int:
    """Global rank under torchrun, 0 otherwise."""
    return int(os.environ.get("RANK", "0"))


# ---- entry point ---------------------------------------------------------------------------


def setup_observability(
    service: str,
    config: Any,
    *,
    run_dir: str | Path | None,
    run_id: str | None,
    rank: int | None = None,
) -> None:
    """structlog and tracing from `config.log` / `config.otel`, once per process. Only rank 0 of
    a torchrun job traces: the other ranks would write the same spans again."""
    # Deferred: the OpenTelemetry SDK, exporters and prometheus_client load only in a process
    # that runs a service, never for an entry point's `--help` or a config error.
    from rlbus.obs import tracing
    from rlbus.obs.logging import setup_logging
    from rlbus.obs.metrics import serve_metrics

    setup_logging(
        service,
        run_dir=run_dir,
        run_id=run_id,
        level=config.log.level,
        json_console=config.log.json_console,
        rank=rank,
    )
    tracing.setup_tracing(
        service,
        run_dir=run_dir,
        endpoint=config.otel.endpoint,
        protocol=config.otel.protocol,
        enabled=config.otel.enabled and not rank,
        run_id=run_id,
    )
    serve_metrics(service, config.metrics, rank=rank)  # Prometheus /metrics (rank 0 only)


def load_service_run(module: str, command: str) -> Callable[[Any], Any]:
    """`module.run`, imported now; exits with a clear message if the service is not there."""
    from rlbus.configs.base import exit_with_config_error

    try:
        service = importlib.import_module(module)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if missing != module and not module.startswith(missing + "."):
            raise  # a dependency of the service is missing: a real error, keep its traceback
        service = None
    run = getattr(service, "run", None)
    if run is None:
        exit_with_config_error(
            f"`{command}` parsed its config, but {module}.run does not exist in this installation. "
            "Update rlbus (or install the service package) and try again.",
            title="Service not available",
            code=EXIT_SERVICE_MISSING,
        )
    return run


def main(
    service: str,
    config: Any,
    module: str,
    *,
    command: str,
    run_dir: str | Path | None,
    run_id: str | None,
    rank: int | None = None,
) -> Any:
    """The body of every service entry point (see module docstring); returns what `run` returns."""
    from rlbus.obs import tracing  # deferred: see setup_observability

    with errors_in_one_line(command, inputs=config_inputs(config)):
        setup_observability(service, config, run_dir=run_dir, run_id=run_id, rank=rank)
    run = load_service_run(module, command=command)
    try:
        with errors_in_one_line(command, logged=True, inputs=config_inputs(config)):
            return run(config)
    finally:
        tracing.shutdown_tracing()


# ---- errors that reach the top --------------------------------------------------------------


def exit_code_for(error: BaseException) -> int:
    """The documented exit code of an error that ended a command (docs/launcher.md)."""
    from rlbus.bus.errors import BusAuthError, BusConnectError

    if isinstance(error, (BusConnectError, BusAuthError)):
        return EXIT_BUS_UNREACHABLE
    if isinstance(error, OSError):
        return EXIT_INPUT_MISSING
    return EXIT_TASK_FAILED


INPUT_FLAGS = {
    "--model.name": ("model", "name"),
    "--vllm.model": ("vllm", "model"),
    "--data.path": ("data", "path"),
    "--output-dir": ("output_dir",),
    "--run-dir": ("run_dir",),
}
"""The inputs a missing-input error (exit 4) points at, where the config has them: an OSError
from transformers or the hub rarely names the model it was loading."""


def config_inputs(config: Any) -> str:
    """`--model.name m, --output-dir outputs` for the INPUT_FLAGS that `config` has."""
    found = []
    for flag, path in INPUT_FLAGS.items():
        value: Any = config
        for part in path:
            value = getattr(value, part, None)
        if value is not None:
            found.append(f"{flag} {value}")
    return ", ".join(found)


def describe_error(error: BaseException) -> str:
    """`Type: message` on one line (messages of OSError and hub errors span several)."""
    return " ".join(f"{type(error).__name__}: {error}".split())


@contextlib.contextmanager
def errors_in_one_line(command: str, *, logged: bool = False, inputs: str = "") -> Iterator[None]:
    """An exception leaving the block ends `command` with one line and `exit_code_for` it,
    instead of a traceback; with `--debug` (RLBUS_DEBUG=1) it propagates as it is. `logged`:
    the line is a `service_error` log event (into the service's log file too), else plain
    stderr (before logging is set up). `inputs` (`config_inputs`) are named for a missing input."""
    from rlbus.configs.base import debug_enabled

    try:
        yield
    except Terminated:
        raise  # SIGTERM, not an error: the launchers turn it into 143
    except Exception as error:
        if debug_enabled():
            raise
        code = exit_code_for(error)
        hint = "--debug for the traceback"
        if code == EXIT_INPUT_MISSING and inputs:
            hint = f"check {inputs}; {hint}"
        if logged:
            log.error(
                "service_error",
                error=describe_error(error),
                where=where(error),
                exit_code=code,
                hint=hint,
            )
        else:
            sys.stderr.write(f"{command}: {describe_error(error)} (exit {code}; {hint})\n")
        raise SystemExit(code) from None


# ---- what the service was asked to do ------------------------------------------------------

DRAIN_BUDGET_S = 25.0
"""A service asked to drain has exited within this many seconds: every wait of its shutdown (the
work in flight, the handlers of each consumer) takes its deadline from this one budget
(`ServiceState.left_of`). Launchers give a drain more before they signal (`rl`: DRAIN_WAIT_S,
SLURM: `slurm.grace_s`)."""


class ServiceState:
    """Run, pause, drain or stop: set by signals and control requests, read by the service.

    `draining` and `stopping` both end the service; `stopping` means do not wait for in-flight
    work (it is redelivered elsewhere), but still never leave a half-written artifact.
    """

    def __init__(self, service: str) -> None:
        self.service = service
        self.mode: Mode = "running"
        self.reason: str | None = None
        self.stop_requested = asyncio.Event()
        """Set on drain or stop."""
        self.unpaused = asyncio.Event()
        """Cleared while paused."""
        self.unpaused.set()
        self.listeners: list[Callable[[], None]] = []
        """Called once when a drain or stop is first requested (e.g. to wake threads)."""
        self.ending_since: float | None = None
        """`time.monotonic()` when the first drain or stop was requested."""

    @property
    def ending(self) -> bool:
        return self.mode in ("draining", "stopping")

    @property
    def stop_now(self) -> bool:
        return self.mode == "stopping"

    def left_of(self, budget_s: float) -> float:
        """Seconds left of a `budget_s` that started with the drain or stop request (all of it
        while running): every wait of a shutdown takes its deadline from one budget, so the
        waits together stay inside the grace the launcher gives before it signals again."""
        if self.ending_since is None:
            return budget_s
        return max(0.0, self.ending_since + budget_s - time.monotonic())

    def drain(self, reason: str) -> None:
        if not self.ending:
            self._end("draining", reason)

    def stop(self, reason: str) -> None:
        if self.mode != "stopping":
            self._end("stopping", reason)

    def _end(self, mode: Mode, reason: str) -> None:
        first = not self.ending
        if first:
            self.ending_since = time.monotonic()
        self.mode, self.reason = mode, reason
        self.unpaused.set()  # a paused service must see the stop
        self.stop_requested.set()
        log.info("service_stop_requested", mode=mode, reason=reason)
        if first:
            for listener in self.listeners:
                listener()

    def pause(self, reason: str | None) -> None:
        if self.mode == "running":
            self.mode = "paused"
            self.unpaused.clear()
            log.info("service_paused", reason=reason)

    def resume(self) -> None:
        if self.mode == "paused":
            self.mode = "running"
            self.unpaused.set()
            log.info("service_resumed")


async def drain_when_finished(bus: Any, state: ServiceState) -> None:
    """`--exit-when-finished`: drain `state` (the service then exits 0) once the trainer has
    marked the run finished (`bus.wait_finished`, rlbus.wire.run)."""
    record = await bus.wait_finished()
    log.info("run_finished_seen", last_step=record.last_step)
    state.drain("run finished")


def control_handler(state: ServiceState, *, pausable: bool) -> Callable[[Any], Awaitable[Any]]:
    """One answer to control requests for every service: Drain/Stop end it, Pause/Resume toggle
    issuing where `pausable`, else they are refused with a message."""
    from rlbus.wire import control

    async def handle(request: control.ControlRequest) -> control.ControlReply:
        name = type(request).__name__
        if isinstance(request, control.Drain):
            state.drain(f"control drain: {request.reason or ''}".strip())
        elif isinstance(request, control.Stop):
            state.stop(f"control stop: {request.reason or ''}".strip())
        elif not pausable:
            return control.ControlReply(
                ok=False,
                service=state.service,
                state=state.mode,
                message=f"{name} is not supported",
            )
        elif isinstance(request, control.Pause):
            state.pause(request.reason)
        else:
            state.resume()
        return control.ControlReply(ok=True, service=state.service, state=state.mode)

    return handle


def install_signal_handlers(state: ServiceState) -> None:
    """SIGTERM/SIGINT: the first drains, the second exits now (128 + signum)."""
    loop = asyncio.get_running_loop()
    seen: list[int] = []

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if seen:
            log.warning("second_signal_exit_now", signal=name, exit_code=EXIT_SIGNAL_BASE + signum)
            exit_now(EXIT_SIGNAL_BASE + signum)
        seen.append(signum)
        state.drain(f"signal {name}")

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)


class Terminated(Exception):
    """SIGTERM reached a synchronous command (raised by `raise_terminated`, like KeyboardInterrupt
    for SIGINT): the launchers and `rlbus-nats` then stop what they started."""


def raise_terminated(signum: int, frame: FrameType | None) -> None:
    """A `signal.signal` handler for SIGTERM in commands without an event loop."""
    raise Terminated()


def exit_now(code: int) -> None:
    """Leave without unwinding (the first signal's drain may be stuck): flush logs, then _exit."""
    import logging

    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(code)


# ---- supervised background tasks -----------------------------------------------------------


class TaskFailed(Exception):
    """A supervised task raised; carries the task's name and its error."""

    def __init__(self, task: str, error: BaseException) -> None:
        super().__init__(f"{task}: {type(error).__name__}: {error}")
        self.task = task
        self.error = error


SLOW_CANCEL_S = 10.0
"""How long a cancelled task may take to end before TaskSupervisor.close names it."""


def _stack_text(task: asyncio.Task) -> str:
    """Where `task` is suspended (its innermost frames), for a log line."""
    frames = task.get_stack(limit=3)
    return " <- ".join(
        f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno} {f.f_code.co_name}" for f in frames
    )


class TaskSupervisor:
    """The background tasks of one component. The first that raises wins: `wait`/`join` raise
    `TaskFailed` for it, and leaving the `async with` cancels whatever still runs."""

    def __init__(self) -> None:
        self.tasks: dict[asyncio.Task, str] = {}
        self.failure: TaskFailed | None = None
        self._failed = asyncio.Event()

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self.tasks[task] = name
        task.add_done_callback(self._on_done)
        return task

    def _on_done(self, task: asyncio.Task) -> None:
        name = self.tasks.pop(task, task.get_name())
        error = None if task.cancelled() else task.exception()
        if error is None or self.failure is not None:
            return
        # A nested supervisor already named the task that failed: keep the innermost name.
        self.failure = error if isinstance(error, TaskFailed) else TaskFailed(name, error)
        self._failed.set()

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    async def wait(
        self, *until: asyncio.Event | asyncio.Future, timeout_s: float | None = None
    ) -> None:
        """Until one of `until` (events, or tasks: left running) is done, or `timeout_s` passed;
        raises `TaskFailed` if a supervised task fails first."""
        waiters = [asyncio.ensure_future(e.wait()) for e in until if isinstance(e, asyncio.Event)]
        waiters.append(asyncio.ensure_future(self._failed.wait()))
        futures = [f for f in until if not isinstance(f, asyncio.Event)]
        try:
            await asyncio.wait(
                [*waiters, *futures], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for waiter in waiters:
                waiter.cancel()
        self.raise_if_failed()

    async def join(self) -> None:
        """Until every task has returned; raises `TaskFailed` at the first failure."""
        while self.tasks and self.failure is None:
            failed = asyncio.ensure_future(self._failed.wait())
            try:
                await asyncio.wait([*self.tasks, failed], return_when=asyncio.FIRST_COMPLETED)
            finally:
                failed.cancel()
        self.raise_if_failed()

    async def close(self) -> None:
        """Cancel what still runs and wait for it to finish. A task still running
        `SLOW_CANCEL_S` after its cancel (one that swallows or outlasts it: a bug) is named in a
        `tasks_slow_to_cancel` warning and cancelled again every `SLOW_CANCEL_S` until it ends:
        a cancel lost inside a library (asyncio.wait_for can turn one into a TimeoutError when
        its deadline passes at the same moment) must not keep the service from exiting."""
        pending = list(self.tasks)
        for task in pending:
            task.cancel()
        if not pending:
            return
        _, slow = await asyncio.wait(pending, timeout=SLOW_CANCEL_S)
        if slow:
            log.warning(
                "tasks_slow_to_cancel",
                tasks=sorted(t.get_name() for t in slow),
                after_s=SLOW_CANCEL_S,
                stacks=[_stack_text(t) for t in slow],
            )
        while slow:
            for task in slow:
                task.cancel()
            _, slow = await asyncio.wait(slow, timeout=SLOW_CANCEL_S)

    async def __aenter__(self) -> TaskSupervisor:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
        if exc_type is None:
            self.raise_if_failed()


def terminate_on_failure(task: asyncio.Task, name: str) -> None:
    """For a task in an event loop the shell does not own (vLLM's API server): if it raises, log
    the one `service_task_failed` line and SIGTERM this process, so its parent sees it end."""

    def on_done(done: asyncio.Task) -> None:
        error = None if done.cancelled() else done.exception()
        if error is None:
            return
        log.error(
            "service_task_failed",
            task=name,
            error=f"{type(error).__name__}: {error}",
            where=where(error),
        )
        os.kill(os.getpid(), signal.SIGTERM)

    task.add_done_callback(on_done)


def where(error: BaseException) -> str:
    """`file:line in function` of the frame that raised (the log line stays one line)."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "?"
    frame = frames[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"


def run_service(
    service: str, body: Callable[[ServiceState], Coroutine[Any, Any, Any]], *, signals: bool = True
) -> Any:
    """Run `body(state)` in a fresh event loop with the shell's signal handling; a failed
    supervised task ends the process with one log line and exit code 1."""

    async def amain() -> Any:
        state = ServiceState(service)
        if signals:
            install_signal_handlers(state)
        return await body(state)

    try:
        return asyncio.run(amain())
    except TaskFailed as failure:
        log.error(
            "service_task_failed",
            task=failure.task,
            error=f"{type(failure.error).__name__}: {failure.error}",
            where=where(failure.error),
        )
        raise SystemExit(EXIT_TASK_FAILED) from None
