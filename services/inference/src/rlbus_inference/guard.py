"""A vLLM general plugin: the EngineCore dies with its API server, and on CPU it may be forked.

vLLM starts its EngineCore as a multiprocessing child of the API server and gives it no way to
notice that the API server is gone: a SIGKILLed API server (or one killed by its own parent-death
signal when the replica dies) leaves the EngineCore running, holding memory and its workers.
vLLM loads `vllm.general_plugins` in every process it starts (vllm/plugins/__init__.py), the
EngineCore included; in the EngineCore this plugin asks the kernel for SIGKILL when its parent
exits (`rlbus.procs.die_with_parent`). The workers of the EngineCore already end with it (vLLM's
death pipe).

It acts only where the replica asked for it (`GUARD_ENV`, set by `rlbus_inference.processes`),
so a plain `vllm serve` in the same environment is untouched.

Fast start (`FAST_START_ENV`, the replica's `fast_start`, CPU only): in the API server the plugin
applies `patches.fast_cpu_start` before vLLM starts its EngineCore. The EngineCore and its worker
are then forked, and a forked child runs no plugin (vLLM's plugins-loaded flag is copied with the
memory), so their parent-death signal is asked for right after each fork instead
(`os.register_at_fork`): the EngineCore dies with the API server, its worker with the EngineCore.
"""

from __future__ import annotations

import os
import signal

GUARD_ENV = "RLBUS_ENGINE_CORE_DIES_WITH_PARENT"
FAST_START_ENV = "RLBUS_ENGINE_FAST_START"
ENGINE_CORE_NAME = "EngineCore"


def is_engine_core() -> bool:
    """Whether this process is vLLM's EngineCore (its multiprocessing name, see
    vllm/v1/engine/utils.py: `EngineCore`, or `EngineCore_DP<n>` with data parallelism)."""
    import multiprocessing

    return multiprocessing.current_process().name.startswith(ENGINE_CORE_NAME)


def register() -> None:
    """The plugin entry point (`rlbus` in `vllm.general_plugins`): idempotent, cheap."""
    guarded = os.environ.get(GUARD_ENV) == "1"
    if guarded and is_engine_core():
        from rlbus.procs import die_with_parent

        die_with_parent(signal.SIGKILL)
    if os.environ.get(FAST_START_ENV) == "1":
        start_fast(guarded)


_started_fast = False


def start_fast(guarded: bool) -> None:
    """Apply the CPU start-up patches once per process; forked children die with their parent."""
    global _started_fast
    from rlbus_inference.patches import fast_cpu_start

    if _started_fast or not fast_cpu_start():
        return
    _started_fast = True
    if guarded:
        from rlbus.procs import die_with_parent

        os.register_at_fork(after_in_child=lambda: die_with_parent(signal.SIGKILL))
