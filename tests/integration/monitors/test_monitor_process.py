"""The monitor as a real process against a real nats-server: events in, metrics.jsonl out."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rlbus.bus import Bus
from rlbus.configs import BusConfig, RLConfig
from rlbus.configs.base import config_to_toml
from rlbus.wire.events import StepMetrics


def make_rl_config(server, tmp_path, run_name):
    config = RLConfig(
        output_dir=str(tmp_path / "outputs"), bus=BusConfig(url=server.url, token=server.token)
    )
    return config.with_run_name(run_name)


def start_monitor(config, tmp_path):
    path = tmp_path / "rl.toml"
    path.write_text(config_to_toml(config))
    return subprocess.Popen(
        [sys.executable, "-m", "rlbus.monitors", "@", str(path)], start_new_session=True
    )


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


@pytest.mark.timeout(120)
async def test_monitor_writes_joined_rows_and_resumes_without_duplicates(nats_server, tmp_path):
    config = make_rl_config(nats_server, tmp_path, "monitor-test")
    metrics = tmp_path / "outputs" / "monitor-test" / "metrics.jsonl"
    bus = await Bus.connect(config.bus, storage_dir=tmp_path, name="test")
    process = start_monitor(config, tmp_path)
    try:
        for step in (1, 2, 3):
            await publish_step(bus, step)
        rows = read_rows(metrics, 3)
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert rows[1]["reward/mean"] == 0.2 and rows[1]["loss"] == 0.5
        stop(process)
        # events published while the monitor is down are picked up by the next one, once
        await publish_step(bus, 4)
        process = start_monitor(config, tmp_path)
        rows = read_rows(metrics, 4)
        time.sleep(1.0)
        rows = read_rows(metrics, 4)
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
    finally:
        stop(process)
        await bus.close()
