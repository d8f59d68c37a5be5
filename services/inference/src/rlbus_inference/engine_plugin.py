"""rlbus's vLLM general plugin: the patch check, the EngineCore's death with its API server, and
the fast CPU start.

vLLM loads `vllm.general_plugins` in every process it starts (vllm/plugins/__init__.py), the
API server and the EngineCore included, and calls `register()` (entry point `rlbus`,
services/inference/pyproject.toml). It acts only where the replica asked for it (`GUARD_ENV`,
set by `rlbus_inference.engine_process`), so a plain `vllm serve` in the same environment is
untouched. Where it acts:

- in the API server (vLLM's main process, before it starts the EngineCore): every vLLM symbol
  rlbus patches is checked (`patches.exit_if_patch_targets_missing`): one missing ends the engine
  with one line naming it and the supported vLLM builds;
- in the EngineCore: vLLM gives it no way to notice that the API server is gone, so a SIGKILLed
  API server (or one killed by its own parent-death signal when the replica dies) would leave it
  running, holding memory and its workers. The plugin asks the kernel for SIGKILL when its parent
  exits (`rlbus.process_marks.die_with_parent`). The EngineCore's workers already end with it
  (vLLM's death pipe).

Fast start (`FAST_START_ENV`, the replica's `fast_start`, CPU only): in the API server the plugin
applies `patches.fast_cpu_start` before vLLM starts its EngineCore. The EngineCore and its worker
are then forked, and a forked child runs no plugin (vLLM's plugins-loaded flag is copied with the
memory), so their parent-death signal is asked for right after each fork instead
(`os.register_at_fork`): the EngineCore dies with the API server, its worker with the EngineCore.
"""

from __future__ import annotations

import multiprocessing
import os
import signal

from rlbus.process_marks import die_with_parent
from rlbus_inference import patches

GUARD_ENV = "RLBUS_ENGINE_CORE_DIES_WITH_PARENT"
FAST_START_ENV = "RLBUS_ENGINE_FAST_START"
API_SERVER_NAME = "MainProcess"
"""multiprocessing's name of vLLM's API server: the process `python -m vllm...` started."""


def is_engine_core() -> bool:
    """Whether this process is vLLM's EngineCore (by its multiprocessing name)."""
    return multiprocessing.current_process().name.startswith(patches.ENGINE_CORE_NAME)


def is_api_server() -> bool:
    """Whether this process is the one the replica started (vLLM's API server)."""
    return multiprocessing.current_process().name == API_SERVER_NAME


def register() -> None:
    """The plugin entry point (`rlbus` in `vllm.general_plugins`): idempotent, cheap."""
    guarded = os.environ.get(GUARD_ENV) == "1"
    if guarded and is_api_server():
        patches.exit_if_patch_targets_missing()
    if guarded and is_engine_core():
        die_with_parent(signal.SIGKILL)
    if os.environ.get(FAST_START_ENV) == "1":
        start_fast(guarded)


_started_fast = False


def start_fast(guarded: bool) -> None:
    """Apply the CPU start-up patches once per process; forked children die with their parent."""
    global _started_fast
    if _started_fast or not patches.fast_cpu_start():
        return
    _started_fast = True
    if guarded:
        os.register_at_fork(after_in_child=lambda: die_with_parent(signal.SIGKILL))
