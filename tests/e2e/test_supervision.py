"""The real launcher heals and leaves nothing behind (debug config, a few steps each):

- `rl` killed by SIGKILL or SIGHUP mid-run: no process carrying its launch mark survives 10 s;
- the monitor SIGKILLed once mid-run: restarted, announced, and the run finishes with exit 0;
- a second `rl` on a live run directory (`--resume` or `--clean`) is refused, naming the live
  processes, before it touches the directory.
"""

import os
import signal
import subprocess
import time

import pytest
from e2e_support import (
    BIN,
    DEBUG_RL,
    REPO,
    RlLaunch,
    launcher_pids,
    log_events,
    marked_alive,
    steps_with,
    wait_for,
)

from rlbus.launch.lock import LOCK_FILE, read_lock

pytestmark = pytest.mark.slow

NO_SURVIVOR_S = 10.0


def started_mid_run(launch: RlLaunch, steps: int = 1) -> str:
    """Wait until `steps` steps are trained (every service is up); the launch id from
    launcher.json."""
    wait_for(
        lambda: len(steps_with(launch.run_dir, "loss")) >= steps or launch.popen.poll() is not None,
        480,
        f"{steps} trained step(s)",
    )
    assert launch.popen.poll() is None, f"rl exited early:\n{launch.output()[-3000:]}"
    lock = read_lock(launch.run_dir)
    assert lock is not None and lock.pid == launch.popen.pid, "launcher.json names the launcher"
    assert marked_alive(lock.launch_id), "the services carry the launch mark"
    return lock.launch_id


def assert_nothing_survives(launch_id: str, since: float) -> None:
    deadline = since + NO_SURVIVOR_S
    while time.monotonic() < deadline and marked_alive(launch_id):
        time.sleep(0.2)
    assert marked_alive(launch_id) == [], f"alive {NO_SURVIVOR_S:g} s after the launcher died"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP], ids=["sigkill", "sighup"])
def test_launcher_killed_mid_run_leaves_no_process_of_its_launch(tmp_path, starting_model, sig):
    launch = RlLaunch(tmp_path, "orphans", "--model.name", str(starting_model.path))
    try:
        launch_id = started_mid_run(launch)
        marked_before = marked_alive(launch_id)
        assert any("[trainer]" in line for line in marked_before), marked_before
        killed_at = time.monotonic()
        launch.popen.send_signal(sig)
        code = launch.wait(30)
        assert_nothing_survives(launch_id, killed_at)
        if sig == signal.SIGHUP:
            assert code == 128 + signal.SIGHUP, launch.output()[-3000:]
            assert log_events(launch.run_dir, "stopping_now")
        else:
            assert code == -signal.SIGKILL
            wait_for(
                lambda: log_events(launch.run_dir, "launcher_lost"), 10, "the watchdog's log line"
            )
        wait_for(lambda: not (launch.run_dir / LOCK_FILE).exists(), 10, "the lock removed")
    finally:
        launch.kill()


def test_a_monitor_killed_mid_run_is_restarted_and_the_run_finishes(tmp_path, starting_model):
    launch = RlLaunch(
        tmp_path, "heals", "--model.name", str(starting_model.path), "--max-steps", "6"
    )
    try:
        started_mid_run(launch, steps=2)
        monitor = launcher_pids(launch.run_dir)["monitor"]
        os.kill(monitor, signal.SIGKILL)
        code = launch.wait()
        output = launch.output()
        assert code == 0, output[-4000:]
        died = log_events(launch.run_dir, "service_died")
        assert [(e["service"], e["pid"], e["signal"]) for e in died] == [
            ("monitor", monitor, "SIGKILL")
        ]
        restarted = log_events(launch.run_dir, "service_restarted")
        assert [e["service"] for e in restarted] == ["monitor"] and restarted[0]["pid"] != monitor
        assert "monitor died (killed by SIGKILL); restarting in 1 s (restart 1 of 5 in 600 s)" in (
            output
        )
        assert f"monitor is back (pid {restarted[0]['pid']})" in output
        assert sorted(set(steps_with(launch.run_dir, "loss"))) == list(range(1, 7))
        assert not (launch.run_dir / LOCK_FILE).exists()
        for launch_id in {e["launch_id"] for e in log_events(launch.run_dir, "launch_started")}:
            assert marked_alive(launch_id) == []
    finally:
        launch.kill()


def test_a_second_rl_on_a_live_run_directory_is_refused_naming_the_processes(
    tmp_path, starting_model
):
    first = RlLaunch(tmp_path, "busy", "--model.name", str(starting_model.path))
    try:
        wait_for(
            lambda: (first.run_dir / LOCK_FILE).exists() and "nats" in launcher_pids(first.run_dir),
            120,
            "the first launcher's lock and services",
        )
        assert first.popen.poll() is None, first.output()[-3000:]
        for flag in ("--resume", "--clean"):
            second = subprocess.run(
                [str(BIN / "rl"), "@", str(DEBUG_RL), "--output-dir", str(tmp_path),
                 "--run.name", "busy", "--model.name", str(starting_model.path), flag],
                cwd=REPO, capture_output=True, text=True, timeout=120,
                env={**os.environ, "COLUMNS": "400"},  # the message box must not wrap a line
            )  # fmt: skip
            message = second.stdout + second.stderr
            assert second.returncode == 2, message
            assert "is in use by launch" in message
            assert f"pid {first.popen.pid} (" in message and "[rl launcher]" in message
            assert "[nats]" in message and f"kill {first.popen.pid}" in message
            assert "Traceback" not in message
            assert (first.run_dir / "configs" / "rl.toml").exists(), f"{flag} touched the run"
        assert first.popen.poll() is None, "the refused launcher stopped the first one"
        lock = read_lock(first.run_dir)
        hung_up_at = time.monotonic()
        first.popen.send_signal(signal.SIGHUP)
        assert first.wait(30) == 128 + signal.SIGHUP
        assert_nothing_survives(lock.launch_id, hung_up_at)
    finally:
        first.kill()
