"""Workarounds for vLLM behaviour we depend on. Each has a note; none monkey-patches vLLM.

rlbus extends vLLM only through its public extension points (endpoint plugin, worker extension).
What remains are fix-ups after calling vLLM APIs whose results are wrong for our case; they
live here so that they are easy to find and to delete when vLLM fixes them.
"""

from __future__ import annotations

import torch


def refresh_tied_lm_head(model: torch.nn.Module) -> bool:
    """Rebuild the CPU GEMM kernel of a tied lm_head after `Worker.reload_weights`.

    vLLM 0.32 on CPU packs the lm_head weight into a oneDNN/sgl kernel handle when the model is
    loaded (`dispatch_cpu_unquantized_gemm`, called from
    `UnquantizedEmbeddingMethod.process_weights_after_loading`). With tied embeddings the
    checkpoint has no `lm_head.weight`, so the layerwise reload (vllm/model_executor/
    model_loader/reload/layerwise.py) loads nothing into the lm_head layer and never re-runs its
    processing: the embedding gets the new weights while logits keep using the old packed copy.
    Re-running the processing repacks from the (shared, updated) weight. Upstream reload code:
    https://github.com/vllm-project/vllm/tree/main/vllm/model_executor/model_loader/reload
    Returns whether a head was refreshed. Harmless on CUDA (the method is a no-op there).
    """
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    quant_method = getattr(lm_head, "quant_method", None)
    if not tied or embed is None or quant_method is None:
        return False
    if lm_head.weight is not embed.weight:  # the reload may hand back separate tensors
        lm_head.weight.data.copy_(embed.weight.data)
    quant_method.process_weights_after_loading(lm_head)
    return True
