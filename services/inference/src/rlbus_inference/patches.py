"""Workarounds for vLLM behaviour we depend on. Each has a note.

rlbus extends vLLM through its public extension points (endpoint plugin, worker extension,
general plugin). What remains are fix-ups after calling vLLM APIs whose results are wrong for our
case, and one wrapped vLLM method (`fork_cpu_engine_processes`, opt-out by config); they live
here so that they are easy to find and to delete when vLLM changes.
"""

from __future__ import annotations

import os

import torch

FORK = "fork"


def fast_cpu_start() -> bool:
    """The replica's `fast_start` on CPU: both patches below. False (and nothing done) elsewhere."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    fork_cpu_engine_processes()
    eager_logprob_ranks()
    return True


def fork_cpu_engine_processes() -> None:
    """Have vLLM-CPU fork its EngineCore and worker processes instead of spawning them.

    vLLM 0.32's `CpuPlatform.check_and_update_config` sets VLLM_WORKER_MULTIPROC_METHOD=spawn
    (vllm/platforms/cpu.py), so the API server starts its EngineCore, and the EngineCore its
    worker, as fresh interpreters that import vLLM and torch again: ~9 s of one core each. Forked,
    they start with the API server's imports in place (docs/inference.md, "Start-up"). Fork is
    vLLM's own default, and its choice on GPU. The worker still sets its OpenMP threads and
    binding itself, after the fork (CPUWorker.init_device); the completions of a forked engine
    are the same as a spawned one's (tests/integration/inference/test_fast_start.py).
    """
    from vllm.platforms.cpu import CpuPlatform

    update = CpuPlatform.check_and_update_config.__func__
    if getattr(update, "_rlbus_fork", False):
        return

    def check_and_update_config(cls, vllm_config) -> None:
        update(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = FORK

    check_and_update_config._rlbus_fork = True
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def eager_logprob_ranks() -> None:
    """Run the sampler's token-rank count eagerly instead of through torch.compile.

    vLLM 0.32 compiles `batched_count_greater_than` (vllm/v1/sample/ops/logprobs.py) even with
    enforce_eager, the first time a request asks for logprobs: on CPU that is ~3.5 s of dynamo and
    inductor (with a C++ compiler) inside the first step of every fresh replica. The compiled
    kernel only avoids a (tokens x vocab) boolean temporary, which is small at the batch sizes a
    CPU serves. The eager function is the same code: torch.compile keeps it as
    `_torchdynamo_orig_callable`.
    """
    from vllm.v1.sample import sampler

    compiled = sampler.batched_count_greater_than
    sampler.batched_count_greater_than = getattr(compiled, "_torchdynamo_orig_callable", compiled)


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
