"""Starting, stopping and reading the monitor process in tests (a real process, a real nats-server)."""

import json
import os
import signal
import subprocess
import sys
import time

from rlbus.configs import BusConfig, RLConfig
from rlbus.configs.base import config_to_toml
from rlbus.wire.events import StepMetrics


def make_rl_config(server, tmp_path, run_name):
    config = RLConfig(
        output_dir=str(tmp_path / "outputs"), bus=BusConfig(url=server.url, token=server.token)
    )
    return config.with_run_name(run_name)


def start_monitor(config, tmp_path, *, prelude: str | None = None, args: tuple[str, ...] = ()):
    """The monitor process on `config` (more flags in `args`); `prelude` (Python source) runs
    first in it (fault injection, e.g. a SIGKILL at a chosen moment)."""
    path = tmp_path / "rl.toml"
    path.write_text(config_to_toml(config))
    if prelude is None:
        argv = [sys.executable, "-m", "rlbus_launch.monitor", "@", str(path)]
    else:
        code = prelude + "\nfrom rlbus_launch.monitor.service import main\nmain(sys.argv[1:])\n"
        argv = [sys.executable, "-c", code, "@", str(path)]
    return subprocess.Popen([*argv, *args], start_new_session=True)


def stop(process):
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)


def read_rows(path, count, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            rows = [json.loads(line) for line in path.read_text().splitlines() if line]
            if len(rows) >= count:
                return rows
        time.sleep(0.1)
    raise AssertionError(f"{path} did not get {count} rows in {timeout_s}s")


async def publish_step(bus, step):
    s = bus.subjects
    await bus.publish(
        s.metrics("orchestrator"),
        StepMetrics(service="orchestrator", step=step, metrics={"reward/mean": step / 10}),
        msg_id=f"o-{step}",
    )
    await bus.publish(
        s.metrics("trainer"),
        StepMetrics(service="trainer", step=step, metrics={"loss": 1.0 / step}),
        msg_id=f"t-{step}",
    )
