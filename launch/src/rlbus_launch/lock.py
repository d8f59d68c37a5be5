"""The run-directory lock: `<run_dir>/launcher.json` names the `rl` launcher that runs there.

Written when the launcher starts services, removed when it exits cleanly (or by its watchdog
when it died). A new `rl` on the same run directory reads it before touching anything (before
`--clean` deletes a byte): a live launcher pid or live processes carrying the launch's mark
(`rlbus.process_marks`) make it refuse; a stale file (nothing alive) is ignored.
"""

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rlbus import process_marks

LOCK_FILE = "launcher.json"


@dataclass(frozen=True)
class LauncherLock:
    pid: int
    launch_id: str
    host: str
    started_at: float
    """Unix time the launcher started its services."""


def lock_path(run_dir: Path) -> Path:
    return Path(run_dir) / LOCK_FILE


def write_lock(run_dir: Path, launch_id: str) -> LauncherLock:
    """Write this process's lock (atomically: a reader never sees half a file)."""
    lock = LauncherLock(
        pid=os.getpid(), launch_id=launch_id, host=socket.gethostname(), started_at=time.time()
    )
    path = lock_path(run_dir)
    tmp = path.with_name(f".{LOCK_FILE}.{os.getpid()}")
    tmp.write_text(json.dumps(asdict(lock)) + "\n")
    os.replace(tmp, path)
    return lock


def read_lock(run_dir: Path) -> LauncherLock | None:
    """The lock in `run_dir`, or None when there is none or it is unreadable (treated as stale)."""
    try:
        data = json.loads(lock_path(run_dir).read_text())
        return LauncherLock(
            pid=int(data["pid"]),
            launch_id=str(data["launch_id"]),
            host=str(data.get("host", "")),
            started_at=float(data.get("started_at", 0.0)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remove_lock(run_dir: Path, launch_id: str) -> None:
    """Remove the lock if it is still this launch's (a newer launcher's lock is left alone)."""
    lock = read_lock(run_dir)
    if lock is not None and lock.launch_id == launch_id:
        lock_path(run_dir).unlink(missing_ok=True)


def live_processes(lock: LauncherLock) -> list[str]:
    """`pid N (command) [service]` for the lock's launcher (if alive) and every live process
    carrying its launch mark; empty for a stale lock. A lock from another host is never stale
    as far as this host can tell: its launcher is named as possibly alive."""
    if lock.host and lock.host != socket.gethostname():
        return [f"launcher pid {lock.pid} on host {lock.host} (cannot be checked from here)"]
    found = []
    if lock.pid != os.getpid() and process_marks.alive(lock.pid):
        found.append(f"{process_marks.describe(lock.pid)} [rl launcher]")
    for pid in process_marks.marked_pids(lock.launch_id):
        found.append(f"{process_marks.describe(pid)} [{process_marks.service_of(pid) or '?'}]")
    return found


def refusal(run_dir: Path) -> str | None:
    """The message for a run directory that still has a live launch, or None when it is free."""
    lock = read_lock(run_dir)
    if lock is None:
        return None
    alive = live_processes(lock)
    if not alive:
        return None
    marked = [line.split()[1] for line in alive if line.startswith("pid ")]
    launcher_alive = any(line.endswith("[rl launcher]") for line in alive)
    lines = [f"{run_dir} is in use by launch {lock.launch_id} (see {lock_path(run_dir)}):"]
    lines += [f"  {line}" for line in alive]
    if launcher_alive:
        stop = f"stop it with Ctrl-C in its terminal or `kill {lock.pid}`"
    else:
        stop = f"end the leftovers with `kill {' '.join(marked)}`"
    lines.append(f"Wait for it to finish, or {stop}; then run rl again.")
    return "\n".join(lines)
