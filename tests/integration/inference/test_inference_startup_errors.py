"""Start-up failures of the inference service end it with exit code 1 and one line, not a
traceback: a KV-cache size that vLLM-CPU refuses names `--vllm.cpu-kv-cache-bytes` and the fix
(CPU only: on GPU the size is a fraction); an engine that dies for another reason is named with
the log that holds vLLM's own output."""

import os
import re
import subprocess

import pytest
import torch
from inference_helpers import make_base_model, replica_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def run_replica(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=240,
        start_new_session=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="cpu_kv_cache_bytes is CPU only")
def test_too_small_kv_cache_exits_with_one_line(tmp_path, free_ports):
    """256 KiB holds ~100 tokens of the tiny model. (The other refusals, a size above the free
    memory and one below a block, take the same path; their vLLM lines are unit-tested.)"""
    port, backend_port = free_ports(2)
    model_dir = make_base_model(tmp_path / "model")
    command = replica_command(
        model_dir,
        port,
        backend_port,
        "--run-dir",
        str(tmp_path / "run"),
        "--vllm.max-model-len",
        "2048",
        "--vllm.enforce-eager",
        "--vllm.cpu-kv-cache-bytes",
        "256KiB",
    )
    done = run_replica(command)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"inference: --vllm.cpu-kv-cache-bytes 256.0KiB holds less than one sequence of "
        r"max_model_len 2048 \(it fits \d+ tokens\): raise --vllm.cpu-kv-cache-bytes or lower "
        r"--vllm.max-model-len",
        last,
    ), last


def test_an_engine_that_dies_at_start_is_named_with_its_log(tmp_path, free_ports):
    port, backend_port = free_ports(2)
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")  # vLLM fails to read it and exits
    run_dir = tmp_path / "run"
    done = run_replica(
        replica_command(broken, port, backend_port, "--run-dir", str(run_dir), "--replica-id", "r0")
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    engine_log = run_dir / "logs" / "inference-engine-r0.log"
    assert last == (
        f"inference: engine exited with code 1 before becoming healthy; "
        f"its output is in {engine_log}"
    ), last
    assert engine_log.stat().st_size > 0
