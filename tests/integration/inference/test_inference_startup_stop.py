"""SIGTERM while vLLM is still starting: the inference service stops its engine and exits at once
instead of waiting for the engine to become healthy (which takes a minute on a CPU)."""

import json
import os
import signal
import subprocess
import time

import pytest
from inference_helpers import VLLM_TEST_ARGS, make_base_model, replica_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # starts vLLM


def engine_pid(log_path) -> int | None:
    for line in log_path.read_text().splitlines():
        if line.startswith("{") and '"child_started"' in line:
            event = json.loads(line)
            if event.get("child") == "engine":
                return event["pid"]
    return None


def test_sigterm_during_engine_startup_stops_engine_and_exits_0(tmp_path, free_ports):
    port, backend_port = free_ports(2)
    model = make_base_model(tmp_path / "model")
    log_path = tmp_path / "inference.out"
    command = replica_command(model, port, backend_port, *VLLM_TEST_ARGS)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, HF_HUB_OFFLINE="1"),
        )
    try:
        deadline = time.monotonic() + 60
        while (pid := engine_pid(log_path)) is None:
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(1.0)  # the engine is importing vLLM: far from healthy
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        code = proc.wait(timeout=30)
        took = time.monotonic() - started
        assert code == 0, log_path.read_text()[-3000:]
        assert took < 20, f"took {took:.1f} s to stop"
        assert "inference_stop_during_startup" in log_path.read_text()
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # the engine was stopped and reaped, not orphaned
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
