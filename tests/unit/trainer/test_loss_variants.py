"""The loss registry (`trainer.loss.type`): Dr. GRPO, GSPO, DAPO and the reference-KL term against
values worked out by hand in the comments, and the per-token sample index the engine derives.

Ratios are set directly: inference logprobs 0 and trainer logprobs log(r), so exp(log_ratio) = r.
"""

import math

import pytest
import torch

from rlbus.configs.trainer import (
    DAPOLossConfig,
    DefaultLossConfig,
    DrGRPOLossConfig,
    GSPOLossConfig,
)
from rlbus.wire.batches import MicroBatch
from rlbus_trainer.loss import LossInputs, build_loss_fn, num_loss_samples, sample_ids_of


def make_inputs(ratios, advantages, loss_mask, **fields) -> LossInputs:
    return LossInputs(
        trainer_logprobs=torch.tensor(ratios, dtype=torch.float64).log().requires_grad_(True),
        inference_logprobs=torch.zeros(len(ratios), dtype=torch.float64),
        advantages=torch.tensor(advantages, dtype=torch.float64),
        loss_mask=torch.tensor(loss_mask, dtype=torch.bool),
        **fields,
    )


def loss_and_grad(config, inputs, num_global_tokens):
    loss, metrics = build_loss_fn(config)(inputs, num_global_tokens)
    (grad,) = torch.autograd.grad(loss, inputs.trainer_logprobs)
    return float(loss.detach()), grad.tolist(), {k: float(v) for k, v in metrics.items()}


def test_dr_grpo_sums_clipped_token_losses_over_samples_times_max_tokens():
    # eps 0.2, clip range [0.8, 1.2]; loss_t = -min(r A, clip(r) A):
    #   r 1.5, A  1: min(1.5, 1.2)   = 1.2  -> -1.2  clipped (gradient 0)
    #   r 0.5, A  1: min(0.5, 0.8)   = 0.5  -> -0.5  d/dlogp = -r A = -0.5
    #   r 1.1, A -1: min(-1.1, -1.1) = -1.1 ->  1.1  d/dlogp = -r A = 1.1
    #   r 2.0: not a loss token
    # sum = -0.6, / (2 samples x 5 max_tokens) = -0.06; gradients / 10.
    inputs = make_inputs([1.5, 0.5, 1.1, 2.0], [1, 1, -1, -1], [1, 1, 1, 0], num_global_samples=2)
    config = DrGRPOLossConfig(clip_eps=0.2, max_tokens=5)
    loss, grad, metrics = loss_and_grad(config, inputs, num_global_tokens=3)
    assert loss == pytest.approx(-0.06)
    assert grad == pytest.approx([0.0, -0.05, 0.11, 0.0])
    assert metrics["clipped_frac"] == pytest.approx(1 / 3)  # one of 3 loss tokens


def test_dr_grpo_does_not_normalise_by_sample_length():
    # On-policy (r = 1), A = 1 on every token: each token adds -1 / (samples x max_tokens), so a
    # sample twice as long weighs twice as much (a per-sample mean would weigh both the same).
    short = make_inputs([1.0] * 2, [1.0] * 2, [1] * 2, num_global_samples=1)
    long = make_inputs([1.0] * 4, [1.0] * 4, [1] * 4, num_global_samples=1)
    config = DrGRPOLossConfig(max_tokens=8)
    assert loss_and_grad(config, short, 2)[0] == pytest.approx(-2 / 8)
    assert loss_and_grad(config, long, 4)[0] == pytest.approx(-4 / 8)


def test_dapo_clips_higher_above_than_below_and_averages_over_loss_tokens():
    # eps_low 0.2, eps_high 0.28: clip range [0.8, 1.28].
    #   r 1.25, A  1: inside (a symmetric 0.2 clip would cut it) -> -1.25, d/dlogp = -1.25
    #   r 1.30, A  1: min(1.3, 1.28) = 1.28 -> -1.28 clipped
    #   r 0.75, A -1: min(-0.75, -0.8) = -0.8 -> 0.8 clipped
    #   r 0.90, A -1: min(-0.9, -0.9) -> 0.9, d/dlogp = 0.9
    # sum = -0.83, / 5 loss tokens of the step (one more elsewhere) = -0.166.
    inputs = make_inputs([1.25, 1.3, 0.75, 0.9], [1, 1, -1, -1], [1, 1, 1, 1])
    loss, grad, metrics = loss_and_grad(DAPOLossConfig(), inputs, num_global_tokens=5)
    assert loss == pytest.approx(-0.166)
    assert grad == pytest.approx([-0.25, 0.0, 0.0, 0.18])
    assert metrics["clipped_frac"] == pytest.approx(2 / 5)
    symmetric = make_inputs([1.25], [1.0], [1])
    _, grad, _ = loss_and_grad(DAPOLossConfig(eps_high=0.2), symmetric, 1)
    assert grad == [0.0]  # 1.25 > 1.2: clipped under a symmetric range


def test_gspo_uses_one_clipped_ratio_per_sample_and_averages_over_samples():
    # Sample 0: log ratios 0.1, 0.3 -> mean 0.2, s0 = e^0.2 = 1.2214 > 1 + 4e-4, A = 1:
    #   -min(1.2214, 1.0004) = -1.0004, clipped (gradient 0).
    # Sample 1: log ratios -2e-4, 1e-4, -2e-4 (and a prompt token, log ratio 5, outside the loss)
    #   -> mean -1e-4, s1 = e^-1e-4 = 0.999900005, inside [0.9997, 1.0004], A = -2:
    #   -min(-2 s1, -2 clip(s1)) = 2 s1 = 1.99980001; d/dlogp_t = 2 s1 / 3 per loss token.
    # Sample 2: prompt only. Step: 4 samples with loss tokens (one more on another rank).
    # loss = (-1.0004 + 1.99980001) / 4 = 0.2498500025; sample 1's gradients 2 s1 / 3 / 4.
    log_ratios = [0.1, 0.3, 5.0, -2e-4, 1e-4, -2e-4, 0.7]
    inputs = LossInputs(
        trainer_logprobs=torch.tensor(log_ratios, dtype=torch.float64).requires_grad_(True),
        inference_logprobs=torch.zeros(7, dtype=torch.float64),
        advantages=torch.tensor([1, 1, 0, -2, -2, -2, 0], dtype=torch.float64),
        loss_mask=torch.tensor([1, 1, 0, 1, 1, 1, 0], dtype=torch.bool),
        sample_ids=torch.tensor([0, 0, 1, 1, 1, 1, 2]),
        num_global_samples=4,
    )
    loss, grad, metrics = loss_and_grad(GSPOLossConfig(), inputs, num_global_tokens=6)
    assert loss == pytest.approx(0.2498500025, abs=1e-9)
    g = 2 * math.exp(-1e-4) / 3 / 4  # 0.16665000083
    assert grad == pytest.approx([0.0, 0.0, 0.0, g, g, g, 0.0], abs=1e-9)
    assert metrics["clipped_frac"] == pytest.approx(1 / 4)


def test_reference_kl_adds_k3_per_loss_token_to_any_loss():
    # On-policy with zero advantages the default loss is 0; the reference term alone remains.
    # x = logp_ref - logp_train: ln(0.25/0.5) = -ln 2 on token 0, 0 on token 1.
    # k3 = e^x - 1 - x = 0.5 - 1 + ln 2 = 0.19314718, and 0; mean over 2 loss tokens = 0.09657359.
    # loss = 0.1 x 0.09657359; d k3 / d logp_train = 1 - e^x = 0.5 -> gradient 0.1 x 0.5 / 2.
    trainer = torch.tensor([0.5, 0.25]).log().requires_grad_(True)
    inputs = LossInputs(
        trainer_logprobs=trainer,
        inference_logprobs=trainer.detach().clone(),
        advantages=torch.zeros(2),
        loss_mask=torch.tensor([True, True]),
        reference_logprobs=torch.tensor([0.25, 0.25]).log(),
    )
    loss, grad, metrics = loss_and_grad(DefaultLossConfig(ref_kl_coef=0.1), inputs, 2)
    assert metrics["ref_kl"] == pytest.approx(0.09657359, abs=1e-7)
    assert loss == pytest.approx(0.009657359, abs=1e-8)
    assert grad == pytest.approx([0.025, 0.0], abs=1e-7)
    without, _, metrics = loss_and_grad(DefaultLossConfig(), inputs, 2)
    assert without == 0 and "ref_kl" not in metrics


@pytest.mark.parametrize("config", [DrGRPOLossConfig(), GSPOLossConfig(), DAPOLossConfig()])
def test_every_builtin_loss_takes_the_reference_kl_term(config):
    inputs = make_inputs([1.0, 1.0], [0.0, 0.0], [1, 1], num_global_samples=1)
    inputs.sample_ids = torch.tensor([0, 0])
    inputs.reference_logprobs = torch.tensor([0.5, 1.0], dtype=torch.float64).log()
    with_kl = config.model_copy(update={"ref_kl_coef": 1.0})
    # x = ln 0.5 on token 0: k3 = 0.19314718, / 2 tokens; A = 0 leaves the KL term alone.
    assert loss_and_grad(with_kl, inputs, 2)[0] == pytest.approx(0.19314718 / 2)


def plain_and_shared_micro_batches():
    # Shared prefix: prompt 0-2, completion A = tokens 3, 4 (3's parent is 2), completion B =
    # token 5 (parent 2); then a second sequence, prompt 6-7 with one completion, token 8.
    shared = MicroBatch(
        input_ids=list(range(9)),
        position_ids=[0, 1, 2, 3, 4, 3, 0, 1, 2],
        loss_mask=[0, 0, 0, 1, 1, 1, 0, 0, 1],
        advantages=[0.0] * 9,
        inference_logprobs=[0.0] * 9,
        temperatures=[1.0] * 9,
        seq_lens=[6, 3],
        parent_ids=[-1, 0, 1, 2, 3, 2, -1, 6, 7],
    )
    plain = MicroBatch(
        input_ids=list(range(5)),
        position_ids=[0, 1, 0, 1, 2],
        loss_mask=[0, 1, 0, 1, 1],
        advantages=[0.0] * 5,
        inference_logprobs=[0.0] * 5,
        temperatures=[1.0] * 5,
        seq_lens=[2, 3],
    )
    return plain, shared


def test_sample_ids_follow_sequences_and_shared_prefix_branches():
    plain, shared = plain_and_shared_micro_batches()
    assert sample_ids_of(plain) == [0, 0, 1, 1, 1]
    # Token 2 has two children (3 and 5): each starts a sample; token 7 has one, so the second
    # sequence's completion stays in its prompt's sample.
    assert sample_ids_of(shared) == [0, 0, 0, 1, 1, 2, 3, 3, 3]
    assert num_loss_samples(plain) == 2
    assert num_loss_samples(shared) == 3  # samples 1, 2, 3; sample 0 is the shared prompt
