"""RL losses (a registry keyed by `trainer.loss.type`, docs/algorithms.md) and the per-token
logprob/entropy and attention-mask helpers they share with the engine.

    default   importance-weighted PG, trust region by probability difference (below)
    dr_grpo   PPO clipped ratio, token sum / (samples x max_tokens): no length normalisation
    gspo      one clipped importance ratio per sample, mean over the step's samples
    dapo      PPO clipped ratio with clip-higher, token sum / loss tokens
    custom    `package.module:function`, same signature as the built-ins (plus kwargs)

Every type may add `ref_kl_coef` x the k3 estimate of KL(trainer || reference) per loss token
(`with_reference_kl`), the reference logprobs coming from the engine's reference model.

The default loss, for every completion token t (loss_mask = 1) of a packed micro-batch:

    log_ratio_t = logp_train(t) - logp_inference(t)          # trainer logits divided by t's temperature
    ratio_t     = exp(log_ratio_t)
    masked_low  = p_train(t) < p_inference(t) - mask_low     # probability difference, not ratio clipping
    masked_high = p_train(t) > p_inference(t) + mask_high
    loss_t      = -ratio_t * advantage_t + kl_tau * log_ratio_t^2     (kept tokens only)

    loss = sum_t loss_t / num_global_tokens

`num_global_tokens` is the number of loss tokens of the whole step, summed over every micro-batch
of every data-parallel rank, so the summed loss (and its gradient) does not depend on how tokens
are split into micro-batches and ranks. Metrics are returned as sums over the same normaliser.

Per-sample losses need the step's sample count the same way: `LossInputs.num_global_samples`
counts the samples with a loss token over every micro-batch and rank, and `sample_ids` says which
sample each token belongs to (unique within one LossInputs).

`build_loss_fn(config)` returns the configured loss as `fn(inputs, num_global_tokens)`; a user
function has the signature of `default_loss` (plus the config's kwargs).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rlbus.configs.trainer import (
    DAPOLossConfig,
    DefaultLossConfig,
    DrGRPOLossConfig,
    GSPOLossConfig,
    LossConfig,
)
from rlbus.wire.batches import MicroBatch


@dataclass
class LossInputs:
    """Per-token tensors of one micro-batch, all of shape [T] (flat, packed)."""

    trainer_logprobs: torch.Tensor
    inference_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    """bool"""
    entropy: torch.Tensor | None = None
    sample_ids: torch.Tensor | None = None
    """long: the sample each token belongs to, numbered 0.. within this LossInputs (the engine
    fills it from `seq_lens`/`parent_ids`, `sample_ids_of`)."""
    num_global_samples: int = 0
    """Samples with at least one loss token in the whole step (every micro-batch and rank)."""
    reference_logprobs: torch.Tensor | None = None
    """Logprob of each token under the reference model (no grad); set when `ref_kl_coef` > 0."""


class LossFn(Protocol):
    def __call__(
        self, inputs: LossInputs, num_global_tokens: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Return (loss to backprop, metric sums already divided by num_global_tokens)."""


def sample_ids_of(mb: MicroBatch) -> list[int]:
    """The sample index of each token of a packed micro-batch, 0.. in order of appearance.

    Plain layout: each sequence of `seq_lens` is one sample. Shared-prefix layout (`parent_ids`):
    a token starts a new sample when it starts its sequence or its parent has several children
    (the prompt's last token is the parent of each completion's first); every other token
    belongs to its parent's sample. A prompt shared by several completions therefore gets a
    sample index of its own, which holds no loss token.
    """
    if not mb.parent_ids:
        return [i for i, n in enumerate(mb.seq_lens) for _ in range(n)]
    num_children = [0] * len(mb.parent_ids)
    for parent in mb.parent_ids:
        if parent >= 0:
            num_children[parent] += 1
    ids: list[int] = []
    next_id = 0
    for parent in mb.parent_ids:
        if parent < 0 or num_children[parent] > 1:
            ids.append(next_id)
            next_id += 1
        else:
            ids.append(ids[parent])
    return ids


def num_loss_samples(mb: MicroBatch) -> int:
    """Samples of a micro-batch with at least one loss token."""
    return len({s for s, m in zip(sample_ids_of(mb), mb.loss_mask, strict=True) if m})


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    temperatures: torch.Tensor,
    parents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob and entropy of each token under its parent's logits / the token's temperature;
    [T] each, 0 for a token without a parent (a sequence's first).

    logits: [T, V]; input_ids, temperatures: [T]; parents: [T] long, index of the token whose
    logits predict this one, -1 for none (None: token i follows token i - 1 for every i > 0, no
    gather copy of the logits; packed plain sequences take this path, their first tokens are
    outside the loss).
    """
    if parents is None:
        scaled = logits[:-1].float() / temperatures[1:, None].clamp_min(1e-6)  # [T-1, V]
        logp_all = torch.log_softmax(scaled, dim=-1)  # [T-1, V]
        logprobs = logp_all.gather(-1, input_ids[1:, None]).squeeze(-1)  # [T-1]
        entropy = -(logp_all.exp() * logp_all).sum(-1)  # [T-1]
        zero = logprobs.new_zeros(1)
        return torch.cat([zero, logprobs]), torch.cat([zero, entropy.detach()])
    has_parent = parents >= 0
    rows = parents.clamp_min(0)
    scaled = logits[rows].float() / temperatures[:, None].clamp_min(1e-6)  # [T, V]
    logp_all = torch.log_softmax(scaled, dim=-1)  # [T, V]
    logprobs = logp_all.gather(-1, input_ids[:, None]).squeeze(-1)  # [T]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [T]
    zero = torch.zeros_like(logprobs)
    return torch.where(has_parent, logprobs, zero), torch.where(has_parent, entropy.detach(), zero)


def default_loss(
    inputs: LossInputs,
    num_global_tokens: int,
    *,
    mask_low: float = 0.2,
    mask_high: float = 0.2,
    kl_tau: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The default RL loss of one micro-batch (see the module docstring)."""
    mask = inputs.loss_mask.bool()
    log_ratio = inputs.trainer_logprobs - inputs.inference_logprobs  # [T]
    ratio = torch.exp(log_ratio)
    p_train = inputs.trainer_logprobs.detach().exp()
    p_inference = inputs.inference_logprobs.exp()
    masked_low = mask & (p_train < p_inference - mask_low)
    masked_high = mask & (p_train > p_inference + mask_high)
    keep = mask & ~masked_low & ~masked_high
    per_token = -ratio * inputs.advantages + kl_tau * log_ratio**2
    denom = max(num_global_tokens, 1)
    loss = (per_token * keep).sum() / denom
    with torch.no_grad():
        metrics = token_metrics(inputs, denom)
        metrics["masked_low_frac"] = masked_low.sum() / denom
        metrics["masked_high_frac"] = masked_high.sum() / denom
    return loss, metrics


def token_metrics(inputs: LossInputs, denom: int) -> dict[str, torch.Tensor]:
    """Metrics every built-in loss reports, as sums over loss tokens / `denom`."""
    mask = inputs.loss_mask.bool()
    x = (inputs.trainer_logprobs - inputs.inference_logprobs).detach()
    # k3 estimator of KL(inference || trainer): exp(x) - 1 - x with x = log_ratio.
    metrics = {"mismatch_kl": ((torch.exp(x) - 1 - x) * mask).sum() / denom}
    if inputs.entropy is not None:
        metrics["entropy"] = (inputs.entropy * mask).sum() / denom
    return metrics


def clipped_objective(
    ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic term -min(r * A, clip(r, low, high) * A), elementwise, and a bool of
    where the clipped side is the smaller one (its gradient is then 0)."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(low, high) * advantages
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).detach()


def dr_grpo_loss(
    inputs: LossInputs, num_global_tokens: int, *, clip_eps: float = 0.2, max_tokens: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dr. GRPO: token-level clipped objective, summed and divided by the constant
    num_global_samples x max_tokens (no per-sample length normalisation)."""
    mask = inputs.loss_mask.bool()
    ratio = torch.exp(inputs.trainer_logprobs - inputs.inference_logprobs)  # [T]
    per_token, clipped = clipped_objective(ratio, inputs.advantages, 1 - clip_eps, 1 + clip_eps)
    loss = (per_token * mask).sum() / (max(inputs.num_global_samples, 1) * max_tokens)
    with torch.no_grad():
        denom = max(num_global_tokens, 1)
        metrics = token_metrics(inputs, denom)
        metrics["clipped_frac"] = (clipped & mask).sum() / denom
    return loss, metrics


def dapo_loss(
    inputs: LossInputs, num_global_tokens: int, *, eps_low: float = 0.2, eps_high: float = 0.28
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DAPO: token-level clipped objective with clip-higher, normalised by the step's loss tokens."""
    mask = inputs.loss_mask.bool()
    ratio = torch.exp(inputs.trainer_logprobs - inputs.inference_logprobs)  # [T]
    per_token, clipped = clipped_objective(ratio, inputs.advantages, 1 - eps_low, 1 + eps_high)
    denom = max(num_global_tokens, 1)
    loss = (per_token * mask).sum() / denom
    with torch.no_grad():
        metrics = token_metrics(inputs, denom)
        metrics["clipped_frac"] = (clipped & mask).sum() / denom
    return loss, metrics


def gspo_loss(
    inputs: LossInputs, num_global_tokens: int, *, eps_low: float = 3e-4, eps_high: float = 4e-4
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: per sample i with n_i loss tokens, s_i = exp(sum of its log ratios / n_i) and
    A_i = the mean advantage of its loss tokens (one value per sample from the orchestrator);
    loss = sum_i -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i) / num_global_samples."""
    sample_ids = inputs.sample_ids
    assert sample_ids is not None, "gspo needs LossInputs.sample_ids"
    mask = inputs.loss_mask.float()
    log_ratio = inputs.trainer_logprobs - inputs.inference_logprobs  # [T]
    num_local = int(sample_ids.max()) + 1 if sample_ids.numel() else 0

    def per_sample(values: torch.Tensor) -> torch.Tensor:  # [T] -> [S], sums over loss tokens
        return values.new_zeros(num_local).index_add(0, sample_ids, values * mask)

    num_tokens = per_sample(torch.ones_like(mask))  # [S]
    has_loss = num_tokens > 0
    n = num_tokens.clamp_min(1)
    seq_ratio = torch.exp(per_sample(log_ratio) / n)  # [S]
    seq_adv = per_sample(inputs.advantages) / n  # [S]
    per_seq, clipped = clipped_objective(seq_ratio, seq_adv, 1 - eps_low, 1 + eps_high)
    num_samples = max(inputs.num_global_samples, 1)
    loss = (per_seq * has_loss).sum() / num_samples
    with torch.no_grad():
        metrics = token_metrics(inputs, max(num_global_tokens, 1))
        metrics["clipped_frac"] = (clipped & has_loss).sum() / num_samples
    return loss, metrics


def with_reference_kl(fn: LossFn, coef: float) -> LossFn:
    """`fn` plus coef x the k3 estimate of KL(trainer || reference) per loss token,
    exp(x) - 1 - x with x = logp_ref - logp_train, normalised by the step's loss tokens; its
    metric `ref_kl` is the step's mean (without the coefficient)."""

    def loss_fn(
        inputs: LossInputs, num_global_tokens: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert inputs.reference_logprobs is not None, "ref_kl_coef > 0 needs reference logprobs"
        loss, metrics = fn(inputs, num_global_tokens)
        x = inputs.reference_logprobs - inputs.trainer_logprobs  # [T]
        kl = ((torch.exp(x) - 1 - x) * inputs.loss_mask).sum() / max(num_global_tokens, 1)
        metrics["ref_kl"] = kl.detach()
        return loss + coef * kl, metrics

    return loss_fn


def _import_function(
    import_path: str,
) -> Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    module_name, sep, attr = import_path.partition(":")
    if not sep:
        raise ValueError(
            f"loss.import_path must look like 'package.module:function', got {import_path!r}"
        )
    return getattr(importlib.import_module(module_name), attr)


def loss_kwargs(config: LossConfig) -> dict[str, Any]:
    """The keyword arguments of the configured loss function (its config's fields)."""
    if isinstance(config, DefaultLossConfig):
        return {"mask_low": config.mask_low, "mask_high": config.mask_high, "kl_tau": config.kl_tau}
    if isinstance(config, DrGRPOLossConfig):
        return {"clip_eps": config.clip_eps, "max_tokens": config.max_tokens}
    if isinstance(config, (GSPOLossConfig, DAPOLossConfig)):
        return {"eps_low": config.eps_low, "eps_high": config.eps_high}
    return dict(config.kwargs)


LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]] = {
    "default": default_loss,
    "dr_grpo": dr_grpo_loss,
    "gspo": gspo_loss,
    "dapo": dapo_loss,
}
"""The built-in losses by `trainer.loss.type`."""


def build_loss_fn(config: LossConfig) -> LossFn:
    """The loss function selected by `trainer.loss.type`, with the reference KL term when
    `ref_kl_coef` > 0."""
    fn = LOSSES[config.type] if config.type != "custom" else _import_function(config.import_path)
    kwargs = loss_kwargs(config)

    def loss_fn(
        inputs: LossInputs, num_global_tokens: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return fn(inputs, num_global_tokens, **kwargs)

    return with_reference_kl(loss_fn, config.ref_kl_coef) if config.ref_kl_coef > 0 else loss_fn
