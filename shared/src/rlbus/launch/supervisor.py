"""Child processes of the `rl` launcher: start, watch, restart, stop, with no orphans.

Every service runs in its own session (process group), because torchrun and vLLM spawn children
of their own: stopping a service signals its whole group, then waits, then kills what is left.
Each service's stdout and stderr go to `<run_dir>/logs/<service>.log` (appended across restarts).

Every process also carries the launch's mark (`rlbus.procs.mark_env`: launch id + service name),
inherited by all it spawns, and asks for SIGTERM when the launcher dies (`die_with_parent`). The
mark finds what left the group (torchrun's ranks start sessions of their own) when a service is
stopped or restarted, and lets the watchdog (rlbus.launch.watchdog) end everything when the
launcher itself is killed.
"""

import os
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from rlbus import procs

log = structlog.get_logger()


def describe_exit(code: int) -> str:
    """`exit code 1`, or `killed by SIGKILL` for a Popen return code of -9."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def launcher_exit_code(code: int) -> int:
    """The code `rl` exits with for a service that ended with `code`: 128 + N for signal N, the
    code itself otherwise, 1 for a 0 that was not expected."""
    if code < 0:
        return 128 - code
    return code or 1


@dataclass
class RestartPolicy:
    """At most `max_restarts` restarts within a sliding `window_s`, each after a backoff that
    starts at `backoff_s` and doubles per restart still in the window, up to `max_backoff_s`."""

    max_restarts: int
    window_s: float
    backoff_s: float
    max_backoff_s: float
    restarts: list[float] = field(default_factory=list)
    """Monotonic times of the restarts granted so far (within the window)."""

    def next_delay(self, now: float) -> float | None:
        """Seconds to wait before restarting after a death at `now`; None: the budget is spent.
        A granted restart is counted at once."""
        self.restarts = [t for t in self.restarts if now - t < self.window_s]
        if len(self.restarts) >= self.max_restarts:
            return None
        delay = min(self.backoff_s * 2 ** len(self.restarts), self.max_backoff_s)
        self.restarts.append(now)
        return delay

    @property
    def used(self) -> int:
        return len(self.restarts)


@dataclass
class ServiceProcess:
    """One service launched as a process group."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    popen: subprocess.Popen | None = None
    launch_id: str | None = None
    """Set by the launcher: the mark every process of this service carries."""
    restart_at: float | None = None
    """Monotonic time of a pending restart (the service died and waits for its backoff)."""

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(self.log_path, "ab", buffering=0)
        mark = procs.mark_env(self.launch_id, self.name) if self.launch_id else {}
        self.popen = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env, **mark},
            cwd=self.cwd,
            start_new_session=True,
            preexec_fn=procs.die_with_parent,
        )
        log_file.close()
        self.restart_at = None
        log.info("service_started", service=self.name, pid=self.popen.pid, log=str(self.log_path))

    def leftovers(self) -> list[int]:
        """Live processes with this service's mark (e.g. ranks or engine processes of a dead
        leader, whatever their session)."""
        if not self.launch_id:
            return []
        return procs.marked_pids(self.launch_id, self.name)

    def end_leftovers(self, grace_s: float = 5.0) -> None:
        """SIGKILL the group, then SIGTERM/SIGKILL every marked process that is left."""
        if self.popen is not None:
            self.signal_group(signal.SIGKILL)
        left = self.leftovers()
        if left:
            log.warning("service_leftovers", service=self.name, pids=left)
            procs.terminate(left, grace_s=grace_s)

    @property
    def pid(self) -> int:
        assert self.popen is not None, f"{self.name} was never started"
        return self.popen.pid

    def poll(self) -> int | None:
        """Exit code, or None while running."""
        return None if self.popen is None else self.popen.poll()

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM the group, wait up to timeout_s, then SIGKILL the group. Returns the exit code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.signal_group(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("service_kill", service=self.name, pid=self.pid, after_s=timeout_s)
        # Children (vLLM engine core, torchrun ranks) may outlive the leader: kill the group
        # anyway, and whatever else carries this service's mark.
        self.end_leftovers(grace_s=2.0)
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass
        return self.popen.returncode

    def group_alive(self) -> bool:
        """Whether any process of this service's group still exists."""
        if self.popen is None:
            return False
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        # A zombie leader still "exists" until reaped; poll() reaps it.
        self.popen.poll()
        try:
            os.killpg(self.pid, 0)
            return True
        except ProcessLookupError:
            return bool(self.leftovers())

    def tail(self, num_lines: int = 30) -> str:
        """The last lines of this service's log."""
        if not self.log_path.exists():
            return ""
        with open(self.log_path, errors="replace") as f:
            return "".join(deque(f, maxlen=num_lines))


@dataclass
class Supervisor:
    """Starts services in order and stops them in reverse order."""

    services: list[ServiceProcess] = field(default_factory=list)

    def start(self, service: ServiceProcess) -> ServiceProcess:
        service.start()
        self.services.append(service)
        return service

    def first_failure(
        self, expected_to_exit: set[str] = frozenset()
    ) -> tuple[ServiceProcess, int] | None:
        """The first service that exited, unless it is one that may exit (exit 0 only)."""
        for service in self.services:
            code = service.poll()
            if code is None:
                continue
            if code == 0 and service.name in expected_to_exit:
                continue
            return service, code
        return None

    def stop_all(self, timeout_s: float = 20.0) -> None:
        """Stop every service, last started first, then make sure no group survives."""
        for service in reversed(self.services):
            code = service.stop(timeout_s)
            log.info("service_stopped", service=service.name, pid=service.pid, exit_code=code)
        deadline = time.monotonic() + 5
        while any(s.group_alive() for s in self.services) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = [s.name for s in self.services if s.group_alive()]
        assert not survivors, f"processes survived SIGKILL: {survivors}"

    def kill_all(self) -> None:
        """Stop now (a second Ctrl-C, SIGHUP): SIGKILL every group and every marked process."""
        for service in reversed(self.services):
            if service.popen is not None:
                service.end_leftovers(grace_s=0.0)
                try:
                    service.popen.wait(5)
                except subprocess.TimeoutExpired:
                    pass
        log.info("services_killed", services=[s.name for s in self.services])
