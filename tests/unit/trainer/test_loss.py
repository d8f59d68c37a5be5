"""The RL loss math: on-policy equals plain policy gradient, masking thresholds, token normalisation."""

import pytest
import torch

from rlbus_trainer.attention import block_causal_mask
from rlbus_trainer.loss import (
    LossInputs,
    default_loss,
    token_logprobs_and_entropy,
)


def make_inputs(num_tokens=12, seed=0, on_policy=True):
    gen = torch.Generator().manual_seed(seed)
    trainer = (torch.rand(num_tokens, generator=gen) * -2.0).requires_grad_(True)
    inference = (
        trainer.detach().clone() if on_policy else torch.rand(num_tokens, generator=gen) * -2.0
    )
    advantages = torch.randn(num_tokens, generator=gen)
    loss_mask = torch.rand(num_tokens, generator=gen) > 0.3
    return LossInputs(trainer, inference, advantages, loss_mask)


def test_on_policy_gradient_equals_plain_policy_gradient():
    inputs = make_inputs()
    num_tokens = int(inputs.loss_mask.sum())
    loss, metrics = default_loss(inputs, num_tokens, mask_low=0.2, mask_high=0.2, kl_tau=0.5)
    (grad,) = torch.autograd.grad(loss, inputs.trainer_logprobs)
    expected = -inputs.advantages * inputs.loss_mask / num_tokens
    torch.testing.assert_close(grad, expected)
    assert metrics["masked_low_frac"] == 0 and metrics["masked_high_frac"] == 0
    assert abs(float(metrics["mismatch_kl"])) < 1e-7


def test_masking_removes_exactly_tokens_beyond_thresholds():
    p_inference = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
    p_train = torch.tensor([0.25, 0.31, 0.5, 0.69, 0.75, 0.05])
    inputs = LossInputs(
        p_train.log().requires_grad_(True),
        p_inference.log(),
        torch.ones(6),
        torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.bool),
    )
    loss, metrics = default_loss(inputs, 5, mask_low=0.2, mask_high=0.2)
    (grad,) = torch.autograd.grad(loss, inputs.trainer_logprobs)
    # 0.25 < 0.5-0.2 (low) and 0.75 > 0.5+0.2 (high) are masked; 0.05 is not a loss token.
    assert (grad != 0).tolist() == [False, True, True, True, False, False]
    assert float(metrics["masked_low_frac"]) * 5 == pytest.approx(1)
    assert float(metrics["masked_high_frac"]) * 5 == pytest.approx(1)


def test_token_normalisation_is_independent_of_micro_batch_split():
    inputs = make_inputs(num_tokens=30, on_policy=False)
    num_global = int(inputs.loss_mask.sum())
    whole, _ = default_loss(inputs, num_global, kl_tau=0.1)
    (whole_grad,) = torch.autograd.grad(whole, inputs.trainer_logprobs)

    # Same tokens split unevenly into 3 micro-batches (as if on different ranks), summed.
    total = 0.0
    for part in (slice(0, 4), slice(4, 19), slice(19, 30)):
        piece = LossInputs(
            inputs.trainer_logprobs[part],
            inputs.inference_logprobs[part],
            inputs.advantages[part],
            inputs.loss_mask[part],
        )
        total = total + default_loss(piece, num_global, kl_tau=0.1)[0]
    (split_grad,) = torch.autograd.grad(total, inputs.trainer_logprobs)
    torch.testing.assert_close(total, whole)
    torch.testing.assert_close(split_grad, whole_grad)


def test_logprobs_use_each_tokens_temperature():
    logits = torch.randn(4, 7)
    ids = torch.tensor([1, 2, 3, 4])
    temps = torch.tensor([1.0, 0.5, 1.0, 2.0])
    logprobs, entropy = token_logprobs_and_entropy(logits, ids, temps)
    assert logprobs[0] == 0
    expected = torch.log_softmax(logits[0] / 0.5, -1)[2]
    torch.testing.assert_close(logprobs[1], expected)
    expected = torch.log_softmax(logits[2] / 2.0, -1)[4]
    torch.testing.assert_close(logprobs[3], expected)
    assert (entropy[1:] > 0).all()


def test_block_causal_mask_separates_packed_sequences():
    mask = block_causal_mask([2, 3])[0, 0]
    assert mask.shape == (5, 5)
    assert mask[1, 0] and not mask[2, 1] and mask[4, 2] and not mask[0, 1]
