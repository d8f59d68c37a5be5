"""`loss.type = "custom"`: a user function by import path trains a real step (engine + model +
optimizer), gets its kwargs and the step's token and sample counts, and decides the update."""

import pytest
from trainer_support import CUSTOM_LOSS_CALLS, make_train_batch

from rlbus.configs.trainer import TrainerConfig
from rlbus_trainer.engine import build_engine, setup_distributed
from rlbus_trainer.loss import build_loss_fn


def one_step(tiny_model, loss: dict):
    config = TrainerConfig(
        model={"name": str(tiny_model)},
        optim={"type": "sgd", "lr": 1.0, "max_norm": None},
        loss=loss,
        tokens_per_forward=1,  # one row per forward pass: two calls for two rows
    )
    engine = build_engine(config, setup_distributed())
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    micro_batches = make_train_batch(1, num_ranks=2, num_sequences=4).micro_batches
    rows = [mbs[0] for mbs in micro_batches]
    result = engine.train_step(rows, build_loss_fn(config.loss))
    moved = max(
        float((p.detach() - before[n]).abs().max()) for n, p in engine.model.named_parameters()
    )
    return result, moved, sum(sum(mb.loss_mask) for mb in rows)


def test_custom_loss_function_trains_the_step(tiny_model):
    CUSTOM_LOSS_CALLS.clear()
    path = "trainer_support:recording_loss"
    result, moved, num_loss = one_step(
        tiny_model, {"type": "custom", "import_path": path, "kwargs": {"scale": 2.0}}
    )
    assert [c["scale"] for c in CUSTOM_LOSS_CALLS] == [2.0, 2.0]
    assert all(c["num_global_tokens"] == num_loss for c in CUSTOM_LOSS_CALLS)
    assert all(c["num_global_samples"] == 8 for c in CUSTOM_LOSS_CALLS)  # 2 rows x 4 sequences
    assert [c["num_samples"] for c in CUSTOM_LOSS_CALLS] == [4, 4]
    assert result.metrics["custom_calls"] == 2
    assert moved > 0

    # scale 0: the function's zero loss is what trains (nothing moves), not the default loss.
    _, moved, _ = one_step(
        tiny_model, {"type": "custom", "import_path": path, "kwargs": {"scale": 0.0}}
    )
    assert moved == 0


def test_custom_loss_result_is_the_functions_loss(tiny_model):
    path = "trainer_support:recording_loss"
    one, _, _ = one_step(tiny_model, {"type": "custom", "import_path": path})
    two, _, _ = one_step(
        tiny_model, {"type": "custom", "import_path": path, "kwargs": {"scale": 2.0}}
    )
    assert one.loss != 0
    assert two.loss == pytest.approx(2 * one.loss, rel=1e-6)
    assert two.grad_norm == pytest.approx(2 * one.grad_norm, rel=1e-5)
