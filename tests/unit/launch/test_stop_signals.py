"""`rl`'s `supervise` in a real process, with stand-in services that ignore SIGTERM (so a normal
stop would wait 20 s for each): a second Ctrl-C stops everything at once, a SIGHUP stops without
a drain (exit 129); either way no marked process survives and the lock is gone."""

import os
import signal
import subprocess
import sys
import time

import pytest

from rlbus import process_marks
from rlbus_launch.lock import lock_path, read_lock

LAUNCHER = """
import signal, sys
from pathlib import Path
from rlbus.configs import RLConfig
from rlbus_launch.plan import Launch
from rlbus_launch.rl import supervise
from rlbus_launch.supervisor import ServiceProcess

run_dir = Path(sys.argv[1])
stubborn = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('up', flush=True); time.sleep(300)"
)
services = [
    ServiceProcess(name=name, argv=[sys.executable, "-c", stubborn],
                   log_path=run_dir / "logs" / f"{name}.log")
    for name in ("monitor", "trainer")
]
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a script's `rl ... &` starts: rl must still drain
sys.exit(supervise(Launch(config=RLConfig(), run_dir=run_dir, processes=services), poll_s=0.05))
"""


@pytest.fixture
def launcher(tmp_path):
    """The stand-in launch, up; its marked processes are ended at teardown whatever happened."""
    popen = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    launch_id = None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            lock = read_lock(tmp_path)
            logs = [tmp_path / "logs" / f"{name}.log" for name in ("monitor", "trainer")]
            if lock and all(p.exists() and "up" in p.read_text() for p in logs):
                launch_id = lock.launch_id
                break
            assert popen.poll() is None, "the launcher exited early"
            time.sleep(0.1)
        assert launch_id is not None, "the stand-in services did not come up"
        assert len(process_marks.marked_pids(launch_id)) == 2
        yield popen, launch_id
    finally:
        popen.kill()
        popen.wait(10)
        if launch_id is not None:
            process_marks.terminate(process_marks.marked_pids(launch_id), grace_s=0)


def test_a_second_ctrl_c_stops_everything_now(tmp_path, launcher):
    popen, launch_id = launcher
    popen.send_signal(signal.SIGINT)
    time.sleep(1.0)  # now stopping: SIGTERM is ignored, stop_all would wait 20 s per service
    assert popen.poll() is None
    second_at = time.monotonic()
    popen.send_signal(signal.SIGINT)
    assert popen.wait(10) == 128 + signal.SIGINT
    assert time.monotonic() - second_at < 10
    assert process_marks.marked_pids(launch_id) == []
    assert not lock_path(tmp_path).exists()


def test_sighup_stops_without_a_drain_and_exits_129(tmp_path, launcher):
    popen, launch_id = launcher
    hung_up_at = time.monotonic()
    os.kill(popen.pid, signal.SIGHUP)
    assert popen.wait(10) == 128 + signal.SIGHUP
    assert time.monotonic() - hung_up_at < 10
    assert process_marks.marked_pids(launch_id) == []
    assert not lock_path(tmp_path).exists()
