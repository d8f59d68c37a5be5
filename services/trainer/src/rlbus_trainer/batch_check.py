"""Cheap checks that a decoded `TrainBatch` can be trained on without crashing or corrupting the
model: what the wire format (rlbus.wire.batches) promises but msgspec cannot check by itself.

A batch that fails is quarantined by the trainer (service.py): dead-lettered, its step skipped on
every rank. The checks are linear in the number of tokens, plain Python, no torch.
"""

from __future__ import annotations

import math

from rlbus.wire.batches import MicroBatch, TrainBatch

PER_TOKEN_FIELDS = (
    "position_ids",
    "loss_mask",
    "advantages",
    "inference_logprobs",
    "temperatures",
)


def batch_problem(batch: TrainBatch, step: int, vocab_size: int) -> str | None:
    """Why `batch` (stored as step `step`) must not be trained on, or None when it is sound."""
    if batch.step != step:
        return f"batch says step {batch.step} but is stored as step {step}"
    flat = [mb for per_rank in batch.micro_batches for mb in per_rank]
    if not flat:
        return "batch has no micro-batches"
    for index, mb in enumerate(flat):
        problem = micro_batch_problem(mb, vocab_size)
        if problem:
            return f"micro-batch {index}: {problem}"
    return None


def micro_batch_problem(mb: MicroBatch, vocab_size: int) -> str | None:
    """Why one micro-batch is unusable (see `batch_problem`), or None."""
    n = len(mb.input_ids)
    if n == 0:
        return "input_ids is empty"
    for field in PER_TOKEN_FIELDS:
        if len(getattr(mb, field)) != n:
            return f"{field} has {len(getattr(mb, field))} entries, input_ids has {n}"
    if sum(mb.seq_lens) != n or any(length <= 0 for length in mb.seq_lens):
        return f"seq_lens {mb.seq_lens[:8]} do not split the {n} tokens into non-empty sequences"
    if mb.parent_ids and (problem := parent_ids_problem(mb)):
        return problem
    low, high = min(mb.input_ids), max(mb.input_ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        return f"token id {bad} is outside the vocabulary [0, {vocab_size})"
    if not all(map(math.isfinite, mb.advantages)):
        return "advantages are not all finite"
    if not all(map(math.isfinite, mb.inference_logprobs)):
        return "inference_logprobs are not all finite"
    if not all(math.isfinite(t) and t > 0 for t in mb.temperatures):
        return "temperatures are not all finite and > 0"
    return None


def parent_ids_problem(mb: MicroBatch) -> str | None:
    """Why `parent_ids` is not a forest inside the sequences of `seq_lens`: each sequence's first
    token has no parent (-1), every other token's parent is an earlier token of its sequence."""
    n = len(mb.input_ids)
    if len(mb.parent_ids) != n:
        return f"parent_ids has {len(mb.parent_ids)} entries, input_ids has {n}"
    start = 0
    for length in mb.seq_lens:
        if mb.parent_ids[start] != -1:
            return f"parent_ids[{start}] is {mb.parent_ids[start]}, a sequence's first token has -1"
        for i in range(start + 1, start + length):
            if not start <= mb.parent_ids[i] < i:
                return (
                    f"parent_ids[{i}] is {mb.parent_ids[i]}: not an earlier token of its sequence "
                    f"[{start}, {start + length})"
                )
        start += length
    return None
