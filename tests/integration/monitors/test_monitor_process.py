"""The monitor as a real process against a real nats-server: events in, metrics.jsonl out."""

import time

import pytest
from monitor_support import make_rl_config, publish_step, read_rows, start_monitor, stop

from rlbus.bus import Bus


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


@pytest.mark.timeout(120)
async def test_with_exit_when_finished_the_monitor_writes_the_last_row_then_exits_zero(
    nats_server, tmp_path
):
    config = make_rl_config(nats_server, tmp_path, "monitor-finish")
    metrics = tmp_path / "outputs" / "monitor-finish" / "metrics.jsonl"
    bus = await Bus.connect(config.bus, storage_dir=tmp_path, name="test")
    process = start_monitor(config, tmp_path, args=("--exit-when-finished",))
    try:
        for step in (1, 2):
            await publish_step(bus, step)
        read_rows(metrics, 2)
        await bus.mark_finished(3)  # finished before step 3's row: the monitor waits for it
        time.sleep(2.0)
        assert process.poll() is None
        await publish_step(bus, 3)
        assert process.wait(timeout=30) == 0
        assert [r["step"] for r in read_rows(metrics, 3)] == [1, 2, 3]
    finally:
        stop(process)
        await bus.close()
