"""Who attends to whom in one forward pass of stacked packed rows, and the attention that follows.

A forward pass stacks rows of `MicroBatch`es, padded to the longest, into [B, T]. Each row holds
several documents (`seq_lens`) or a shared-prefix tree (`parent_ids`). Two descriptions:

    Documents            per row, its document lengths (the last one running to the padded end):
                         rlbus's Qwen3 module (`qwen3.py`) runs `document_attention`, one causal
                         SDPA call per document, and no [T, T] tensor exists
    dense mask           bool [B, 1, T, T], True = attend: shared-prefix rows (a token's ancestors
                         are no contiguous block) and transformers models (their sdpa path takes
                         an explicit mask; docs/trainer.md, "Attention layout")

`layout_of` picks between them. Why a split per document and not flex attention's block masks:
flex attention is fast only under torch.compile (seconds of compile per new shape on CPU, in
tests and in a trainer whose row widths change every step), while SDPA with `is_causal=True` and
no mask runs the flash kernels on GPU and the CPU flash kernel here, as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # imports msgspec; benchmarks/gpu_check.py runs this module with torch alone
    from rlbus.wire.batches import MicroBatch


@dataclass(frozen=True)
class Documents:
    """Per row of a forward pass, the lengths of its documents in order. Each row's lengths sum
    to the padded width T: a row's padding extends its last document. Causal attention keeps
    the padding out of every real token's view, the pads' outputs are dropped, and rows of one
    document each then share one layout, so one SDPA call covers them all."""

    lengths: tuple[tuple[int, ...], ...]

    @classmethod
    def of_rows(cls, seq_lens: list[list[int]], width: int) -> Documents:
        """The layout of rows with these `seq_lens`, each padded to `width`."""
        rows = []
        for lengths in seq_lens:
            pad = width - sum(lengths)
            assert pad >= 0 and lengths, (lengths, width)
            rows.append((*lengths[:-1], lengths[-1] + pad))
        return cls(tuple(rows))


AttentionLayout = torch.Tensor | Documents
"""What a forward pass gets as `attention_mask`: a dense bool mask or a `Documents` layout."""


def document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents, scale: float
) -> torch.Tensor:
    """Causal attention within each document: q, k, v [B, H, T, D] -> [B, H, T, D].

    Rows with the same layout share their SDPA calls (a batch of one-document rows is one call).
    """

    def attend(rows: slice, lengths: tuple[int, ...]) -> torch.Tensor:
        pieces = [x[rows].split(lengths, dim=2) for x in (q, k, v)]
        outs = [
            F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)
            for qd, kd, vd in zip(*pieces, strict=True)
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    layouts = documents.lengths
    assert len(layouts) == q.shape[0], (len(layouts), q.shape)
    if all(lengths == layouts[0] for lengths in layouts):
        return attend(slice(None), layouts[0])
    return torch.cat([attend(slice(b, b + 1), lengths) for b, lengths in enumerate(layouts)])


def block_causal_mask(seq_lens: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """[1, 1, T, T] bool mask: each packed sequence attends causally to itself only.

    transformers' sdpa path does not separate packed sequences from position_ids alone
    (checked with transformers 5.19), so the trainer passes it this mask explicitly.
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


def dense_mask(rows: list[MicroBatch], width: int) -> torch.Tensor:
    """Bool [B, 1, T, T] mask of rows padded to `width` (a pad attends to itself only)."""
    mask = torch.eye(width, dtype=torch.bool).repeat(len(rows), 1, 1, 1)
    for b, mb in enumerate(rows):
        n = len(mb.input_ids)
        row = ancestor_mask(mb.parent_ids) if mb.parent_ids else block_causal_mask(mb.seq_lens)
        mask[b, 0, :n, :n] = row[0, 0]
    return mask


def layout_of(rows: list[MicroBatch], width: int, *, documents_ok: bool) -> AttentionLayout:
    """The attention of rows padded to `width`: `Documents` where the model takes it
    (`documents_ok`) and no row is a shared-prefix tree, else the dense mask."""
    if documents_ok and not any(mb.parent_ids for mb in rows):
        return Documents.of_rows([list(mb.seq_lens) for mb in rows], width)
    return dense_mask(rows, width)
