"""A custom loss (`loss.type = "custom"`) trains the RL trainer service's step over a real
nats-server: the function's own metric reaches the step metrics, so it was the loss used."""

from pathlib import Path

import pytest
from test_trainer_service import ranks_exit, read_step_metrics, trainer_run
from trainer_support import make_train_batch, start_ranks

TESTS = Path(__file__).resolve().parents[2]


@pytest.mark.slow
async def test_the_trainer_service_trains_a_step_with_a_custom_loss(
    make_bus, nats_server, tmp_path, monkeypatch
):
    monkeypatch.setenv("PYTHONPATH", str(TESTS))  # the ranks import trainer_support from here
    loss = {
        "type": "custom",
        "import_path": "trainer_support:recording_loss",
        "kwargs": {"scale": 2.0},
    }
    bus, config = await trainer_run(
        make_bus, nats_server, tmp_path, "custom", max_steps=1, loss=loss, tokens_per_forward=1
    )
    await bus.step_log.publish(make_train_batch(1, num_ranks=2))  # two rows: two calls
    proc = start_ranks(tmp_path, config, 1, "trainer")
    await ranks_exit(tmp_path, proc, config, "trainer", timeout_s=300)

    (step,) = await read_step_metrics(bus)
    assert step.step == 1
    assert step.metrics["custom_calls"] == 2  # one per forward pass, summed over the step
    assert "masked_low_frac" not in step.metrics  # the default loss did not run
    assert step.metrics["grad_norm"] > 0
