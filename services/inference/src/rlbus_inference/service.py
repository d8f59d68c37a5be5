"""`inference`: one replica = vLLM engine + public gate + (with a bus) weight agent and lease.

`run(config)` is called by the thin `inference` entry point after it parsed the config:

    1. start the vLLM engine on `backend_port` (admin endpoints, worker extension) and wait for
       /health (25-35 s on CPU);
    2. serve `server.port` with the public allow-list gate (`rlbus_inference.gate`) in this
       process, in front of the engine's loopback gate-facing listener (one hop: the
       orchestrator's ReplicaPool spreads requests over replicas, docs/inference.md);
    3. with `bus.url`: register in the replica registry (lease, heartbeat) and run the weight
       agent (watch the weights KV key, apply each new version, report applied/failed);
    4. serve until SIGTERM/SIGINT or until a child dies.

With `attach` (a server started elsewhere, `rl --inference.attach`) steps 1-2 are replaced by
the checks and weight reset of `rlbus_inference.attached`, step 3 is the same code
(`spawn_replica_tasks`), and step 4 probes that server's /health (`serve_attached`); the server
is never stopped.

Signals come from the service shell (rlbus.lifecycle): the first SIGTERM/SIGINT stops the replica in
the order below (also during start-up: the engine is stopped and the exit is 0), a second one
exits at once (143/130). The bus tasks are supervised: a lease or weight agent that raises ends
the replica with one `service_task_failed` line and exit code 1.

Shutdown order: withdraw the lease (rollout workers stop sending), close the public gate, stop
the agent, stop the engine (its process group, EngineCore included), close the bus; then end
whatever still carries the replica's mark (`engine_process.end_marked`).

While serving, `engine_process.ChildWatch` checks the API server and vLLM's EngineCore and
probes the engine's /health (`config.health`). A death (a child exits, or /health fails
`health.failures` times in a row) ends the replica within 15 s: the lease is withdrawn and the
children are ended side by side with short deadlines, and the process exits 1 with one line naming
what died and its log (docs/inference.md, "Engine death, orphans, restart"). kill -9 of the
replica leaves its lease to expire; its children die with it (parent-death signals, and
`rlbus_inference.engine_plugin` in the EngineCore).
"""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import structlog

from rlbus.configs.base import exit_with_config_error
from rlbus.configs.inference import InferenceConfig
from rlbus.lifecycle import ServiceState, TaskSupervisor, run_service
from rlbus.netutil import free_port, port_in_use
from rlbus.secrets import SecretError
from rlbus_inference import admin_access, attached, engine_process
from rlbus_inference.gate import PublicGate, no_signal_server
from rlbus_inference.replica import run_replica_tasks

if TYPE_CHECKING:  # uvicorn loads with the gate
    import uvicorn

log = structlog.get_logger()

ENGINE_START_TIMEOUT_S = 600.0
STOP_GRACE_S = 15.0
"""A stop request: each child gets this long after SIGTERM before SIGKILL."""
FAILED_WITHDRAW_S = 5.0
FAILED_STOP_GRACE_S = 3.0
"""A child died: the registry entry is deleted and the other children are ended at once, so the
replica is gone from the registry and exits within 15 s of the death (docs/inference.md)."""
PORT_WAIT_S = 20.0
"""How long a replica waits for a port that is in use before it gives up (claim_ports)."""


def claim_ports(config: InferenceConfig) -> InferenceConfig:
    """`config` with its ports checked before anything starts: a port another process (another
    replica on this host) keeps listening on for PORT_WAIT_S ends the replica with one line
    naming the flag, before it could register; 0 picks a free port. The wait lets the children
    of a replica that just died (a restart in place) release their ports."""
    ports: dict[str, int] = {}
    for flag, name, port, host in (
        ("--server.port", "port", config.server.port, config.server.host or "0.0.0.0"),
        ("--backend-port", "backend_port", config.backend_port, config.admin.host or "0.0.0.0"),
    ):
        if port == 0:
            port = free_port(host)
        elif port_in_use(host, port):
            log.warning("inference_port_busy", flag=flag, port=port, wait_s=PORT_WAIT_S)
            deadline = time.monotonic() + PORT_WAIT_S
            while port_in_use(host, port):
                if time.monotonic() > deadline:
                    raise PortInUse(
                        f"{flag} {port} is in use on {host} (another replica on this host?): "
                        f"give each replica its own ports, or {flag} 0 for a free one"
                    )
                time.sleep(0.5)
        ports[name] = port
    if ports["port"] == ports["backend_port"]:
        raise PortInUse(
            f"--server.port and --backend-port are both {ports['port']}: they must differ"
        )
    server = config.server.model_copy(update={"port": ports["port"]})
    return config.model_copy(update={"server": server, "backend_port": ports["backend_port"]})


class PortInUse(ValueError):
    """A port of the replica is taken or clashes."""


def bind_public_port(config: InferenceConfig) -> socket.socket:
    """`server.port`, bound as soon as the replica starts and served by the gate once the engine
    is up (~10 s later). Bound only then, a port planned by `rl` or a SLURM job was
    taken in that window by a process that bound port 0 or connected out (both draw from the
    same ephemeral range), and the replica failed at the end of its start-up. Connections made
    before the gate serves wait in the listen backlog."""
    host = config.server.host or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, config.server.port))
        sock.listen(128)  # bound alone, a second SO_REUSEADDR socket could still share the port
    except OSError as error:
        sock.close()
        raise PortInUse(
            f"--server.port {config.server.port}: the public port could not be bound on "
            f"{host}: {error.strerror}; give each replica its own port, or --server.port 0"
        ) from None
    return sock


def run(config: InferenceConfig) -> None:
    """Serve until SIGTERM/SIGINT (see module docstring). A config value the engine refused, or a
    child (the engine) that exits or never becomes healthy, ends the process with exit code 1
    and one line saying which and where its output is, not a traceback."""
    try:
        token = admin_access.admin_token(config)
    except (admin_access.AdminExposed, SecretError) as error:
        exit_with_config_error(str(error))
    try:
        if config.attach is not None:
            run_attached(config, token)
            return
        config = claim_ports(config)
        public = bind_public_port(config)
        run_service("inference", lambda state: serve(config, state, token, public))
    except PortInUse as error:
        sys.exit(f"inference: {error}")
    except (
        engine_process.EngineConfigError,
        engine_process.ChildExited,
        engine_process.StartupTimeout,
    ) as error:
        sys.exit(f"inference: {error}")


def run_attached(config: InferenceConfig, token: str | None) -> None:
    """Attach mode: check and reset the running server (`rlbus_inference.attached`: one line and
    exit 2 or 4 when it cannot be used), then only the bus part of `serve` until stopped."""
    if config.bus.url is None:  # `rl` always sets it (its bus, embedded or not)
        exit_with_config_error(
            "--attach registers a running server for a run: it needs --bus.url (the run's bus); "
            "a plain server needs no --attach"
        )
    try:
        attached.prepare(config, token)
    except attached.AttachFailed as error:
        log.error(
            "attach_failed", url=engine_process.attached_server(config).url, reason=str(error)
        )
        print(f"inference: {error}", file=sys.stderr, flush=True)
        sys.exit(error.code)
    run_service("inference", lambda state: serve_attached(config, state, token))


def logs_dir(config: InferenceConfig) -> Path | None:
    if config.run_dir is None:
        return None
    path = Path(config.run_dir) / "logs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def log_suffix(config: InferenceConfig) -> str:
    """Replicas share a run directory: name child logs by replica id (else by port)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", config.replica_id or str(config.server.port))


@dataclass
class ReplicaParts:
    """What `serve` started, for its shutdown: each part is None until it was started."""

    mark: dict[str, str]
    tasks: TaskSupervisor = field(default_factory=TaskSupervisor)
    engine: subprocess.Popen[bytes] | None = None
    engine_log: Path | None = None
    gate_facing_port: int = 0
    gate: PublicGate | None = None
    gate_server: uvicorn.Server | None = None
    replica: asyncio.Task[None] | None = None


async def serve(
    config: InferenceConfig,
    state: ServiceState,
    token: str | None = None,
    public: socket.socket | None = None,
) -> None:
    """The replica until a stop request; `public`: `server.port` already bound
    (`bind_public_port`; bound here when None)."""
    public = public or bind_public_port(config)
    stop_startup = threading.Event()  # the stop request, seen by the start-up waits in threads
    state.listeners.append(stop_startup.set)
    parts = ReplicaParts(mark=engine_process.replica_mark(log_suffix(config)))
    failed = True  # until serving ended by a stop request: then shut down in order, unhurried
    try:
        engine = await start_engine(config, parts, token, stop_startup)
        await open_gate(config, parts, public)
        log.info(
            "inference_ready",
            url=engine_process.public_url(config),
            engine_url=engine_process.engine_url(config),
            model=config.vllm.model,
        )
        watch = engine_process.ChildWatch(
            config, {"engine": (engine, parts.engine_log)}, engine_log=parts.engine_log
        )
        if config.bus.url:
            parts.replica = spawn_replica_tasks(config, state, parts.tasks, token)
        await wait_for_stop(state, watch, parts.tasks, interval_s=config.health.interval_s)
        failed = False
    except engine_process.StopDuringStartup as stopped:
        log.info("inference_stop_during_startup", reason=str(stopped))
        failed = False
    finally:
        await shut_down(parts, state, failed=failed)
        public.close()  # served: uvicorn closed it already; never served: released here
        log.info("inference_stopped")


async def start_engine(
    config: InferenceConfig, parts: ReplicaParts, token: str | None, stop: threading.Event
) -> subprocess.Popen[bytes]:
    """Start vLLM (admin endpoints on backend_port, the gate-facing listener on a free loopback
    port) and wait until its /health answers; `stop` ends the wait (StopDuringStartup)."""
    logs = logs_dir(config)
    parts.engine_log = logs / f"inference-engine-{log_suffix(config)}.log" if logs else None
    parts.gate_facing_port = free_port()
    engine_env = engine_process.engine_env(
        initial_version=0,
        gate_facing_port=parts.gate_facing_port,
        mark=parts.mark,
        admin=admin_access.engine_env(config, token),
        fast_start=config.fast_start,
    )
    parts.engine = engine_process.start(
        "engine",
        engine_process.engine_command(config),
        env={**engine_env, **engine_process.engine_tracing(config)[1]},
        log_path=parts.engine_log,
        parent_death_signal=signal.SIGTERM,
    )
    await asyncio.to_thread(
        engine_process.wait_engine_healthy,
        config,
        parts.engine,
        parts.engine_log,
        stop,
        ENGINE_START_TIMEOUT_S,
    )
    return parts.engine


async def open_gate(config: InferenceConfig, parts: ReplicaParts, public: socket.socket) -> None:
    """Serve the bound public port with the allow-list gate, in front of the engine's
    gate-facing listener; returns once it serves."""
    upstream = f"http://127.0.0.1:{parts.gate_facing_port}"
    parts.gate = PublicGate(upstream, config.server.cors_allowed_origins)
    parts.gate_server = no_signal_server(parts.gate, config.server.host, config.server.port)
    parts.tasks.spawn("public_gate", serve_gate(parts.gate_server, config, public))
    await wait_serving(parts.gate_server, parts.tasks)


async def shut_down(parts: ReplicaParts, state: ServiceState, *, failed: bool) -> None:
    """Stop what `serve` started: after a stop request in order (lease, gate, engine), after a
    death (`failed`) at once and side by side with short deadlines; then whatever still carries
    the replica's mark."""
    # The bus tasks see it: they withdraw the lease first, and say why in a lifecycle event.
    state.drain(f"{engine_process.FAILED_PREFIX} a child process ended" if failed else "shutdown")
    if parts.gate_server is not None:  # clients stop reaching the replica first
        parts.gate_server.should_exit = True
    withdraw_s = FAILED_WITHDRAW_S if failed else 10.0
    grace_s = FAILED_STOP_GRACE_S if failed else STOP_GRACE_S
    if failed:  # a child died: leave the registry and end the engine at once, side by side
        await asyncio.gather(
            finish(parts.replica, timeout_s=withdraw_s) if parts.replica else asyncio.sleep(0),
            stop_engine(parts.engine, grace_s=grace_s),
        )
    else:
        if parts.replica is not None:
            await finish(parts.replica, timeout_s=withdraw_s)
        await stop_engine(parts.engine, grace_s=grace_s)
    await parts.tasks.close()
    if parts.gate is not None:
        await parts.gate.aclose()
    await asyncio.to_thread(engine_process.end_marked, parts.mark)


async def stop_engine(engine: subprocess.Popen[bytes] | None, *, grace_s: float) -> None:
    """The engine's process group: SIGTERM, SIGKILL after `grace_s`."""
    if engine is not None:
        await asyncio.to_thread(engine_process.stop, "engine", engine, grace_s=grace_s)


def spawn_replica_tasks(
    config: InferenceConfig, state: ServiceState, tasks: TaskSupervisor, token: str | None
) -> asyncio.Task:
    """The bus part of a replica, owned or attached: weights, lease, applied/failed events."""
    return tasks.spawn("replica_tasks", run_replica_tasks(config, state, token))


async def serve_attached(config: InferenceConfig, state: ServiceState, token: str | None) -> None:
    """The bus part of `serve` for a server this process does not own: registered with its
    URLs until a stop request (the lease is withdrawn first, as in `serve`) or until the server
    stops answering /health `health.failures` times in a row (exit 1: the launcher restarts this
    process, whose checks then wait for the server). The server itself is never stopped."""
    tasks = TaskSupervisor()
    replica = spawn_replica_tasks(config, state, tasks, token)
    failed = True
    try:
        await watch_attached(config, state, tasks)
        failed = False
    finally:
        state.drain("shutdown")
        await finish(replica, timeout_s=FAILED_WITHDRAW_S if failed else 10.0)
        await tasks.close()
        log.info("inference_detached", url=engine_process.attached_server(config).url)


async def watch_attached(
    config: InferenceConfig, state: ServiceState, tasks: TaskSupervisor
) -> None:
    """Probe the attached server's public /health every `health.interval_s` until a stop
    request; ChildExited when it failed `health.failures` probes in a row."""
    url = engine_process.public_url(config) + "/health"
    failures = 0
    engine_process.quiet_http_log()
    async with httpx.AsyncClient() as http:
        while not state.ending:
            try:
                response = await http.get(url, timeout=config.health.timeout_s)
                why = None if response.status_code == 200 else f"answered {response.status_code}"
            except httpx.HTTPError as error:
                why = type(error).__name__
            failures = 0 if why is None else failures + 1
            if why is not None:
                log.warning("attached_health_failed", url=url, failures=failures, reason=why)
            if failures >= config.health.failures:
                raise engine_process.ChildExited(
                    f"the attached server at {engine_process.attached_server(config).url} failed {failures} health "
                    "probes in a row (stopped or restarting?)"
                )
            await tasks.wait(state.stop_requested, timeout_s=config.health.interval_s)


async def serve_gate(
    server: uvicorn.Server, config: InferenceConfig, public: socket.socket
) -> None:
    """Run the public gate on the bound `public` socket; uvicorn's own exit on a failed start
    (SystemExit) becomes an error naming the flag, so the supervisor ends the replica with one
    line."""
    try:
        await server.serve(sockets=[public])
    except SystemExit:
        raise PortInUse(
            f"--server.port {config.server.port}: the public port could not be bound on "
            f"{config.server.host} (see the line before)"
        ) from None


async def wait_serving(
    server: uvicorn.Server, tasks: TaskSupervisor, timeout_s: float = 10.0
) -> None:
    """Return once uvicorn `server` listens; a gate that failed to bind ends the replica
    (its task fails: TaskFailed names it)."""
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if time.monotonic() > deadline:
            raise engine_process.StartupTimeout(f"public port not serving after {timeout_s:g} s")
        await tasks.wait(asyncio.Event(), timeout_s=0.05)


async def wait_for_stop(
    state: ServiceState,
    watch: engine_process.ChildWatch,
    tasks: TaskSupervisor,
    *,
    interval_s: float,
) -> None:
    """Return on a stop request; raise if a child dies or stops answering (ChildExited, naming it
    and its log) or a bus task fails (TaskFailed) first."""
    async with httpx.AsyncClient() as http:
        while not state.ending:
            watch.check_processes()
            await watch.check_health(http)
            if state.ending:
                break
            watch.check_processes()  # a probe that failed because the engine just died
            await tasks.wait(state.stop_requested, timeout_s=interval_s)


async def finish(task: asyncio.Task, timeout_s: float = 10.0) -> None:
    """Wait for the bus tasks to withdraw the lease and close; cancel them if they take too long
    (their own failure is reported by the supervisor, not here)."""
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        log.warning("replica_tasks_cancelled", waited_s=timeout_s)
        task.cancel()
        await asyncio.wait({task}, timeout=2.0)


if __name__ == "__main__":  # `python -m rlbus_inference.service ...` = the `inference` command
    from rlbus_inference.entrypoint import main

    main()
