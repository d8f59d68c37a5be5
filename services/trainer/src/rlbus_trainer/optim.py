"""Optimizers, learning-rate schedules, gradient clipping and state-only CPU offload.

`build_optimizer(config, model)` is the one path from `trainer.optim` to an `Optimizers` object
(one or more torch optimizers stepped together: Muon updates 2-D hidden weights and AdamW the
rest). torch's own AdamW, SGD and Muon are used; SignSGD is a few lines here. `LRSchedule` scales
each param group's peak lr by a warmup + constant/linear/cosine factor; its only state is the step.

`OptimizerStateOffload` wraps an `Optimizers` so its state lives in host memory between steps
(`model.optim_cpu_offload`); on a CPU-only machine the state is already in host memory and the
wrapper costs nothing. Full offload (masters, gradients and state on the host, step in backward)
is in `full_offload.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Protocol, overload

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import ParamsT

from rlbus.configs.trainer import (
    AdamWConfig,
    ConstantSchedulerConfig,
    LinearSchedulerConfig,
    MuonConfig,
    OptimizerConfig,
    SchedulerConfig,
    SGDConfig,
    SignSGDConfig,
)


class SignSGD(Optimizer):
    """p -= lr * (sign(grad) + weight_decay * p). Keeps no state."""

    def __init__(self, params: ParamsT, lr: float = 1e-5, weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every parameter with a gradient (torch's signature: no caller passes
        a closure)."""
        assert closure is None
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if group["weight_decay"]:
                        p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(torch.sign(p.grad), alpha=-group["lr"])
        return None


class Optimizers:
    """Several torch optimizers stepped as one (a list is what DCP's state-dict helpers take)."""

    def __init__(self, optimizers: list[Optimizer]) -> None:
        self.optimizers = optimizers
        for group in self.param_groups:
            group.setdefault("initial_lr", group["lr"])

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)


def _is_muon_param(name: str, param: torch.Tensor) -> bool:
    # Muon orthogonalises matrices; embeddings, the (tied) head, norms and biases use AdamW.
    return param.ndim == 2 and "embed" not in name and "lm_head" not in name


def build_optimizer(
    config: OptimizerConfig, model: torch.nn.Module, *, fused: bool | None = None
) -> Optimizers:
    """The optimizer selected by `trainer.optim.type` over the model's trainable parameters."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    if isinstance(config, AdamWConfig):
        adamw = torch.optim.AdamW(
            params,
            lr=config.lr,
            betas=(config.betas[0], config.betas[1]),
            eps=config.eps,
            weight_decay=config.weight_decay,
            fused=fused,
        )
        return Optimizers([adamw])
    if isinstance(config, SGDConfig):
        sgd = torch.optim.SGD(
            params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
        return Optimizers([sgd])
    if isinstance(config, SignSGDConfig):
        return Optimizers([SignSGD(params, lr=config.lr, weight_decay=config.weight_decay)])
    if isinstance(config, MuonConfig):
        muon = [p for n, p in named if _is_muon_param(n, p)]
        rest = [p for n, p in named if not _is_muon_param(n, p)]
        opts: list[Optimizer] = [
            torch.optim.Muon(
                muon, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
            )
        ]
        if rest:
            opts.append(
                torch.optim.AdamW(rest, lr=config.adamw_lr, weight_decay=config.weight_decay)
            )
        return Optimizers(opts)
    raise AssertionError(f"unknown optimizer type {config.type}")


class ParamGroups(Protocol):
    """What a schedule sets the lr of: torch optimizers and the wrappers of this module."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...


class LRSchedule:
    """Linear warmup to the peak lr, then constant / linear / cosine decay to `min_lr_ratio`.

    Decay needs a horizon: `max_steps`. Without one, the lr stays at the peak after warmup.
    """

    def __init__(
        self, config: SchedulerConfig, optimizer: ParamGroups, max_steps: int | None
    ) -> None:
        self.config = config
        self.optimizer = optimizer
        self.max_steps = max_steps
        self.num_steps = 0
        self._apply()

    def factor(self, step: int) -> float:
        """lr multiplier for optimizer step index `step` (0-based)."""
        warmup = self.config.warmup_steps
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if isinstance(self.config, ConstantSchedulerConfig) or self.max_steps is None:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, self.max_steps - warmup))
        floor = self.config.min_lr_ratio
        if isinstance(self.config, LinearSchedulerConfig):
            return floor + (1 - floor) * (1 - progress)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    def _apply(self) -> None:
        f = self.factor(self.num_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * f

    def step(self) -> None:
        self.num_steps += 1
        self._apply()

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict[str, int]:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_steps = int(state["num_steps"])
        self._apply()


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float | None) -> float:
    """Clip to max_norm (None: only measure); returns the total norm before clipping."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(
        params, max_norm if max_norm is not None else float("inf")
    )
    if hasattr(norm, "full_tensor"):  # DTensor grads under FSDP2
        norm = norm.full_tensor()
    return float(norm)


class OptimizerStateOffload:
    """Keeps the optimizer state in host memory between steps (`model.optim_cpu_offload`).

    Before `step()` the state moves to the parameters' device, after it back to (pinned) host
    memory, so accelerator memory holds optimizer state only during the step.
    """

    def __init__(self, inner: Optimizers) -> None:
        self.inner = inner

    @property
    def optimizers(self) -> list[Optimizer]:
        return self.inner.optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    def _move_state(self, to_host: bool) -> None:
        for opt in self.inner.optimizers:
            for param, state in opt.state.items():
                if param.device.type == "cpu":
                    continue  # nothing to move on a CPU-only machine
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.ndim > 0:
                        if to_host:
                            state[key] = value.to("cpu", non_blocking=True).pin_memory()
                        else:
                            state[key] = value.to(param.device, non_blocking=True)

    def step(self) -> None:
        self._move_state(to_host=False)
        self.inner.step()
        self._move_state(to_host=True)

    def zero_grad(self) -> None:
        self.inner.zero_grad()
