"""The real launcher heals and leaves nothing behind (debug config, two runs):

- `rl` killed by SIGKILL or SIGHUP mid-run: no process carrying its launch mark survives 10 s;
- the monitor SIGKILLed mid-run: restarted alone and announced (that a run heals to exit 0 after
  such kills is the chaos test's, tests/e2e/test_chaos.py);
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

from rlbus_launch.lock import LOCK_FILE, read_lock

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


def assert_monitor_restarted(launch: RlLaunch) -> None:
    """SIGKILL the monitor: the launcher names it, why, and brings it back alone."""
    monitor = launcher_pids(launch.run_dir)["monitor"]
    os.kill(monitor, signal.SIGKILL)
    wait_for(lambda: log_events(launch.run_dir, "service_restarted"), 60, "the monitor restarted")
    died = log_events(launch.run_dir, "service_died")
    assert [(e["service"], e["pid"], e["signal"]) for e in died] == [
        ("monitor", monitor, "SIGKILL")
    ]
    restarted = log_events(launch.run_dir, "service_restarted")
    assert [e["service"] for e in restarted] == ["monitor"] and restarted[0]["pid"] != monitor
    wait_for(
        lambda: f"monitor is back (pid {restarted[0]['pid']})" in launch.output(),
        30,
        "the console's 'monitor is back' line",
    )
    output = launch.output()
    assert "monitor died (killed by SIGKILL); restarting in 1 s (restart 1 of 5 in 600 s)" in (
        output
    )


def assert_second_rl_refused(tmp_path, starting_model, first: RlLaunch) -> None:
    """`rl --resume` / `--clean` on the live run directory: refused (exit 2), naming the live
    processes, before it touches the directory; the first launcher goes on."""
    for flag in ("--resume", "--clean"):
        second = subprocess.run(
            [str(BIN / "rl"), "@", str(DEBUG_RL), "--output-dir", str(tmp_path),
             "--run.name", first.run_dir.name, "--model.name", str(starting_model.path), flag],
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


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP], ids=["sigkill", "sighup"])
def test_launcher_killed_mid_run_leaves_no_process_of_its_launch(tmp_path, starting_model, sig):
    """Mid-run (one step trained, so vLLM's children and torchrun's ranks are up). Before the
    launcher is killed, the SIGKILL run also has its monitor killed and restarted, and the SIGHUP
    run refuses a second `rl` on its directory (one full start-up each instead of four)."""
    launch = RlLaunch(  # steps enough to be mid-run still after the monitor's restart
        tmp_path, "orphans", "--model.name", str(starting_model.path), "--max-steps", "120"
    )
    try:
        launch_id = started_mid_run(launch)
        marked_before = marked_alive(launch_id)
        assert any("[trainer]" in line for line in marked_before), marked_before
        if sig == signal.SIGKILL:
            assert_monitor_restarted(launch)
        else:
            assert_second_rl_refused(tmp_path, starting_model, launch)
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
