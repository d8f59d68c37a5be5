"""The launcher's watchdog and lock, with real processes: a SIGKILLed launcher leaves nothing."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from rlbus import procs
from rlbus.launch import lock
from rlbus.runs import RunDirError

# A stand-in launcher: the real lock, the real watchdog, two marked services (one ignoring
# SIGTERM, one in a session of its own), then it waits to be killed.
LAUNCHER = """
import os, subprocess, sys, time
from pathlib import Path
from rlbus import procs
from rlbus.launch.lock import write_lock
from rlbus.launch.rl import start_watchdog
run_dir, launch_id = Path(sys.argv[1]), sys.argv[2]
write_lock(run_dir, launch_id)
watchdog, pipe = start_watchdog(launch_id, run_dir)
stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
for name in ("trainer", "inference"):
    subprocess.Popen([sys.executable, "-c", stubborn], start_new_session=True,
                     env={**os.environ, **procs.mark_env(launch_id, name)})
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP])
def test_a_killed_launcher_leaves_no_marked_process_and_no_lock(tmp_path, sig):
    (tmp_path / "logs").mkdir()
    launch_id = uuid.uuid4().hex
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path), launch_id], stdout=subprocess.PIPE
    )
    try:
        assert launcher.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 10
        while len(procs.marked_pids(launch_id)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(procs.marked_pids(launch_id)) == 2
        assert any("the launcher" in line for line in lock.live_processes(tmp_path))
        with pytest.raises(RunDirError, match="is in use by a launch"):
            lock.refuse_if_live(tmp_path)
        killed_at = time.monotonic()
        launcher.send_signal(sig)
        launcher.wait(5)
        while procs.marked_pids(launch_id) and time.monotonic() - killed_at < 10:
            time.sleep(0.1)
        assert procs.marked_pids(launch_id) == [], "survivors 10 s after the launcher died"
        deadline = time.monotonic() + 5
        while (tmp_path / lock.LOCK_FILE).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not (tmp_path / lock.LOCK_FILE).exists()
        assert lock.live_processes(tmp_path) == []
        events = [
            json.loads(line) for line in (tmp_path / "logs" / "rl.log").read_text().splitlines()
        ]
        assert events[-1]["event"] == "watchdog_cleanup" and len(events[-1]["pids"]) == 2
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        procs.terminate(procs.marked_pids(launch_id), grace_s=0.5)


def test_a_clean_goodbye_leaves_the_services_alone_and_a_stale_lock_is_ignored(tmp_path):
    from rlbus.launch.rl import start_watchdog, stop_watchdog

    launch_id = uuid.uuid4().hex
    service = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, **procs.mark_env(launch_id, "x")},
    )
    try:
        watchdog, pipe = start_watchdog(launch_id, tmp_path)
        stop_watchdog(watchdog, pipe)
        assert watchdog.returncode == 0 and procs.alive(service.pid)
    finally:
        service.kill()
        service.wait()
    (tmp_path / lock.LOCK_FILE).write_text(
        json.dumps({"pid": service.pid, "pid_start_ticks": 1, "launch_id": launch_id})
    )
    assert lock.live_processes(tmp_path) == []
    lock.refuse_if_live(tmp_path)  # stale: no error
