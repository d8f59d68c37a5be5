"""The launcher's watchdog: ends a run whose `rl` launcher died without stopping it.

    python -m rlbus_launch.watchdog --launch-id <hex> --run-dir <run_dir> [--grace-s 4]

The launcher starts it first, in its own session and without the run's mark, with a pipe on its
stdin, and writes `done` there after it stopped every service itself. When the pipe closes
without `done` (the launcher was SIGKILLed, crashed, or lost its terminal), the watchdog SIGTERMs
every process carrying the launch's mark (`rlbus.process_marks.marked_pids`), SIGKILLs what is left after
`--grace-s`, logs `launcher_lost` to `<run_dir>/logs/rl.log`, removes the run-directory lock
(`rlbus_launch.lock`) if it is still this launch's, and exits. The services' parent-death signal
(`process_marks.die_with_parent`) has normally already asked the direct children to stop.
"""

import argparse
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import structlog

from rlbus import process_marks

log = structlog.get_logger()

DONE = b"done\n"
GRACE_S = 4.0


@dataclass
class Watchdog:
    """The launcher's end of the pipe to a running watchdog."""

    popen: subprocess.Popen

    def done(self, timeout_s: float = 5.0) -> None:
        """Tell the watchdog the launcher stopped everything itself; it exits without acting."""
        if self.popen.stdin is None:
            return
        try:
            self.popen.stdin.write(DONE)
            self.popen.stdin.close()
        except (BrokenPipeError, ValueError, OSError):
            pass
        self.popen.stdin = None
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()


def start_watchdog(launch_id: str, run_dir: Path, grace_s: float = GRACE_S) -> Watchdog:
    """Start the watchdog of one launch (own session: a terminal hang-up does not reach it)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (process_marks.LAUNCH_ID_ENV, process_marks.SERVICE_ENV)
    }
    popen = subprocess.Popen(
        [sys.executable, "-m", "rlbus_launch.watchdog", "--launch-id", launch_id,
         "--run-dir", str(run_dir), "--grace-s", str(grace_s)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )  # fmt: skip
    return Watchdog(popen)


def wait_for_launcher() -> bool:
    """Block until the pipe closes; True when the launcher said `done` first."""
    data = b""
    while True:
        try:
            chunk = os.read(sys.stdin.fileno(), 64)
        except InterruptedError:
            continue
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    return DONE in data


def end_launch(launch_id: str, run_dir: Path, grace_s: float) -> list[int]:
    """End every marked process of the launch; returns the pids that were found."""
    from rlbus_launch.lock import remove_lock

    found = process_marks.marked_pids(launch_id)
    survivors = process_marks.terminate(found, grace_s=grace_s)
    # A service may have spawned something while we waited: one more sweep, no grace.
    late = process_marks.marked_pids(launch_id)
    survivors += process_marks.terminate(late, grace_s=0.5)
    log.warning(
        "launcher_lost",
        launch_id=launch_id,
        ended=[*found, *late],
        survivors=survivors,
        hint="the rl launcher died without stopping its services; its watchdog ended them",
    )
    remove_lock(run_dir, launch_id)
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlbus_launch.watchdog")
    parser.add_argument("--launch-id", required=True)
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--grace-s", type=float, default=GRACE_S)
    args = parser.parse_args(argv)
    # Signals meant for the launcher's terminal or group must not take the watchdog with it.
    for sig in (signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    if wait_for_launcher():
        return
    from rlbus.obs.logging import setup_logging

    setup_logging("rl", run_dir=args.run_dir, stream=sys.stderr)
    end_launch(args.launch_id, args.run_dir, args.grace_s)


if __name__ == "__main__":
    main()
