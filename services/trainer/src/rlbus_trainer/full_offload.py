"""Full offload: FP32 master weights, gradients and optimizer state in host memory, the optimizer
step for each parameter run on the CPU as soon as its gradient is ready (optimizer in backward).

How it connects: `OptimizerInBackward(model, optim_config, backend)` registers a
`register_post_accumulate_grad_hook` on every trainable parameter (FSDP2 fires these hooks on the
sharded parameters after reduce-scatter, so the hook sees this rank's shard). The hook moves the
gradient to the host in FP32, accumulates it into the master's `.grad`, frees the device gradient
and, on the last micro-batch of a step (`last_micro_batch = True`), steps that parameter's own
optimizer and copies the updated master back into the (possibly lower precision) device weight.

AdamW uses torch's fused CPU kernel (`torch.optim.AdamW(fused=True)`); `backend = "torch"` uses
the plain for-loop implementation for debugging. SignSGD keeps no state. No global gradient norm
exists when each parameter steps on its own, so gradient clipping is off in this mode (enforced
by the config). NUMA binding pins this process's CPU threads to the cores of its NUMA node.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import structlog
import torch
from torch.utils.hooks import RemovableHandle

from rlbus.configs.trainer import AdamWConfig, OptimizerConfig, SignSGDConfig
from rlbus_trainer.optim import SignSGD

log = structlog.get_logger()


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def bind_to_numa_node() -> None:
    """Pin this process to the CPUs of the NUMA node it runs on (Linux; best effort)."""
    try:
        cpu = os.sched_getaffinity(0)
        node_dirs = [d for d in os.listdir("/sys/devices/system/node") if d.startswith("node")]
        for node in sorted(node_dirs):
            text = open(f"/sys/devices/system/node/{node}/cpulist").read().strip()
            cpus: set[int] = set()
            for part in text.split(","):
                lo, _, hi = part.partition("-")
                cpus.update(range(int(lo), int(hi or lo) + 1))
            if cpu & cpus:
                os.sched_setaffinity(0, cpu & cpus)
                log.info("numa_bound", node=node, num_cpus=len(cpu & cpus))
                return
    except (OSError, ValueError):
        log.info("numa_binding_unavailable")


class OptimizerInBackward:
    """Per-parameter host optimizers stepped from gradient hooks (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optim_config: OptimizerConfig,
        *,
        backend: str = "native",
        numa_binding: bool = True,
    ) -> None:
        # the config refuses full offload with other optimizers (trainer.optim)
        assert isinstance(optim_config, (AdamWConfig, SignSGDConfig)), optim_config
        if numa_binding:
            bind_to_numa_node()
        self.last_micro_batch = True
        self.optimizers: list[torch.optim.Optimizer] = []
        self._handles: list[RemovableHandle] = []
        self._params: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        for param in model.parameters():
            if not param.requires_grad:
                continue
            local = _local(param.detach())
            master = torch.empty(
                local.shape,
                dtype=torch.float32,
                device="cpu",
                pin_memory=local.device.type == "cuda",
            )
            master.copy_(local)
            master = torch.nn.Parameter(master)
            opt = self._make_optimizer(master, optim_config, backend)
            opt.param_groups[0].setdefault("initial_lr", opt.param_groups[0]["lr"])
            self.optimizers.append(opt)
            self._params.append((param, master))
            self._handles.append(
                param.register_post_accumulate_grad_hook(self._make_hook(param, master, opt))
            )

    @staticmethod
    def _make_optimizer(
        master: torch.nn.Parameter, cfg: AdamWConfig | SignSGDConfig, backend: str
    ) -> torch.optim.Optimizer:
        if isinstance(cfg, SignSGDConfig):
            return SignSGD([master], lr=cfg.lr, weight_decay=cfg.weight_decay)
        fused = backend == "native"
        return torch.optim.AdamW(
            [master],
            lr=cfg.lr,
            betas=(cfg.betas[0], cfg.betas[1]),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            fused=fused,
            foreach=False if not fused else None,
        )

    def _make_hook(
        self, param: torch.nn.Parameter, master: torch.nn.Parameter, opt: torch.optim.Optimizer
    ) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            assert p.grad is not None  # the hook runs once the gradient is accumulated
            device_grad = _local(p.grad)
            grad = device_grad.detach().to("cpu", torch.float32)
            if master.grad is None:
                master.grad = grad.clone() if grad.data_ptr() == device_grad.data_ptr() else grad
            else:
                master.grad.add_(grad)
            p.grad = None
            if self.last_micro_batch:
                opt.step()
                master.grad = None
                with torch.no_grad():
                    _local(param.data).copy_(master.detach())

        return hook

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self) -> None:
        """Nothing left to do: every parameter stepped during backward."""

    def zero_grad(self) -> None:
        for _, master in self._params:
            master.grad = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "masters": [m.detach() for _, m in self._params],
            "optimizers": [opt.state_dict() for opt in self.optimizers],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for (param, master), saved in zip(self._params, state["masters"], strict=True):
                master.copy_(saved)
                _local(param.data).copy_(master)
        for opt, saved in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(saved)

    def remove(self) -> None:
        """Take the gradient hooks off the model's parameters."""
        for h in self._handles:
            h.remove()
