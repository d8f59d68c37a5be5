import asyncio

import httpx
import pytest

from rlbus.wire.replicas import ReplicaInfo
from rlbus.wire.tasks import SamplingArgs
from rlbus_orchestrator.client import InferenceClient, NoReplicaError, ReplicaPool
from rlbus_orchestrator.coordinator import dataset_index


def make_replica(rid, version=0, status="ready"):
    return ReplicaInfo(
        replica_id=rid,
        base_url=f"http://{rid}/v1",
        model="m",
        weights_version=version,
        status=status,
    )


def completion_json(ids=(5, 6)):
    return {
        "prompt_token_ids": [1, 2, 3],
        "choices": [
            {
                "message": {"role": "assistant", "content": "ab"},
                "finish_reason": "length",
                "token_ids": list(ids),
                "logprobs": {"content": [{"logprob": -0.25} for _ in ids]},
            }
        ],
    }


def make_client(handler, replicas):
    pool = ReplicaPool()
    pool.update(replicas)
    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return InferenceClient(pool, http, "m"), pool


def test_pool_picks_least_outstanding_ready_replica():
    pool = ReplicaPool()
    pool.update([make_replica("a"), make_replica("b"), make_replica("c", status="starting")])
    pool.replicas["a"].outstanding = 3
    assert pool.pick(set()).info.replica_id == "b"
    assert pool.pick({"b"}).info.replica_id == "a"
    assert "c" not in pool.replicas


def test_chat_reads_tokens_logprobs_and_version_header():
    def handler(request):
        return httpx.Response(200, json=completion_json(), headers={"X-Rlbus-Weights-Version": "7"})

    client, _ = make_client(handler, [make_replica("a", version=2)])
    turn = asyncio.run(client.chat([{"role": "user", "content": "x"}], SamplingArgs()))
    assert turn.prompt_token_ids == [1, 2, 3]
    assert turn.completion_token_ids == [5, 6]
    assert turn.completion_logprobs == [-0.25, -0.25]
    assert turn.policy_version == 7 and turn.finish_reason == "length"


def test_chat_retries_on_another_replica_when_one_fails():
    seen = []

    def handler(request):
        seen.append(request.url.host)
        if request.url.host == "a":
            raise httpx.ConnectError("down")
        return httpx.Response(200, json=completion_json())

    client, pool = make_client(handler, [make_replica("a"), make_replica("b", version=4)])
    turn = asyncio.run(client.chat([], SamplingArgs()))
    assert turn.replica_id == "b" and turn.policy_version == 4
    assert seen[-1] == "b"
    assert pool.pick(set()).info.replica_id == "b"  # a is cooling down


def test_chat_raises_no_replica_when_all_fail():
    def handler(request):
        return httpx.Response(503)

    client, _ = make_client(handler, [make_replica("a"), make_replica("b")])
    with pytest.raises(NoReplicaError):
        asyncio.run(client.chat([], SamplingArgs()))


def test_finite_dataset_cursor_visits_every_example_once_per_epoch():
    first = [dataset_index(c, 10, seed=3) for c in range(10)]
    second = [dataset_index(c, 10, seed=3) for c in range(10, 20)]
    assert sorted(first) == sorted(second) == list(range(10))
    assert first == [dataset_index(c, 10, seed=3) for c in range(10)]
    assert dataset_index(42, None, seed=3) == 42
