"""Child processes of the `rl` launcher: start, watch, stop, with no orphans.

Every service runs in its own session (process group), because torchrun and vLLM spawn children
of their own: stopping a service signals its whole group, then waits, then kills what is left.
Each service's stdout and stderr go to `<run_dir>/logs/<service>.log`.
"""

import os
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import structlog

log = structlog.get_logger()


@dataclass
class ServiceProcess:
    """One service launched as a process group."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    popen: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(self.log_path, "ab", buffering=0)
        self.popen = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            cwd=self.cwd,
            start_new_session=True,
        )
        log_file.close()
        log.info("service_started", service=self.name, pid=self.popen.pid, log=str(self.log_path))

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
        # Children (vLLM engine core, torchrun ranks) may outlive the leader: kill the group anyway.
        self.signal_group(signal.SIGKILL)
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
            return False

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
