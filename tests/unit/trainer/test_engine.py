"""The engine's step: stacking rows per forward pass and one-token padding rows change nothing."""

import pytest
import torch

from rlbus.configs.trainer import TrainerConfig
from rlbus.wire.batches import MicroBatch, TrainBatch
from rlbus_trainer.engine import build_engine, setup_distributed
from rlbus_trainer.loss import build_loss_fn
from rlbus_trainer.service import rank_micro_batches
from rlbus_trainer.testing import make_train_batch


def one_token_padding() -> MicroBatch:
    return MicroBatch(
        input_ids=[0],
        position_ids=[0],
        loss_mask=[0],
        advantages=[0.0],
        inference_logprobs=[0.0],
        temperatures=[1.0],
        seq_lens=[1],
    )


def first_step(tiny_model, tokens_per_forward, micro_batches):
    # SGD with lr 1: weight changes equal the gradients (Adam's first step would amplify float noise).
    config = TrainerConfig(
        model={"name": str(tiny_model)},
        optim={"type": "sgd", "lr": 1.0, "max_norm": None},
        tokens_per_forward=tokens_per_forward,
        loss={"mask_low": 1.0, "mask_high": 1.0},
    )
    engine = build_engine(config, setup_distributed())
    result = engine.train_step(micro_batches, build_loss_fn(config.loss))
    return result, {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def test_rows_stacked_per_forward_match_one_row_per_forward(tiny_model):
    rows = make_train_batch(1, num_ranks=3, num_sequences=4).micro_batches
    micro_batches = [mbs[0] for mbs in rows] + [one_token_padding()]
    one, w_one = first_step(tiny_model, 1, micro_batches)  # every row alone
    stacked, w_stacked = first_step(tiny_model, 4096, micro_batches)  # all in one pass
    assert stacked.loss == pytest.approx(one.loss, rel=1e-5, abs=1e-7)
    assert stacked.metrics["entropy"] == pytest.approx(one.metrics["entropy"], rel=1e-5)
    assert (
        stacked.num_loss_tokens
        == one.num_loss_tokens
        == sum(sum(mb.loss_mask) for mb in micro_batches)
    )
    for name in w_one:
        torch.testing.assert_close(w_stacked[name], w_one[name], atol=1e-6, rtol=1e-5, msg=name)


def test_batch_packed_for_other_world_size_is_resplit_round_robin():
    batch = make_train_batch(1, num_ranks=3)
    assert isinstance(batch, TrainBatch)
    flat = [mbs[0] for mbs in batch.micro_batches]
    assert rank_micro_batches(batch, 0, 2) == [flat[0], flat[2]]
    assert rank_micro_batches(batch, 1, 2) == [flat[1]]
    assert rank_micro_batches(batch, 2, 3) == [flat[2]]
