"""The model's full tensors, one at a time: what weight publishing writes and broadcasts.

    specs = tensor_specs(model, tied)                       # names, dtypes, global shapes
    for name, tensor in full_tensors(model, tied, main=world.is_main, device=cpu): ...

`Engine.full_state_dict` gathers the whole model on rank 0 before anything is written or sent,
so rank 0 holds a second copy of the model. The walk here gathers one tensor at a time instead:
for an FSDP2 parameter (a DTensor) `full_tensor()` is an all-gather every rank joins, in the
same order (the state dict's, identical on every rank); rank 0 keeps the result until its
consumer moves on, the other ranks drop it at once. So no rank ever holds more than its shard
plus one full tensor. A plain module (one rank) yields its own tensors, no copy on the CPU.

Names and the tied head follow `hf_dir.hf_tensor_names`: HF checkpoint names, a tied
`lm_head.weight` left out (before gathering, so the ranks skip it together). Shapes and dtypes
are known before any gather (a DTensor carries its global shape), which lets a writer put a
safetensors header first and the broadcast announce every tensor up front.

Every rank must run the walk to its end, even when rank 0's consumer fails half-way (a full
disk, a dead receiver): otherwise the other ranks wait in an all-gather until the collective
timeout. `drain` finishes a walk; the publishers call it in a `finally`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch

from rlbus.broadcast import TensorSpec
from rlbus_trainer.hf_dir import is_hf_tensor


def tied_embeddings(model: torch.nn.Module) -> bool:
    """Whether the model's `lm_head` is its embedding matrix (its config says so; the same on
    every rank, so every rank skips the same tensor)."""
    return bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))


def _state(model: torch.nn.Module, tied: bool) -> dict[str, torch.Tensor]:
    """The model's state dict (sharded DTensors under FSDP2), HF tensors only."""
    return {n: t for n, t in model.state_dict().items() if is_hf_tensor(n, tied)}


def tensor_specs(model: torch.nn.Module, tied: bool) -> list[TensorSpec]:
    """Name, dtype and full shape of every tensor `full_tensors` yields, in that order, without
    gathering anything; ValueError names a tensor of a dtype the broadcast does not carry."""
    return [TensorSpec.of(name, t) for name, t in _state(model, tied).items()]


def full_tensors(
    model: torch.nn.Module, tied: bool, *, main: bool, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor on `device`, contiguous) one at a time on rank 0 (`main`); elsewhere
    nothing is yielded, but each gather is joined. Collective: every rank runs it to the end."""
    # Only FSDP2 makes DTensors, and it has imported this module by then; importing it here
    # would cost a 1-rank trainer (a plain module) a second of start-up at its first publish.
    dtensor = sys.modules.get("torch.distributed.tensor")
    for name, tensor in _state(model, tied).items():
        if dtensor is not None and isinstance(tensor, dtensor.DTensor):
            tensor = tensor.full_tensor()  # all-gather: every rank, in state-dict order
        if main:
            yield name, tensor.detach().to(device).contiguous()
        del tensor  # the other ranks keep nothing; rank 0 drops it once the consumer moved on


def drain(tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Run a walk to its end (its remaining gathers), dropping what it yields."""
    for _ in tensors:
        pass
