"""The run directory's launcher lock: `<run_dir>/launcher.json` names the `rl` that runs it.

Written by `rl` before it starts any service, removed when it exits cleanly (or by its watchdog
after it was killed). It holds the launcher's pid, the pid's start time (so a reused pid is not
mistaken for it), the launch id every service process carries as its mark (rlbus.procs), the
host and the start time. A new `rl` on the same run directory (fresh, `--resume`, `--clean` or
`--dry-run`) first asks `live_processes`: if the launcher or any marked process is still alive it
refuses, naming them, before it touches the directory. A lock whose processes are all gone is
stale and ignored.
"""

import json
import os
import socket
import time
from pathlib import Path

from rlbus import procs
from rlbus.runs import RunDirError

LOCK_FILE = "launcher.json"


def read_lock(run_dir: Path) -> dict | None:
    try:
        lock = json.loads((run_dir / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return None
    return lock if isinstance(lock, dict) else None


def write_lock(run_dir: Path, launch_id: str) -> Path:
    """Atomically write this launcher's lock (tmp file + rename)."""
    pid = os.getpid()
    lock = {
        "pid": pid,
        "pid_start_ticks": procs.start_ticks(pid),
        "launch_id": launch_id,
        "host": socket.gethostname(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path = run_dir / LOCK_FILE
    tmp = path.with_name(f".{LOCK_FILE}.{pid}")
    tmp.write_text(json.dumps(lock) + "\n")
    os.replace(tmp, path)
    return path


def remove_lock(run_dir: Path, launch_id: str) -> None:
    """Remove the lock if it is still this launch's (a newer launch's lock is left alone)."""
    lock = read_lock(run_dir)
    if lock is not None and lock.get("launch_id") == launch_id:
        (run_dir / LOCK_FILE).unlink(missing_ok=True)


def live_processes(run_dir: Path) -> list[str]:
    """Descriptions of the live processes of the launch that holds `run_dir` (none: free)."""
    lock = read_lock(run_dir)
    if lock is None:
        return []
    live = []
    pid = lock.get("pid")
    if (
        isinstance(pid, int)
        and procs.alive(pid)
        and procs.start_ticks(pid) == lock.get("pid_start_ticks")
    ):
        live.append(f"the launcher, {procs.describe(pid)}")
    launch_id = lock.get("launch_id")
    if isinstance(launch_id, str):
        for marked in procs.marked_pids(launch_id):
            live.append(f"{procs.service_of(marked)}, {procs.describe(marked)}")
    return live


def refuse_if_live(run_dir: Path) -> None:
    """RunDirError naming the live processes of another launch of this run directory."""
    live = live_processes(run_dir)
    if not live:
        return
    lock = read_lock(run_dir) or {}
    listing = "\n".join(f"  - {line}" for line in live)
    raise RunDirError(
        f"run directory {run_dir} is in use by a launch started {lock.get('started_at', '?')} on "
        f"{lock.get('host', '?')}; still alive:\n{listing}\n"
        f"Wait for it to finish, stop it (Ctrl-C in its terminal, or kill {lock.get('pid')}), or "
        "end the processes above by pid; then run this command again."
    )
