"""How a replica's weight agent joins the nccl broadcast group: with the ranks of the record,
once per group generation, and a failed broadcast reported once (not retried: the trainer sends a
version once). The engine is an httpx.MockTransport stand-in that records the requests."""

import json

import httpx
import pytest

from rlbus.configs.inference import InferenceConfig
from rlbus.wire import weights
from rlbus_inference.weight_agent import EngineWeightLoader, WeightRejected


def make_agent(status: int = 200) -> tuple[EngineWeightLoader, list[tuple[str, dict]]]:
    requests: list[tuple[str, dict]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        requests.append((request.url.path, json.loads(request.content)))
        return httpx.Response(status, json={"status": "ok"}, text=None if status == 200 else "x")

    config = InferenceConfig(weights_apply_timeout_s=1.0, replica_id="r2")
    http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    return EngineWeightLoader(http, config, replica_id="r2"), requests


def nccl_record(version: int, port: int, ranks: dict[str, int], world_size: int):
    return weights.WeightsPublished(
        version=version,
        transport="nccl",
        location=f"10.0.0.1:{port}",
        ranks=ranks,
        world_size=world_size,
    )


async def test_a_replica_joins_with_its_ranks_once_per_generation():
    agent, requests = make_agent()
    await agent.receive_broadcast(nccl_record(1, 4000, {"r1": 1, "r2": 3}, 5))
    await agent.receive_broadcast(nccl_record(2, 4000, {"r1": 1, "r2": 3}, 5))
    await agent.receive_broadcast(nccl_record(3, 4001, {"r2": 1}, 3))  # re-formed: new port
    joins = [body for path, body in requests if path == "/init_broadcaster"]
    assert [(j["port"], j["rank_offset"], j["world_size"]) for j in joins] == [
        (4000, 3, 5),
        (4001, 1, 3),
    ]
    assert [b["version"] for p, b in requests if p == "/update_weights"] == [1, 2, 3]


async def test_a_record_without_a_rank_table_is_the_two_rank_group():
    agent, requests = make_agent()
    await agent.receive_broadcast(nccl_record(1, 4000, {}, 0))
    assert requests[0][1]["rank_offset"] == 1 and requests[0][1]["world_size"] == 2


async def test_a_replica_left_out_of_a_generation_waits_for_the_next():
    agent, requests = make_agent()
    with pytest.raises(WeightRejected, match="not in the broadcast group of version 4"):
        await agent.receive_broadcast(nccl_record(4, 4000, {"r1": 1}, 2))
    assert requests == []


async def test_a_failed_broadcast_is_not_retried_and_the_group_is_joined_afresh():
    agent, requests = make_agent(status=500)
    record = nccl_record(1, 4000, {"r2": 1}, 2)
    agent.broadcast_location = record.location  # joined already
    with pytest.raises(WeightRejected, match="nccl broadcast of version 1 failed.*not resent"):
        await agent.receive_broadcast(record)
    assert agent.broadcast_location is None
