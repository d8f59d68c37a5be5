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


def test_failing_replica_backs_off_exponentially_capped_and_recovers_on_success(monkeypatch):
    from rlbus_orchestrator import client as client_module

    now = [100.0]
    monkeypatch.setattr(client_module.time, "monotonic", lambda: now[0])
    pool = ReplicaPool(backoff_s=1.0, backoff_max_s=5.0)
    pool.update([make_replica("a")])
    replica = pool.replicas["a"]
    delays = []
    for _ in range(5):
        pool.mark_down(replica, "HTTP 500")
        delays.append(replica.down_until - now[0])
        pool.mark_down(replica, "HTTP 500")  # in flight when it went down: not counted again
        assert pool.pick(set()) is None
        now[0] = replica.down_until
    assert delays == [1.0, 2.0, 4.0, 5.0, 5.0] and replica.failures == 5
    assert pool.refresh_now.is_set()
    assert pool.pick(set()) is replica
    pool.mark_up(replica)
    pool.mark_down(replica, "HTTP 500")
    assert replica.down_until - now[0] == 1.0


def test_a_replica_that_registers_again_starts_healthy():
    pool = ReplicaPool()
    pool.update([make_replica("a")])
    pool.mark_down(pool.replicas["a"], "ConnectError")
    restarted = ReplicaInfo(
        replica_id="a",
        base_url="http://a/v1",
        model="m",
        started_at=pool.replicas["a"].info.started_at + 1,
    )
    pool.update([restarted])
    assert pool.replicas["a"].failures == 0 and pool.pick(set()) is not None


def test_http_client_has_the_configured_deadlines():
    from rlbus.configs.orchestrator import InferenceHttpConfig
    from rlbus_orchestrator.client import make_http_client

    http = make_http_client(InferenceHttpConfig(connect_timeout_s=2.0, read_timeout_s=9.0), 4)
    assert (http.timeout.connect, http.timeout.read) == (2.0, 9.0)
    asyncio.run(http.aclose())


@pytest.mark.parametrize(
    "body",
    [
        {"choices": []},
        {"prompt_token_ids": [1], "choices": [{"message": {}, "token_ids": [5], "logprobs": None}]},
        {"choices": [{"message": {}, "token_ids": [], "logprobs": None}]},
        "not json",
    ],
)
def test_a_garbage_200_backs_the_replica_off_and_the_next_one_answers(body):
    def handler(request):
        if request.url.host == "a":
            if isinstance(body, str):
                return httpx.Response(200, content=body.encode())
            return httpx.Response(200, json=body)
        return httpx.Response(200, json=completion_json())

    client, pool = make_client(handler, [make_replica("a"), make_replica("b")])
    pool.replicas["b"].num_requests = 1  # "a" is tried first
    turn = asyncio.run(client.chat([], SamplingArgs()))
    assert turn.replica_id == "b" and pool.replicas["a"].failures == 1
