"""A vLLM general plugin that makes the EngineCore die with its API server.

vLLM starts its EngineCore as a multiprocessing child of the API server and gives it no way to
notice that the API server is gone: a SIGKILLed API server (or one killed by its own parent-death
signal when the replica dies) leaves the EngineCore running, holding memory and its workers.
vLLM loads `vllm.general_plugins` in every process it starts (vllm/plugins/__init__.py), the
EngineCore included; in the EngineCore this plugin asks the kernel for SIGKILL when its parent
exits (`rlbus.procs.die_with_parent`). The workers of the EngineCore already end with it (vLLM's
death pipe).

It acts only where the replica asked for it (`GUARD_ENV`, set by `rlbus_inference.processes`),
so a plain `vllm serve` in the same environment is untouched.
"""

from __future__ import annotations

import os
import signal

GUARD_ENV = "RLBUS_ENGINE_CORE_DIES_WITH_PARENT"
ENGINE_CORE_NAME = "EngineCore"


def is_engine_core() -> bool:
    """Whether this process is vLLM's EngineCore (its multiprocessing name, see
    vllm/v1/engine/utils.py: `EngineCore`, or `EngineCore_DP<n>` with data parallelism)."""
    import multiprocessing

    return multiprocessing.current_process().name.startswith(ENGINE_CORE_NAME)


def register() -> None:
    """The plugin entry point (`rlbus` in `vllm.general_plugins`): idempotent, cheap."""
    if os.environ.get(GUARD_ENV) == "1" and is_engine_core():
        from rlbus.procs import die_with_parent

        die_with_parent(signal.SIGKILL)
