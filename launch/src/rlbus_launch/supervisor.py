"""Child processes of the `rl` launcher: start, watch, stop, with no orphans.

Every service runs in its own session (process group), because torchrun and vLLM spawn children
of their own: stopping a service signals its whole group, then waits, then kills what is left.
Each service's stdout and stderr go to `<run_dir>/logs/<service>.log`.

With a launch id, a service also carries the run's mark in its environment
(`rlbus.process_marks.mark_env`, inherited by everything it spawns) and the kernel's parent-death signal
(`process_marks.die_with_parent`, SIGTERM when the launcher dies): processes that leave the group
(torchrun's ranks) are still found by their mark and ended with the service.
"""

import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from rlbus import process_marks

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
    launch_id: str | None = None
    """Set by the launcher: the service's processes carry `process_marks.mark_env(launch_id, name)`."""

    def start(self) -> None:
        """Start (or, after it died, start again) this service with the same argv; output is
        appended to its log."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(self.log_path, "ab", buffering=0)
        env = {**os.environ, **self.env}
        if self.launch_id is not None:
            env.update(process_marks.mark_env(self.launch_id, self.name))
        self.popen = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.cwd,
            start_new_session=True,
            preexec_fn=process_marks.die_with_parent if self.launch_id is not None else None,
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

    def leftovers(self) -> list[int]:
        """Live processes carrying this service's mark (none without a launch id)."""
        if self.launch_id is None:
            return []
        return process_marks.marked_pids(self.launch_id, self.name)

    def end_leftovers(self, grace_s: float = 5.0) -> list[int]:
        """SIGKILL the group, then SIGTERM (SIGKILL after `grace_s`) every process still carrying
        the mark: what a dead leader left behind. Returns the pids that were ended."""
        if self.popen is not None:
            self.signal_group(signal.SIGKILL)
        found = self.leftovers()
        survivors = process_marks.terminate(found, grace_s=grace_s)
        if found:
            log.info("leftovers_ended", service=self.name, pids=found, survivors=survivors)
        return found

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM the group, wait up to timeout_s, then SIGKILL the group and every marked
        leftover. Returns the exit code."""
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
        self.end_leftovers(grace_s=min(timeout_s, 5.0))
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
        self, expected_to_exit: AbstractSet[str] = frozenset()
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
        self.assert_none_survive()

    def stop_now(self, grace_s: float = 0.0) -> None:
        """Stop every service at once, no drain: SIGTERM every group and marked process (unless
        `grace_s` is 0), wait up to `grace_s`, then SIGKILL all that is left."""
        started = [s for s in self.services if s.popen is not None]
        if grace_s > 0:
            for service in started:
                service.signal_group(signal.SIGTERM)
                for pid in service.leftovers():
                    _signal(pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and any(
                s.poll() is None or s.leftovers() for s in started
            ):
                time.sleep(0.1)
        for service in started:
            service.signal_group(signal.SIGKILL)
            for pid in service.leftovers():
                _signal(pid, signal.SIGKILL)
        for service in started:
            assert service.popen is not None  # `started` holds only those
            try:
                service.popen.wait(5)
            except subprocess.TimeoutExpired:
                pass
            service.end_leftovers(grace_s=0.5)
            log.info("service_stopped", service=service.name, pid=service.pid, now=True)
        self.assert_none_survive()

    def assert_none_survive(self, timeout_s: float = 5.0) -> None:
        """Wait up to `timeout_s` for every group and marked process to be gone; fail loudly
        naming them if any is not."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.survivors():
            time.sleep(0.1)
        survivors = self.survivors()
        assert not survivors, f"processes survived SIGKILL: {survivors}"

    def survivors(self) -> list[str]:
        found = []
        for service in self.services:
            if service.group_alive():
                found.append(f"{service.name} (group {service.pid})")
            found += [f"{service.name} (pid {pid})" for pid in service.leftovers()]
        return found


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
