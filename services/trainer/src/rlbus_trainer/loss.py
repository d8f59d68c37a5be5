"""RL loss: importance-weighted policy gradient with trust-region masking by probability difference.

For every completion token t (loss_mask = 1) of a packed micro-batch:

    log_ratio_t = logp_train(t) - logp_inference(t)          # trainer logits divided by t's temperature
    ratio_t     = exp(log_ratio_t)
    masked_low  = p_train(t) < p_inference(t) - mask_low     # probability difference, not ratio clipping
    masked_high = p_train(t) > p_inference(t) + mask_high
    loss_t      = -ratio_t * advantage_t + kl_tau * log_ratio_t^2     (kept tokens only)

    loss = sum_t loss_t / num_global_tokens

`num_global_tokens` is the number of loss tokens of the whole step, summed over every micro-batch
of every data-parallel rank, so the summed loss (and its gradient) does not depend on how tokens
are split into micro-batches and ranks. Metrics are returned as sums over the same normaliser.

`build_loss_fn(config)` returns the default loss or a user function `package.module:function`
with the signature of `default_loss` (plus the config's kwargs).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from rlbus.configs.trainer import DefaultLossConfig, LossConfig


@dataclass
class LossInputs:
    """Per-token tensors of one micro-batch, all of shape [T] (flat, packed)."""

    trainer_logprobs: torch.Tensor
    inference_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    """bool"""
    entropy: torch.Tensor | None = None


class LossFn(Protocol):
    def __call__(
        self, inputs: LossInputs, num_global_tokens: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Return (loss to backprop, metric sums already divided by num_global_tokens)."""


def block_causal_mask(seq_lens: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """[1, 1, T, T] bool mask: each packed sequence attends causally to itself only.

    transformers' sdpa path does not separate packed sequences from position_ids alone
    (checked with transformers 5.19), so the trainer passes this mask explicitly.
    """
    segments = torch.repeat_interleave(
        torch.arange(len(seq_lens), device=device), torch.tensor(seq_lens, device=device)
    )
    total = int(segments.numel())
    causal = torch.ones(total, total, dtype=torch.bool, device=device).tril_()
    return (causal & (segments[:, None] == segments[None, :]))[None, None]


def ancestor_mask(parent_ids: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """[1, 1, T, T] bool mask of the shared-prefix layout (`MicroBatch.parent_ids`): each token
    attends to itself and its ancestors (parent, parent's parent, ... up to its sequence's first
    token). Parents come before their children, so one pass row by row builds it."""
    total = len(parent_ids)
    mask = torch.zeros(total, total, dtype=torch.bool)
    for i, parent in enumerate(parent_ids):
        if parent >= 0:
            mask[i] = mask[parent]
        mask[i, i] = True
    return mask.to(device)[None, None]


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
        lr_d = log_ratio.detach()
        metrics = {
            # k3 estimator of KL(inference || trainer): exp(x) - 1 - x with x = log_ratio.
            "mismatch_kl": ((torch.exp(lr_d) - 1 - lr_d) * mask).sum() / denom,
            "masked_low_frac": masked_low.sum() / denom,
            "masked_high_frac": masked_high.sum() / denom,
        }
        if inputs.entropy is not None:
            metrics["entropy"] = (inputs.entropy * mask).sum() / denom
    return loss, metrics


def _import_function(
    import_path: str,
) -> Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    module_name, sep, attr = import_path.partition(":")
    if not sep:
        raise ValueError(
            f"loss.import_path must look like 'package.module:function', got {import_path!r}"
        )
    return getattr(importlib.import_module(module_name), attr)


def build_loss_fn(config: LossConfig) -> LossFn:
    """The loss function selected by `trainer.loss.type`."""
    if isinstance(config, DefaultLossConfig):

        def loss_fn(
            inputs: LossInputs, num_global_tokens: int
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            return default_loss(
                inputs,
                num_global_tokens,
                mask_low=config.mask_low,
                mask_high=config.mask_high,
                kl_tau=config.kl_tau,
            )

        return loss_fn
    fn = _import_function(config.import_path)
    kwargs = dict(config.kwargs)
    return lambda inputs, num_global_tokens: fn(inputs, num_global_tokens, **kwargs)
