"""`inference`: one replica = vLLM engine + router + (with a bus) weight agent and replica lease.

`run(config)` is called by the thin `inference` entry point after it parsed the config:

    1. start the vLLM engine on `backend_port` (admin endpoints, worker extension) and wait for
       /health (25-35 s on CPU);
    2. start vllm-router on `server.port` in front of it and wait for its /health;
    3. with `bus.url`: register in the replica registry (lease, heartbeat) and run the weight
       agent (watch the weights KV key, apply each new version, report applied/failed);
    4. serve until SIGTERM/SIGINT or until a child dies.

Shutdown order: withdraw the lease (rollout workers stop sending), stop the agent, stop the
router, stop the engine (its process group, EngineCore included), close the bus. A crash of
either child ends the replica with an error; kill -9 of the replica leaves its lease to expire.
"""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import threading
from pathlib import Path

import structlog

from rlbus.configs.inference import InferenceConfig
from rlbus.netutil import free_port
from rlbus_inference import processes

log = structlog.get_logger()

ENGINE_START_TIMEOUT_S = 600.0
ROUTER_START_TIMEOUT_S = 60.0


def run(config: InferenceConfig) -> None:
    """Serve until SIGTERM/SIGINT (see module docstring); a config value the engine refused
    ends the process with one line naming it."""
    try:
        asyncio.run(serve(config))
    except processes.EngineConfigError as error:
        sys.exit(f"inference: {error}")


def logs_dir(config: InferenceConfig) -> Path | None:
    if config.run_dir is None:
        return None
    path = Path(config.run_dir) / "logs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def log_suffix(config: InferenceConfig) -> str:
    """Replicas share a run directory: name child logs by replica id (else by port)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", config.replica_id or str(config.server.port))


async def serve(config: InferenceConfig) -> None:
    stop_requested = asyncio.Event()
    stop_startup = threading.Event()  # the same request, seen by the start-up waits in threads

    def request_stop() -> None:
        stop_requested.set()
        stop_startup.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, request_stop)

    logs = logs_dir(config)
    engine = router = None
    background = None
    router_facing_port = free_port()
    try:
        engine_log = logs / f"inference-engine-{log_suffix(config)}.log" if logs else None
        engine = processes.start(
            "engine",
            processes.engine_command(config),
            env=processes.engine_env(initial_version=0, router_facing_port=router_facing_port),
            log_path=engine_log,
            parent_death_signal=signal.SIGTERM,
        )
        await asyncio.to_thread(
            processes.wait_engine_healthy,
            config,
            engine,
            engine_log,
            stop_startup,
            ENGINE_START_TIMEOUT_S,
        )
        router = processes.start(
            "router",
            processes.router_command(config, router_facing_port),
            env=None,
            log_path=logs / f"inference-router-{log_suffix(config)}.log" if logs else None,
        )
        await asyncio.to_thread(
            processes.wait_healthy,
            "router",
            router,
            processes.router_url(config) + "/health",
            ROUTER_START_TIMEOUT_S,
            stop_startup,
        )
        log.info(
            "inference_ready",
            url=processes.router_url(config),
            engine_url=processes.engine_url(config),
            model=config.vllm.model,
        )
        if config.bus.url:
            from rlbus.obs import tracing
            from rlbus_inference.replica import run_replica_tasks

            # weights_apply spans (one per applied version) -> <run_dir>/traces/inference.jsonl
            tracing.setup_tracing(
                "inference",
                run_dir=config.run_dir,
                endpoint=config.otel.endpoint,
                enabled=config.otel.enabled,
                run_id=config.bus.run_id,
            )

            background = asyncio.create_task(run_replica_tasks(config, stop_requested))
        await wait_for_stop(stop_requested, [engine, router], background)
    except processes.StopDuringStartup as stopped:
        log.info("inference_stop_during_startup", reason=str(stopped))
    finally:
        stop_requested.set()
        if background is not None:
            await finish(background)
        if router is not None:
            await asyncio.to_thread(processes.stop, "router", router)
        if engine is not None:
            await asyncio.to_thread(processes.stop, "engine", engine)
        from rlbus.obs import tracing

        tracing.shutdown_tracing()
        log.info("inference_stopped")


async def wait_for_stop(stop_requested: asyncio.Event, children, background) -> None:
    """Return on a stop request; raise if a child or the bus tasks die first."""
    while not stop_requested.is_set():
        for child in children:
            if child.poll() is not None:
                raise processes.ChildExited(f"child pid {child.pid} exited with {child.returncode}")
        if background is not None and background.done():
            background.result()  # re-raises the bus tasks' error
            return
        try:
            await asyncio.wait_for(stop_requested.wait(), timeout=1.0)
        except TimeoutError:
            pass


async def finish(task: asyncio.Task, timeout_s: float = 10.0) -> None:
    """Let the bus tasks withdraw the lease and close; cancel them if they take too long."""
    try:
        await asyncio.wait_for(task, timeout_s)
    except TimeoutError:
        log.warning("replica_tasks_cancelled")
    except Exception as error:
        log.error("replica_tasks_failed", error=str(error))


if __name__ == "__main__":
    # Development entry without the foundation's CLI: python -m rlbus_inference.service --vllm.model DIR
    from pydantic_config import cli

    run(cli(InferenceConfig, args=sys.argv[1:]))
