"""The monitor process with `--monitors.wandb.offline`: step events published on a real bus end up
in one offline wandb run under the run directory, finished when the monitor is stopped."""

import pytest
from monitor_support import make_rl_config, publish_step, read_rows, start_monitor, stop
from wandb_support import offline_runs, use_offline_wandb

from rlbus.bus import Bus

WANDB_ARGS = ("--monitors.wandb.offline", "--monitors.wandb.group", "sweep-1")


@pytest.mark.timeout(120)
async def test_monitor_logs_bus_events_into_one_offline_wandb_run_across_restarts(
    nats_server, tmp_path, monkeypatch
):
    use_offline_wandb(monkeypatch, tmp_path)  # the monitor process inherits it
    config = make_rl_config(nats_server, tmp_path, "monitor-wandb")
    run_dir = tmp_path / "outputs" / "monitor-wandb"
    bus = await Bus.connect(config.bus, storage_dir=tmp_path, name="test")
    process = start_monitor(config, tmp_path, args=WANDB_ARGS)
    try:
        for step in (1, 2, 3):
            await publish_step(bus, step)
        read_rows(run_dir / "metrics.jsonl", 3)
        stop(process)  # SIGTERM: the monitor finishes the wandb run
        assert process.returncode == 0
        await publish_step(bus, 4)
        process = start_monitor(config, tmp_path, args=WANDB_ARGS)
        read_rows(run_dir / "metrics.jsonl", 4)
        stop(process)
        assert process.returncode == 0
    finally:
        stop(process)
        await bus.close()

    first, second = offline_runs(run_dir)
    assert first.exit_code == 0 and second.exit_code == 0
    assert first.run["run_id"] == second.run["run_id"]  # one wandb run for the whole RL run
    assert first.run["display_name"] == "monitor-wandb" and first.run["run_group"] == "sweep-1"
    assert first.config["run"]["name"] == "monitor-wandb"  # the resolved run config
    assert first.config["monitors"]["wandb"]["offline"] is True
    history = first.history | second.history
    assert sorted(history) == [1, 2, 3, 4]
    for step, values in history.items():
        assert values["orchestrator/reward/mean"] == pytest.approx(step / 10)
        assert values["trainer/loss"] == pytest.approx(1.0 / step)
        assert values["dead_letters/total"] == 0
