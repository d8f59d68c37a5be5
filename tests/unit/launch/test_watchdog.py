"""The launcher's watchdog as a real process: when its launcher dies by SIGKILL, every process
carrying the launch's mark is gone within 10 s (even one that ignores SIGTERM), the lock is
removed and rl.log says so; after a clean `done` it touches nothing."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from rlbus import process_marks
from rlbus_launch.lock import lock_path

LAUNCHER = """
import json, os, subprocess, sys, time
from pathlib import Path
from rlbus import process_marks
from rlbus_launch.lock import write_lock
from rlbus_launch.watchdog import start_watchdog

launch_id, run_dir, clean = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "clean"
watchdog = start_watchdog(launch_id, run_dir, grace_s=2.0)
write_lock(run_dir, launch_id)
stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
children = [
    subprocess.Popen(
        [sys.executable, "-c", stubborn],
        env={**os.environ, **process_marks.mark_env(launch_id, f"svc{i}")},
        start_new_session=True,
    )
    for i in range(2)
]
print(json.dumps({"watchdog": watchdog.popen.pid, "children": [c.pid for c in children]}), flush=True)
if clean:
    for child in children:
        child.kill()
        child.wait()
    watchdog.done()
    print("done", flush=True)
time.sleep(300)
"""


@pytest.fixture
def launched(tmp_path):
    """start(mode) -> (launcher popen, pids); every pid is SIGKILLed at teardown."""
    pids: list[int] = []
    popens: list[subprocess.Popen] = []

    def start(mode: str):
        launch_id = uuid.uuid4().hex
        popen = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, launch_id, str(tmp_path), mode],
            stdout=subprocess.PIPE,
            text=True,
        )
        popens.append(popen)
        info = json.loads(popen.stdout.readline())
        pids.extend([info["watchdog"], *info["children"]])
        return popen, launch_id, info

    yield start
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for popen in popens:
        popen.kill()
        popen.wait(10)


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(process_marks.alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if process_marks.alive(p)]


def test_launcher_sigkilled_every_marked_process_gone_within_10s(tmp_path, launched):
    launcher, launch_id, info = launched("dies")
    # A child's /proc environ shows its mark once it has exec'd (not between fork and exec).
    deadline = time.monotonic() + 10
    while sorted(process_marks.marked_pids(launch_id)) != sorted(info["children"]):
        assert time.monotonic() < deadline, (process_marks.marked_pids(launch_id), info["children"])
        time.sleep(0.05)
    assert lock_path(tmp_path).exists()
    killed_at = time.monotonic()
    launcher.kill()
    launcher.wait(10)
    assert wait_gone(info["children"], 10.0) == [], "marked processes survived the launcher"
    assert time.monotonic() - killed_at < 10.0
    assert wait_gone([info["watchdog"]], 5.0) == [], "the watchdog did not exit"
    assert not lock_path(tmp_path).exists()
    events = [json.loads(line) for line in (tmp_path / "logs" / "rl.log").read_text().splitlines()]
    lost = [e for e in events if e["event"] == "launcher_lost"]
    assert lost and lost[0]["launch_id"] == launch_id
    assert sorted(lost[0]["ended"]) == sorted(info["children"]) and lost[0]["survivors"] == []


def test_a_clean_done_leaves_the_watchdog_nothing_to_do(tmp_path, launched):
    launcher, launch_id, info = launched("clean")
    assert launcher.stdout.readline().strip() == "done"
    assert wait_gone([info["watchdog"]], 5.0) == []
    assert not (tmp_path / "logs" / "rl.log").exists()
    assert lock_path(tmp_path).exists()  # the launcher removes its own lock, not the watchdog
