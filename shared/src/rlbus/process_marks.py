"""Process trees of a run: mark them, find them, end them, even after their parent is gone.

A service may spawn processes that leave its process group or outlive it (torchrun's ranks, vLLM's
engine core). Two mechanisms make sure none is left behind:

- **a mark**: every process the launcher starts gets `RLBUS_LAUNCH_ID=<id>` and
  `RLBUS_SERVICE_INSTANCE=<service>` in its environment, and everything it spawns inherits them.
  `marked_pids(launch_id)` finds them all by reading `/proc/<pid>/environ`, whatever their session,
  group or parent. This is how the launcher clears a dead service's leftovers before a restart,
  how its watchdog ends a run whose launcher was SIGKILLed, and how a new `rl` in the same run
  directory names the processes still alive;
- **a parent-death signal**: `die_with_parent()` (Linux `PR_SET_PDEATHSIG`) asks the kernel to
  signal a process when the thread that started it exits. Used as `preexec_fn` for direct
  children and at the top of processes whose parent may be killed (torchrun ranks).

Linux only (`/proc`, `prctl`); elsewhere the mark still travels but nothing reads it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

LAUNCH_ID_ENV = "RLBUS_LAUNCH_ID"
SERVICE_ENV = "RLBUS_SERVICE_INSTANCE"

_PR_SET_PDEATHSIG = 1
_PROC = Path("/proc")
try:  # loaded once here: a preexec_fn must not dlopen in a forked child of a threaded parent
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:
    _LIBC = None


def mark_env(launch_id: str, service: str) -> dict[str, str]:
    """The environment variables that mark a process (and its descendants) as one run's."""
    return {LAUNCH_ID_ENV: launch_id, SERVICE_ENV: service}


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send `sig` to this process when its parent exits (best effort).

    Safe as a `subprocess.Popen(preexec_fn=...)`: it only calls prctl (libc is loaded at import).
    If the parent is already gone when this runs (a race at start-up: the parent pid changed
    between the call and the prctl), the process signals itself at once. A parent that is pid 1
    (`rl` as a container's entry point) is fine: only a change of parent counts.
    """
    if _LIBC is None:
        return
    parent = os.getppid()
    try:
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except AttributeError:  # no prctl: not Linux
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = (_PROC / str(pid) / "environ").read_bytes()
    except OSError:  # gone, or not ours to read
        return {}
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def _all_pids() -> list[int]:
    try:
        return [int(entry.name) for entry in _PROC.iterdir() if entry.name.isdigit()]
    except OSError:
        return []


def alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not _PROC.exists()  # no /proc: kill(0) is all we know
    # "pid (comm) S ...": the state follows the last ')', comm may contain spaces or parens
    return stat.rpartition(")")[2].split()[0] != "Z"


def start_ticks(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot, /proc's field 22): with the pid, it names one
    process even after pids are reused. None when it is gone."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])


def marked_pids(launch_id: str, service: str | None = None) -> list[int]:
    """Live processes carrying `launch_id` (and `service`, if given), this process excluded."""
    me = os.getpid()
    found = []
    for pid in _all_pids():
        if pid == me:
            continue
        env = _environ(pid)
        if env.get(LAUNCH_ID_ENV) != launch_id:
            continue
        if service is not None and env.get(SERVICE_ENV) != service:
            continue
        if alive(pid):
            found.append(pid)
    return sorted(found)


def service_of(pid: int) -> str | None:
    """The service mark of `pid`, if it has one."""
    return _environ(pid).get(SERVICE_ENV)


def describe(pid: int, max_chars: int = 120) -> str:
    """`pid 1234 (python -m rlbus_trainer.entrypoint ...)`, for messages naming a process."""
    try:
        argv = (_PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
        command = " ".join(a.decode(errors="replace") for a in argv if a)
    except OSError:
        command = "?"
    if len(command) > max_chars:
        command = command[: max_chars - 3] + "..."
    return f"pid {pid} ({command})"


def terminate(pids: Iterable[int], grace_s: float = 5.0) -> list[int]:
    """SIGTERM `pids`, wait up to `grace_s`, SIGKILL what is left; returns any still alive after
    the SIGKILL (normally none)."""
    pending = [pid for pid in pids if alive(pid)]
    for pid in pending:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pending and time.monotonic() < deadline:
        time.sleep(0.1)
        pending = [pid for pid in pending if alive(pid)]
    for pid in pending:
        _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + 2.0
    while pending and time.monotonic() < deadline:
        time.sleep(0.05)
        pending = [pid for pid in pending if alive(pid)]
    return pending


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """End the process group `proc` leads (started with `start_new_session`): SIGTERM, up to
    `grace_s` for it to exit, then SIGKILL. For tools that start one whole process tree (a
    benchmark's `rl`, a bare vLLM engine)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
