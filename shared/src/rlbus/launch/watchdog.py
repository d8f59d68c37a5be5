"""The launcher's watchdog: if `rl` dies without saying goodbye, end every process it started.

    python -m rlbus.launch.watchdog <launch_id> <run_dir>      (stdin: a pipe from the launcher)

`rl` starts this process in its own session (so a terminal's SIGHUP or the launcher's process
group being killed does not reach it) with the read end of a pipe as stdin and keeps the write
end. A launcher that exits cleanly writes `done` first. When stdin reaches end-of-file without it
(the launcher was SIGKILLed, crashed, or lost its terminal and died), the watchdog:
- SIGTERMs every live process marked with the launch id (rlbus.procs), SIGKILLs what is left
  after `GRACE_S`: services, torchrun ranks, vLLM's engine processes, nats-server, whatever their
  session or parent;
- appends one `watchdog_cleanup` line to `<run_dir>/logs/rl.log`;
- removes `<run_dir>/launcher.json` if it still names this launch (rlbus.launch.lock).
All within 10 s of the launcher's death.
"""

import json
import os
import sys
import time
from pathlib import Path

from rlbus import procs

GRACE_S = 4.0
DONE = b"done"


def _log(run_dir: Path, **event) -> None:
    event = {**event, "service": "rl-watchdog", "level": "warning"}
    event["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        with open(run_dir / "logs" / "rl.log", "a") as f:
            f.write(json.dumps(event) + "\n")
    except OSError:
        pass


def wait_for_launcher(stream) -> bool:
    """Read until end-of-file; whether the launcher said `done` first."""
    said = b""
    while True:
        chunk = stream.read(64)
        if not chunk:
            return said.endswith(DONE)
        said = (said + chunk)[-len(DONE) :]


def clean_up(launch_id: str, run_dir: Path) -> list[int]:
    """End every process of the launch; returns the pids it found."""
    from rlbus.launch.lock import remove_lock

    found = procs.marked_pids(launch_id)
    survivors = procs.terminate(found, grace_s=GRACE_S) if found else []
    _log(run_dir, event="watchdog_cleanup", launch_id=launch_id, pids=found, survivors=survivors)
    remove_lock(run_dir, launch_id)
    return found


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m rlbus.launch.watchdog <launch_id> <run_dir>", file=sys.stderr)
        return 2
    launch_id, run_dir = args[0], Path(args[1])
    if wait_for_launcher(os.fdopen(sys.stdin.fileno(), "rb", buffering=0)):
        return 0
    clean_up(launch_id, run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
