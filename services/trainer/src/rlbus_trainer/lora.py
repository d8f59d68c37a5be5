"""LoRA: low-rank adapters on the target Linear layers, trained alone and published alone.

    apply_lora(model, config)        freeze the model, add lora_A/lora_B to each target Linear
    adapter_state_dict(state)        the adapter tensors of a state dict, PEFT key names
    merged_state_dict(state, config) W + scaling * B @ A folded in (full weights, no adapters)
    adapters_disabled(model)         context: the base model's forward (the reference of a KL term)
    write_adapter_dir(tensors, ...)  a PEFT adapter directory (what LoraWeightPublisher, in
                                     weights.py, writes under <run_dir>/broadcasts/step_N/)

Each target `nn.Linear` keeps its own weight under its own name and gains two bias-free
sub-layers, `lora_A` ([rank, in]) and `lora_B` ([out, rank], zero at init), plus a forward hook
adding `scaling * lora_B(lora_A(dropout(x)))` to its output, scaling = alpha / rank. A hook, not a
wrapper module, so the base parameter names do not change: checkpoints, FSDP2 units and both
model implementations (`qwen3.py`, transformers) see the same tree, and an adapter's name is its
Linear's name + `.lora_A.weight`, which is PEFT's key without the `base_model.model.` prefix.
B = 0 at init: the adapted model starts as the base model exactly.

The publisher (`rlbus_trainer.weights.LoraWeightPublisher`) writes `adapter_config.json` + `adapter_model.safetensors` (what vLLM's
/load_lora_adapter and PEFT read) and announces `WeightsPublished(lora_name=...)`: replicas load
it in place under that name (rlbus_inference.admin) and advertise it as their model, so rollouts
sample from the adapter (docs/lora.md).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors.torch import save_file
from torch import nn

from rlbus.configs.trainer import LoRAConfig

log = structlog.get_logger()

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _lora_hook(
    module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor, *, scaling: float
) -> torch.Tensor:
    if getattr(module, "lora_off", False):  # adapters_disabled: the base model's output
        return output
    x = module.get_submodule("lora_dropout")(inputs[0])
    return output + module.get_submodule("lora_B")(module.get_submodule("lora_A")(x)) * scaling


def add_adapter(linear: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
    """Give `linear` a LoRA adapter (A: kaiming-uniform as PEFT, B: zeros) and its hook, which
    adds `alpha / rank * lora_B(lora_A(lora_dropout(x)))` to the layer's output."""
    weight = linear.weight
    lora_a = nn.Linear(
        linear.in_features, rank, bias=False, device=weight.device, dtype=weight.dtype
    )
    lora_b = nn.Linear(
        rank, linear.out_features, bias=False, device=weight.device, dtype=weight.dtype
    )
    nn.init.kaiming_uniform_(lora_a.weight, a=math.sqrt(5))
    nn.init.zeros_(lora_b.weight)
    linear.lora_A, linear.lora_B = lora_a, lora_b
    linear.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
    linear.register_forward_hook(functools.partial(_lora_hook, scaling=alpha / rank))


def apply_lora(model: nn.Module, config: LoRAConfig) -> list[str]:
    """Freeze every parameter of `model`, then add trainable adapters to the `nn.Linear`s whose
    last name component is in `config.target_modules`; returns their names. `ValueError` when
    none matches (a typo in target_modules would otherwise train nothing)."""
    for param in model.parameters():
        param.requires_grad_(False)
    targets = set(config.target_modules)
    linears = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets
    }
    if not linears:
        raise ValueError(
            f"trainer.lora.target_modules {sorted(targets)} matches no Linear layer of the model: "
            "use projection names such as q_proj, v_proj, down_proj"
        )
    for linear in linears.values():
        add_adapter(linear, config.rank, config.alpha, config.dropout)
    num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("lora_applied", num_modules=len(linears), num_trainable=num_trainable)
    return list(linears)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside: `model` computes as its base model (every adapter's hook adds nothing). The
    reference model of a LoRA run's `ref_kl_coef` is this, so it costs no memory."""
    linears = [m for m in model.modules() if hasattr(m, "lora_A")]
    # A plain bool attribute (nn.Module keeps it in __dict__); setattr because mypy reads
    # nn.Module attributes as tensors or modules.
    for linear in linears:
        setattr(linear, "lora_off", True)  # noqa: B010
    try:
        yield
    finally:
        for linear in linears:
            setattr(linear, "lora_off", False)  # noqa: B010


def is_adapter_key(name: str) -> bool:
    """A state-dict key of an adapter tensor (lora_A or lora_B)."""
    return ".lora_A." in name or ".lora_B." in name


def adapter_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a model state dict under PEFT's key names."""
    return {PEFT_PREFIX + k: v.contiguous() for k, v in state.items() if is_adapter_key(k)}


def merged_state_dict(
    state: dict[str, torch.Tensor], config: LoRAConfig
) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter folded in: W + (alpha / rank) * B @ A
    (the full-weights fallback; an engine without LoRA serves it as any other version)."""
    scaling = config.alpha / config.rank
    merged = {k: v for k, v in state.items() if not is_adapter_key(k)}
    for key, a in state.items():
        if key.endswith(".lora_A.weight"):
            module = key.removesuffix(".lora_A.weight")
            b = state[f"{module}.lora_B.weight"]
            w = merged[f"{module}.weight"]
            merged[f"{module}.weight"] = (w.float() + scaling * (b.float() @ a.float())).to(w.dtype)
    return merged


def adapter_config(config: LoRAConfig, base_model: str) -> dict[str, Any]:
    """PEFT's adapter_config.json for these adapters (what vLLM's LoRA loader reads)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": sorted(config.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }


def write_adapter_dir(
    tensors: dict[str, torch.Tensor], config: LoRAConfig, base_model: str, out: Path
) -> Path:
    """Write a PEFT adapter directory to `out` (temp dir, fsync, rename: readers never see a
    partial one)."""
    tmp = out.parent / f".{out.name}.tmp"  # as hf_dir.write_hf_dir: pruning skips it
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(config, base_model), indent=2))
    for path in tmp.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    if out.exists():  # left by a publish that crashed before its announcement
        shutil.rmtree(out)
    os.rename(tmp, out)
    return out
