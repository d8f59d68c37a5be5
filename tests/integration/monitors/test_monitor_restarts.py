"""One metrics.jsonl row per step across monitor restarts (real monitor processes, real nats-server):
a SIGKILL between writing a row and acking its events, a trainer that republishes a retrained
step, and a clean stop with a row not ready yet."""

import json
import textwrap
import time

import pytest
from monitor_support import make_rl_config, publish_step, read_rows, start_monitor, stop

from rlbus.bus import Bus
from rlbus.wire.events import StepMetrics
from rlbus.wire.weights import WeightsApplied

# The monitor dies by SIGKILL when it acks the first event of step 2's row: the row is written,
# none of its events is acked.
KILL_AT_ACK_OF_STEP_2 = textwrap.dedent(
    """
    import os, signal, sys
    from rlbus.bus import consumer
    from rlbus.wire.events import StepMetrics

    original_ack = consumer.Delivery.ack

    async def ack(self, *, sync=False):
        if isinstance(self.data, StepMetrics) and self.data.step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return await original_ack(self, sync=sync)

    consumer.Delivery.ack = ack
    """
)


def steps_in(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.timeout(180)
async def test_sigkill_between_write_and_ack_then_restart_writes_each_step_once(
    nats_server, tmp_path
):
    config = make_rl_config(nats_server, tmp_path, "monitor-kill")
    metrics = tmp_path / "outputs" / "monitor-kill" / "metrics.jsonl"
    bus = await Bus.connect(config.bus, storage_dir=tmp_path, name="test")
    process = start_monitor(config, tmp_path, prelude=KILL_AT_ACK_OF_STEP_2)
    try:
        for step in (1, 2):
            await publish_step(bus, step)
        process.wait(60)
        assert process.returncode == -9  # died between writing row 2 and acking it
        assert steps_in(metrics) == [1, 2]
        process = start_monitor(config, tmp_path)
        # the trainer retrains step 2 after a resume and republishes its metrics
        await bus.publish(
            bus.subjects.metrics("trainer"),
            StepMetrics(service="trainer", step=2, metrics={"loss": 0.4, "retrained": 1.0}),
            msg_id="t-2-retrained",
        )
        await publish_step(bus, 3)
        rows = read_rows(metrics, 3, timeout_s=60)
        time.sleep(2.0)  # redelivered events of steps 1 and 2 would show up as extra rows here
        assert steps_in(metrics) == [1, 2, 3]
        rows = read_rows(metrics, 3)
        assert rows[1]["loss"] == 0.5 and "retrained" not in rows[1]
        assert rows[2]["reward/mean"] == 0.3 and rows[2]["loss"] == 1.0 / 3
        assert all(row["dead_letters/total"] == 0 for row in rows)
    finally:
        stop(process)
        await bus.close()


@pytest.mark.timeout(180)
async def test_a_row_not_ready_at_a_clean_stop_is_written_once_by_the_next_monitor(
    nats_server, tmp_path
):
    config = make_rl_config(nats_server, tmp_path, "monitor-stop")
    metrics = tmp_path / "outputs" / "monitor-stop" / "metrics.jsonl"
    bus = await Bus.connect(config.bus, storage_dir=tmp_path, name="test")
    s = bus.subjects
    process = start_monitor(config, tmp_path)
    try:
        await publish_step(bus, 1)
        read_rows(metrics, 1, timeout_s=60)
        # step 2: only the orchestrator's half and a weights ack before the monitor stops
        await bus.publish(
            s.metrics("orchestrator"),
            StepMetrics(service="orchestrator", step=2, metrics={"reward/mean": 0.2}),
            msg_id="o-2",
        )
        await bus.publish(
            s.weights_applied, WeightsApplied(version=2, replica_id="r0", duration_s=0.1)
        )
        time.sleep(1.5)  # let the monitor take them in
        stop(process)
        assert steps_in(metrics) == [1]  # no partial row for step 2
        process = start_monitor(config, tmp_path)
        await bus.publish(
            s.metrics("trainer"),
            StepMetrics(service="trainer", step=2, metrics={"loss": 0.5}),
            msg_id="t-2",
        )
        rows = read_rows(metrics, 2, timeout_s=60)
        time.sleep(1.0)
        assert steps_in(metrics) == [1, 2]
        assert rows[1]["reward/mean"] == 0.2 and rows[1]["loss"] == 0.5
        assert rows[1]["weights/applied/r0"] == 2
    finally:
        stop(process)
        await bus.close()


@pytest.mark.timeout(120)
async def test_rows_carry_the_dead_letter_count(nats_server, tmp_path):
    config = make_rl_config(nats_server, tmp_path, "monitor-dead")
    metrics = tmp_path / "outputs" / "monitor-dead" / "metrics.jsonl"
    bus = await Bus.connect(config.bus, storage_dir=tmp_path, name="test")
    s = bus.subjects
    process = start_monitor(config, tmp_path)
    try:
        await publish_step(bus, 1)
        (row,) = read_rows(metrics, 1, timeout_s=60)
        assert row["dead_letters/total"] == 0
        await bus.dead_letter(s.rollouts_stream, s.rollouts, b"\xc1", None, "bad rollout")
        time.sleep(1.2)  # the count is read at most once a second
        await publish_step(bus, 2)
        rows = read_rows(metrics, 2, timeout_s=60)
        assert rows[1]["dead_letters/total"] == 1
    finally:
        stop(process)
        await bus.close()


@pytest.mark.timeout(120)
async def test_a_clean_stop_after_the_finish_writes_rows_missing_a_service(nats_server, tmp_path):
    """Step 2's orchestrator half never comes (its coordinator was killed between the batch and
    its metrics): once the run is finished, the stop writes step 2 with the trainer's half and
    the rows held behind it, instead of dropping them for a next monitor that never starts."""
    config = make_rl_config(nats_server, tmp_path, "monitor-finish")
    metrics = tmp_path / "outputs" / "monitor-finish" / "metrics.jsonl"
    bus = await Bus.connect(config.bus, storage_dir=tmp_path, name="test")
    process = start_monitor(config, tmp_path)
    try:
        await publish_step(bus, 1)
        await bus.publish(
            bus.subjects.metrics("trainer"),
            StepMetrics(service="trainer", step=2, metrics={"loss": 0.5}),
            msg_id="t-2",
        )
        await publish_step(bus, 3)
        read_rows(metrics, 1, timeout_s=60)
        time.sleep(1.5)  # let the monitor take step 3 in; it waits behind step 2
        assert steps_in(metrics) == [1]
        await bus.mark_finished(3)
        stop(process)
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert [row["step"] for row in rows] == [1, 2, 3]
        assert rows[1]["loss"] == 0.5 and "reward/mean" not in rows[1]
    finally:
        stop(process)
        await bus.close()
