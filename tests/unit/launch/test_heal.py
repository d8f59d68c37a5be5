"""`rl`'s healing loop (`rlbus_launch.rl.watch`) with real short-lived processes standing in for
the services: a death is restarted with the same argv and announced; a spent budget or a config
error stops the run with one line naming the service and the setting."""

import signal
import sys
import time

from rlbus.configs import RLConfig
from rlbus.configs.common import SupervisionConfig
from rlbus_launch.plan import Launch
from rlbus_launch.progress import Progress
from rlbus_launch.restarts import RestartPolicy
from rlbus_launch.rl import watch
from rlbus_launch.supervisor import ServiceProcess, Supervisor

DIES_ONCE = """
import os, signal, sys, time
starts = sys.argv[1]
with open(starts, "a") as f:
    f.write("start\\n")
if open(starts).read().count("start") == 1:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(300)
"""

FINISHES_WHEN_MONITOR_CAME_BACK = """
import os, sys, time
starts = sys.argv[1]
while not (os.path.exists(starts) and open(starts).read().count("start") >= 2):
    time.sleep(0.05)
"""


def service(tmp_path, name: str, code: str, *args: str) -> ServiceProcess:
    return ServiceProcess(
        name=name,
        argv=[sys.executable, "-c", code, *args],
        log_path=tmp_path / "logs" / f"{name}.log",
    )


def run_watch(tmp_path, services, **supervision) -> tuple[int, Supervisor]:
    config = RLConfig(supervision=SupervisionConfig(**supervision))
    launch = Launch(config=config, run_dir=tmp_path, processes=services)
    supervisor = Supervisor()
    progress = Progress(tmp_path / "metrics.jsonl", tty=False)
    try:
        for process in services:
            supervisor.start(process)
        began = time.monotonic()
        code = watch(launch, supervisor, progress, RestartPolicy(config.supervision), poll_s=0.05)
        assert time.monotonic() - began < 60
        return code, supervisor
    finally:
        supervisor.stop_all(timeout_s=1)


def test_a_killed_service_is_restarted_and_the_run_finishes(tmp_path, capsys):
    starts = str(tmp_path / "starts")
    monitor = service(tmp_path, "monitor", DIES_ONCE, starts)
    trainer = service(tmp_path, "trainer", FINISHES_WHEN_MONITOR_CAME_BACK, starts)
    code, _ = run_watch(tmp_path, [monitor, trainer], backoff_s=0.2)
    assert code == 0
    out = capsys.readouterr().out
    assert "monitor died (killed by SIGKILL); restarting in 0.2 s (restart 1 of 5 in 600 s)" in out
    assert f"monitor is back (pid {monitor.pid})" in out
    assert open(starts).read().count("start") == 2


def test_a_spent_budget_stops_the_run_with_the_services_code(tmp_path, capsys):
    always = service(tmp_path, "orchestrator", "import sys; sys.exit(7)")
    code, _ = run_watch(tmp_path, [always], max_restarts=2, backoff_s=0.0)
    assert code == 7
    out = capsys.readouterr().out
    assert out.count("orchestrator died (exited with code 7)") == 2
    assert (
        "orchestrator restarted 2 times in 600 s (supervision.max_restarts); giving up; see "
        f"{always.log_path}"
    ) in out


def test_a_config_error_is_never_restarted(tmp_path, capsys):
    bad = service(tmp_path, "inference", "import sys; print('bad field'); sys.exit(2)")
    code, _ = run_watch(tmp_path, [bad])
    assert code == 2
    captured = capsys.readouterr()
    assert "died" not in captured.out
    assert "inference exited with code 2 (a config error)" in captured.out
    assert "bad field" in captured.err


def test_a_service_killed_by_a_signal_ends_the_run_with_128_plus_n(tmp_path, capsys):
    killed = service(tmp_path, "monitor", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    code, _ = run_watch(tmp_path, [killed], enabled=False)
    assert code == 128 + signal.SIGKILL
    assert "monitor killed by SIGKILL; supervision is off" in capsys.readouterr().out
