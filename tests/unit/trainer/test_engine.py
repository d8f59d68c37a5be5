"""The engine's step: stacking rows per forward pass, one-token padding rows and the shared-prefix
layout change nothing."""

import pytest
import torch
from trainer_support import make_train_batch

from rlbus.configs.trainer import TrainerConfig
from rlbus.wire.batches import MicroBatch, TrainBatch
from rlbus_trainer.engine import build_engine, setup_distributed
from rlbus_trainer.loss import build_loss_fn
from rlbus_trainer.service import rank_micro_batches


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


def first_step(tiny_model, tokens_per_forward, micro_batches, loss=None):
    # SGD with lr 1: weight changes equal the gradients (Adam's first step would amplify float noise).
    config = TrainerConfig(
        model={"name": str(tiny_model)},
        optim={"type": "sgd", "lr": 1.0, "max_norm": None},
        tokens_per_forward=tokens_per_forward,
        loss=loss or {"mask_low": 1.0, "mask_high": 1.0},
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


def reverse_text_like_groups(num_groups=3, group_size=4, seed=0):
    """Groups of one prompt (12-20 tokens) and completions of 1-6 tokens, like reverse-text's."""
    import random

    from rlbus_orchestrator.packing import TrainSample

    rng = random.Random(seed)
    groups = []
    for g in range(num_groups):
        prompt = [rng.randrange(3, 200) for _ in range(rng.randint(12, 20))]
        samples = []
        for _ in range(group_size):
            completion = [rng.randrange(3, 200) for _ in range(rng.randint(1, 6))]
            n, c = len(prompt), len(completion)
            samples.append(
                TrainSample(
                    input_ids=prompt + completion,
                    loss_mask=[0] * n + [1] * c,
                    inference_logprobs=[0.0] * n + [rng.uniform(-6.0, -4.0) for _ in completion],
                    advantage=rng.uniform(-1, 1),
                    temperature=0.5 + 0.25 * g,
                )
            )
        groups.append(samples)
    return groups


# Per-sample losses see the same samples in both layouts (LossInputs.sample_ids, num_global_samples).
# GSPO's clip range is widened: the tiny model is far from the inference logprobs, and a clipped
# sample has no gradient to compare.
LOSSES = {
    "default": None,
    "dr_grpo": {"type": "dr_grpo", "max_tokens": 6},
    "gspo": {"type": "gspo", "eps_low": 0.99, "eps_high": 1e9},
}


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("seq_len", [64, 40], ids=["one-row-per-group", "prompts-repeated"])
def test_shared_prefixes_give_the_loss_and_gradients_of_one_sequence_per_sample(
    tiny_model, seq_len, loss
):
    from rlbus_orchestrator.packing import group_sequences, pack

    groups = reverse_text_like_groups()

    def step(share: bool):
        sequences = group_sequences(groups, seq_len, share_prefixes=share)
        (micro_batches,) = pack(sequences, seq_len=seq_len, num_ranks=1)
        tokens = sum(len(mb.input_ids) for mb in micro_batches)
        return *first_step(tiny_model, 4096, micro_batches, LOSSES[loss]), tokens

    plain, w_plain, plain_tokens = step(False)
    shared, w_shared, shared_tokens = step(True)
    assert shared_tokens < 0.6 * plain_tokens
    assert shared.num_loss_tokens == plain.num_loss_tokens
    assert shared.loss == pytest.approx(plain.loss, rel=1e-5, abs=1e-7)
    for key in ("entropy", "mismatch_kl"):
        assert shared.metrics[key] == pytest.approx(plain.metrics[key], rel=1e-5), key
    for name in w_plain:
        torch.testing.assert_close(w_shared[name], w_plain[name], atol=1e-6, rtol=1e-5, msg=name)
