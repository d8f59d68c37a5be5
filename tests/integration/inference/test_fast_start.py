"""`fast_start` (the default on CPU; docs/inference.md, "Start-up"): vLLM's EngineCore and
worker are forked from the API server instead of spawned, the sampler ranks logprobs eagerly, the
replica serves what a `--no-fast-start` replica serves, and its forked processes still die with
their parent.
"""

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from inference_helpers import make_base_model
from replica_support import VLLM_TEST_ARGS, alive_of, start_standalone

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # starts vLLM twice

ORPHAN_DEADLINE_S = 10.0


def sampled(replica, model: str) -> list[dict]:
    """Four seeded samples of one prompt: token ids and logprobs of each."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "abcdef"}],
        "max_tokens": 12,
        "n": 4,
        "temperature": 1.0,
        "seed": 1234,
        "logprobs": True,
        "return_token_ids": True,
    }
    response = httpx.post(replica.public_url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return [
        {
            "token_ids": choice["token_ids"],
            "logprobs": [c["logprob"] for c in choice["logprobs"]["content"]],
        }
        for choice in response.json()["choices"]
    ]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process (from /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def titled(replica, title: str) -> list[int]:
    return [pid for pid, cmd in replica.descendants().items() if cmd.startswith(title)]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    root = tmp_path_factory.mktemp("fast-start")
    model = make_base_model(root / "model")
    started = []
    try:
        for name, args in (("fast", []), ("spawn", ["--no-fast-start"])):
            started.append(
                start_standalone(model, root / f"{name}.log", vllm_args=[*VLLM_TEST_ARGS, *args])
            )
        yield dict(model=str(model), fast=started[0], spawn=started[1])
    finally:
        for replica in started:
            replica.stop()


def test_fast_start_forks_the_engine_core_and_worker(replicas):
    """A spawned EngineCore imports vLLM and torch again before serving (seconds of CPU); a
    forked one starts with them imported. (setproctitle renames both, so their command lines
    cannot tell.) Measured before any request, so serving adds nothing to either."""
    fast, spawn = replicas["fast"], replicas["spawn"]
    (fast_core,), (spawn_core,) = (
        titled(fast, "VLLM::EngineCore"),
        titled(spawn, "VLLM::EngineCore"),
    )
    assert titled(fast, "VLLM::Worker")
    assert cpu_seconds(spawn_core) > 2.0
    assert cpu_seconds(fast_core) < cpu_seconds(spawn_core) / 3


def test_a_fast_started_replica_samples_what_a_spawned_one_does(replicas):
    fast = sampled(replicas["fast"], replicas["model"])
    spawn = sampled(replicas["spawn"], replicas["model"])
    assert [s["token_ids"] for s in fast] == [s["token_ids"] for s in spawn]
    assert len({tuple(s["token_ids"]) for s in fast}) > 1  # four different samples
    for ours, theirs in zip(fast, spawn, strict=True):
        assert ours["logprobs"] == pytest.approx(theirs["logprobs"], abs=1e-5)


def test_forked_engine_processes_die_with_the_api_server(replicas):
    fast = replicas["fast"]
    forked = titled(fast, "VLLM::EngineCore") + titled(fast, "VLLM::Worker")
    api_server = [pid for pid, cmd in fast.descendants().items() if "api_server" in cmd]
    assert len(forked) == 2 and len(api_server) == 1
    os.kill(api_server[0], signal.SIGKILL)
    deadline = time.monotonic() + ORPHAN_DEADLINE_S
    while alive_of(forked) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive_of(forked) == [], "the forked EngineCore/worker outlived their API server"
