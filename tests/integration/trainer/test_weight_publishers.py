"""Weight publishers against a real nats-server: the nccl path over gloo (receiver = the
inference side of `rlbus.broadcast`) and its timeout; the filesystem path's checksums and pruning
of unused versions."""

import asyncio
import json
import time
from types import SimpleNamespace

import torch
from broadcast_support import join, results, spawn_receiver, stop

from rlbus import broadcast
from rlbus.checksums import sha256_file
from rlbus.configs.trainer import TrainerConfig
from rlbus.wire import replicas, weights
from rlbus.wire.subjects import WEIGHTS_LATEST_KEY
from rlbus_trainer.engine import World
from rlbus_trainer.tiny_model import build_tiny_model
from rlbus_trainer.weights import FilesystemWeightPublisher, NcclWeightPublisher


def make_engine(state: dict[str, torch.Tensor], tied=True):
    return SimpleNamespace(
        # the publishers walk the model's state dict (rlbus_trainer.stream_state)
        model=SimpleNamespace(
            state_dict=lambda: state, config=SimpleNamespace(tie_word_embeddings=tied)
        ),
    )


def receive_one_version(host: str, port: int, out: dict) -> None:
    """The inference side of the broadcast protocol: rank 1 of 2."""
    group = broadcast.open_group(host, port, 1, 2, 30, torch.device("cpu"))
    header = broadcast.receive_header(group)
    out["version"] = header.version
    out["tensors"] = dict(broadcast.receive_tensors(group, header))


async def latest(bus):
    entry = await bus.kv(bus.subjects.weights_bucket).get(
        WEIGHTS_LATEST_KEY, weights.published_decoder
    )
    return entry.value if entry else None


async def register(bus, replica_id: str, tensor_parallel_size: int = 1) -> None:
    info = replicas.ReplicaInfo(
        replica_id=replica_id,
        base_url="http://x/v1",
        model="m",
        tensor_parallel_size=tensor_parallel_size,
    )
    await bus.kv(bus.subjects.replicas_bucket).put(replica_id, replicas.encoder.encode(info))


def make_nccl_publisher(bus, tmp_path, timeout_s: float) -> NcclWeightPublisher:
    config = TrainerConfig(weight_broadcast={"type": "nccl", "timeout_s": timeout_s})
    world = World(0, 1, torch.device("cpu"))
    return NcclWeightPublisher(config, bus=bus, run_dir=tmp_path, world=world, host="127.0.0.1")


async def test_nccl_publisher_broadcasts_tensor_by_tensor_over_gloo(bus, tmp_path):
    await register(bus, "r1")
    publisher = make_nccl_publisher(bus, tmp_path, 30)
    state = {
        "model.embed_tokens.weight": torch.randn(10, 4),
        "model.norm.weight": torch.ones(4),
        "lm_head.weight": torch.randn(10, 4),
    }
    received: dict = {}

    async def agent():
        while (published := await latest(bus)) is None:
            await asyncio.sleep(0.05)
        host, _, port = published.location.rpartition(":")
        await asyncio.to_thread(receive_one_version, host, int(port), received)
        return published

    agent_task = asyncio.create_task(agent())
    metrics = await publisher.publish(7, make_engine(state))
    published = await agent_task
    assert "publish_failed" not in metrics
    assert published.transport == "nccl" and published.version == 7
    assert (published.ranks, published.world_size) == ({"r1": 1}, 2)
    assert received["version"] == 7
    assert set(received["tensors"]) == {
        "model.embed_tokens.weight",
        "model.norm.weight",
    }  # tied head dropped
    torch.testing.assert_close(
        received["tensors"]["model.embed_tokens.weight"], state["model.embed_tokens.weight"]
    )


async def test_nccl_publisher_reports_failure_instead_of_hanging(bus, tmp_path):
    await register(bus, "r1")  # registered, but its workers never join
    publisher = make_nccl_publisher(bus, tmp_path, 2)
    sub = await bus.nc.subscribe(bus.subjects.weights_failed)
    started = time.monotonic()
    metrics = await publisher.publish(1, make_engine({"w": torch.ones(2)}))
    assert metrics["publish_failed"] == 1.0
    assert time.monotonic() - started < 10
    failed = weights.decoder.decode((await sub.next_msg(timeout=5)).data)
    assert isinstance(failed, weights.WeightsFailed)
    assert failed.version == 1 and failed.replica_id == "trainer"
    assert "rank(s) [1] of 2 did not join" in failed.reason and "'r1': 1" in failed.reason


async def receivers_for(bus, version: int, tensor_parallel: dict[str, int], idle, tmp_path):
    """What the replicas' workers do: once `version` is announced, each replica in its rank
    table has one receiver process per worker join with rank first + k (the `idle` processes are
    started beforehand: their start-up must not eat into the rendezvous deadline)."""
    while (published := await latest(bus)) is None or published.version != version:
        await asyncio.sleep(0.05)
    _, _, port = published.location.rpartition(":")
    processes = []
    for replica, first in published.ranks.items():
        for k in range(tensor_parallel[replica]):
            out = tmp_path / f"v{version}-{replica}-{k}.json"
            processes.append(
                join(idle.pop(), int(port), first + k, published.world_size, out, timeout_s=5)
            )
    stop(idle, timeout_s=0)  # those of replicas not in the group
    return published, processes


async def publish_to_receivers(bus, publisher, version, tensor_parallel, tmp_path):
    idle = await asyncio.gather(
        *(asyncio.to_thread(spawn_receiver) for _ in range(sum(tensor_parallel.values())))
    )
    agents = asyncio.create_task(receivers_for(bus, version, tensor_parallel, idle, tmp_path))
    metrics = await publisher.publish(version, make_engine({"w": torch.full((3,), version)}))
    published, processes = await agents
    assert "publish_failed" not in metrics, metrics
    return published, processes


async def test_nccl_group_reforms_when_a_replica_leaves_or_joins(bus, tmp_path):
    """Every worker of every replica is a rank; a leave or a join forms a new generation on a new
    port for the next version, and a replica that missed versions gets the next one."""
    tp = {"r1": 2, "r2": 1, "r3": 1}
    await register(bus, "r1", 2)
    await register(bus, "r2")
    publisher = make_nccl_publisher(bus, tmp_path, 5)
    first, gen1 = await publish_to_receivers(bus, publisher, 1, tp, tmp_path)
    assert (first.ranks, first.world_size) == ({"r1": 1, "r2": 3}, 4)

    await bus.kv(bus.subjects.replicas_bucket).delete("r2")  # r2 leaves
    second, gen2 = await publish_to_receivers(bus, publisher, 2, tp, tmp_path)
    assert (second.ranks, second.world_size) == ({"r1": 1}, 3)
    assert second.location != first.location
    assert stop(gen1) == [0, 0, 0]  # generation 1 was dropped: its receivers failed, in time

    await register(bus, "r3")  # r3 joins, having missed versions 1 and 2
    third, gen3 = await publish_to_receivers(bus, publisher, 3, tp, tmp_path)
    assert (third.ranks, third.world_size) == ({"r1": 1, "r3": 3}, 4)
    await publisher.close()
    assert stop(gen2 + gen3) == [0] * 5
    got = results(tmp_path / "v3-r3-0.json")
    assert got[0] == {"version": 3, "sums": {"w": 9.0}} and "error" in got[1]
    assert [r.get("version") for r in results(tmp_path / "v1-r1-1.json")] == [1, None]


async def test_a_replica_restarted_under_its_id_gets_a_new_group_without_a_failed_version(
    bus, tmp_path
):
    """Same id, same tensor-parallel size, new process (`started_at`): its new workers were
    never in the group, so the next version forms a new one instead of failing first."""
    tp = {"r1": 1}
    await register(bus, "r1")
    publisher = make_nccl_publisher(bus, tmp_path, 3)
    first, gen1 = await publish_to_receivers(bus, publisher, 1, tp, tmp_path)
    stop(gen1, timeout_s=0)  # the replica process dies and starts again under its id
    await register(bus, "r1")  # a new entry: same id and size, a later started_at
    second, gen2 = await publish_to_receivers(bus, publisher, 2, tp, tmp_path)
    assert second.location != first.location and second.ranks == {"r1": 1}
    await publisher.close()
    assert stop(gen2) == [0]
    assert results(tmp_path / "v2-r1-0.json")[0] == {"version": 2, "sums": {"w": 6.0}}


async def test_nccl_publisher_fails_in_time_when_a_worker_dies_then_reforms(bus, tmp_path):
    tp = {"r1": 1, "r2": 1}
    await register(bus, "r1")
    await register(bus, "r2")
    publisher = make_nccl_publisher(bus, tmp_path, 3)
    _, gen1 = await publish_to_receivers(bus, publisher, 1, tp, tmp_path)
    gen1[1].kill()  # r2's worker dies between versions (its lease has not expired yet)
    gen1[1].wait()
    started = time.monotonic()
    metrics = await publisher.publish(2, make_engine({"w": torch.ones(1 << 20)}))
    assert metrics["publish_failed"] == 1.0 and time.monotonic() - started < 3 * 2 + 5
    stop(gen1)
    await bus.kv(bus.subjects.replicas_bucket).delete("r2")  # its lease expires
    third, gen2 = await publish_to_receivers(bus, publisher, 3, tp, tmp_path)
    assert third.ranks == {"r1": 1}
    await publisher.close()
    assert stop(gen2) == [0]


async def test_filesystem_publisher_checksums_and_keeps_versions_in_use(bus, tmp_path):
    model = build_tiny_model(tmp_path / "tiny")
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(model).state_dict()
    config = TrainerConfig(model={"name": str(model)}, weight_broadcast={"keep_last": 1})
    publisher = FilesystemWeightPublisher(
        config, bus=bus, run_dir=tmp_path, world=World(0, 1, torch.device("cpu"))
    )
    replica = replicas.ReplicaInfo(
        replica_id="r1", base_url="http://x/v1", model="m", weights_version=1
    )
    await bus.kv(bus.subjects.replicas_bucket).put("r1", replicas.encoder.encode(replica))
    for step in (1, 2, 3):
        await publisher.publish(step, make_engine(state))
    published = await latest(bus)
    assert published.version == 3
    for f in published.files:
        assert sha256_file(tmp_path / "broadcasts" / "step_3" / f.name) == f.sha256
    assert "lm_head.weight" not in json.dumps([f.name for f in published.files])
    # keep_last=1 keeps step 3; step 1 survives because replica r1 still serves it.
    assert sorted(p.name for p in (tmp_path / "broadcasts").iterdir()) == ["step_1", "step_3"]
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "broadcasts").iterdir())


async def test_the_weights_version_never_goes_backwards(bus, tmp_path):
    """The KV key `latest` is written by compare-and-set: a version not above the bus's is
    refused (nothing announced), a newer one goes through; a garbage record counts as 0."""
    from rlbus_trainer.weights import latest_version

    model = build_tiny_model(tmp_path / "tiny")
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(model).state_dict()
    config = TrainerConfig(model={"name": str(model)}, weight_broadcast={"keep_last": 4})
    publisher = FilesystemWeightPublisher(
        config, bus=bus, run_dir=tmp_path, world=World(0, 1, torch.device("cpu"))
    )
    kv = bus.kv(bus.subjects.weights_bucket)
    await kv.put(WEIGHTS_LATEST_KEY, b"\xc1 garbage")
    assert await latest_version(bus) == 0
    assert "publish_refused" not in await publisher.publish(3, make_engine(state))
    assert await latest_version(bus) == 3
    for stale in (3, 2):
        assert (await publisher.publish(stale, make_engine(state)))["publish_refused"] == 1.0
        assert (await latest(bus)).version == 3
    assert "publish_refused" not in await publisher.publish(4, make_engine(state))
    assert await latest_version(bus) == 4
