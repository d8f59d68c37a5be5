import asyncio
import json

import httpx
import pytest

from rlbus.wire.replicas import ReplicaInfo
from rlbus.wire.tasks import SamplingArgs
from rlbus_orchestrator.client import InferenceClient, NoReplicaError, ReplicaPool
from rlbus_orchestrator.task_issue import dataset_index


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


def group_json(n, prompt=(1, 2, 3)):
    """A vLLM chat completion with `n` choices, listed out of `index` order; choice i has i+1
    tokens (10*i, 10*i+1, ...) with logprobs -(i+1)/10."""
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": f"c{i}"},
            "finish_reason": "stop" if i % 2 else "length",
            "token_ids": [10 * i + k for k in range(i + 1)],
            "logprobs": {"content": [{"logprob": -(i + 1) / 10} for _ in range(i + 1)]},
        }
        for i in range(n)
    ]
    return {"prompt_token_ids": list(prompt), "choices": choices[::-1]}


def test_parse_turns_gives_each_choice_its_own_tokens_and_logprobs_in_index_order():
    from rlbus_orchestrator.client import parse_turns

    turns = parse_turns(group_json(3), 3, version=5, replica_id="a")
    assert [t.text for t in turns] == ["c0", "c1", "c2"]
    assert [t.completion_token_ids for t in turns] == [[0], [10, 11], [20, 21, 22]]
    assert [t.completion_logprobs for t in turns] == [[-0.1], [-0.2, -0.2], [-0.3] * 3]
    assert [t.finish_reason for t in turns] == ["length", "stop", "length"]
    assert all(t.prompt_token_ids == [1, 2, 3] and t.policy_version == 5 for t in turns)
    turns[0].prompt_token_ids.append(9)  # each turn owns its prompt list
    assert turns[1].prompt_token_ids == [1, 2, 3]


@pytest.mark.parametrize(
    "data, match",
    [
        (group_json(2), "asked for 3 choices, got 2"),
        (group_json(4), "asked for 3 choices, got 4"),
        ({"choices": group_json(3)["choices"]}, "no prompt_token_ids"),
    ],
)
def test_parse_turns_refuses_a_wrong_choice_count_or_missing_prompt_ids(data, match):
    from rlbus_orchestrator.client import BadResponseError, parse_turns

    with pytest.raises(BadResponseError, match=match):
        parse_turns(data, 3, version=0, replica_id="a")


def test_parse_turns_refuses_a_choice_whose_logprobs_do_not_match_its_tokens():
    from rlbus_orchestrator.client import BadResponseError, parse_turns

    data = group_json(3)
    data["choices"][0]["logprobs"]["content"].pop()
    with pytest.raises(BadResponseError, match="3 completion tokens but 2 logprobs"):
        parse_turns(data, 3, version=0, replica_id="a")


def test_chat_n_sends_one_request_with_n_and_the_sampling_args():
    bodies = []

    def handler(request):
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json=group_json(4), headers={"X-Rlbus-Weights-Version": "3"})

    client, _ = make_client(handler, [make_replica("a")])
    sampling = SamplingArgs(temperature=1.0, max_tokens=7, seed=11, extra={"n": 99})
    turns = asyncio.run(client.chat_n([{"role": "user", "content": "x"}], sampling, 4))
    (body,) = bodies
    assert body["n"] == 4 and body["seed"] == 11 and body["max_tokens"] == 7
    assert body["logprobs"] is True and body["return_token_ids"] is True
    assert len(turns) == 4 and {t.policy_version for t in turns} == {3}
    assert all(t.replica_id == "a" and "generate" in t.timings for t in turns)


def test_chat_n_backs_off_a_replica_that_returns_too_few_choices_and_retries_another():
    def handler(request):
        return httpx.Response(200, json=group_json(1 if request.url.host == "a" else 2))

    client, pool = make_client(handler, [make_replica("a"), make_replica("b")])
    pool.replicas["b"].num_requests = 1  # "a" is tried first
    turns = asyncio.run(client.chat_n([], SamplingArgs(), 2))
    assert [t.replica_id for t in turns] == ["b", "b"]
    assert pool.replicas["a"].failures == 1


def test_chat_is_a_one_choice_request():
    bodies = []

    def handler(request):
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json=completion_json())

    client, _ = make_client(handler, [make_replica("a")])
    turn = asyncio.run(client.chat([], SamplingArgs()))
    assert bodies[0]["n"] == 1 and turn.completion_token_ids == [5, 6]


def test_greedy_chat_n_asks_for_one_completion_and_copies_it():
    """vLLM refuses n > 1 with temperature 0 (HTTP 400); every greedy sample is the same."""
    bodies = []

    def handler(request):
        bodies.append(json.loads(request.content))
        if bodies[-1]["n"] > 1:
            return httpx.Response(400, json={"error": "n must be 1 when using greedy sampling"})
        return httpx.Response(200, json=completion_json())

    client, _ = make_client(handler, [make_replica("a")])
    turns = asyncio.run(client.chat_n([], SamplingArgs(temperature=0.0), 3))
    assert [b["n"] for b in bodies] == [1]
    assert [t.completion_token_ids for t in turns] == [[5, 6]] * 3
    turns[0].completion_token_ids.append(7)  # copies, not one shared turn
    assert turns[1].completion_token_ids == [5, 6]


def test_a_later_turn_sends_its_exact_prompt_ids_and_tools_and_reads_tool_calls():
    """A multi-turn episode's later turn: vLLM generates from the ids it is given
    (`kv_transfer_params.prompt_token_ids`) and parses tool calls from the output."""
    from rlbus_orchestrator.envs.base import TurnRequest

    seen = []

    def handler(request):
        seen.append(json.loads(request.content))
        data = completion_json()
        data["choices"][0]["message"] = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call-1", "type": "function",
                 "function": {"name": "search", "arguments": '{"query": "x"}'}},
            ],
        }  # fmt: skip
        return httpx.Response(200, json=data)

    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    client, _ = make_client(handler, [make_replica("a"), make_replica("b")])
    turn = asyncio.run(
        client.chat(
            [{"role": "user", "content": "x"}],
            SamplingArgs(),
            TurnRequest(tools=tools, prompt_token_ids=[1, 2, 3, 4]),
            prefer="b",
        )
    )
    assert seen[0]["tools"] == tools
    assert seen[0]["kv_transfer_params"] == {"prompt_token_ids": [1, 2, 3, 4]}
    assert turn.replica_id == "b"  # the episode's replica, though "a" is as free
    assert turn.text == ""
    assert [(c.id, c.function.name, c.function.arguments) for c in turn.tool_calls] == [
        ("call-1", "search", '{"query": "x"}')
    ]


def test_tokenize_chat_asks_the_replicas_tokenize_endpoint_with_the_generation_prompt():
    seen = []

    def handler(request):
        seen.append((str(request.url), json.loads(request.content)))
        return httpx.Response(200, json={"count": 3, "tokens": [7, 8, 9]})

    client, _ = make_client(handler, [make_replica("a")])
    messages = [{"role": "tool", "content": "r", "tool_call_id": "c"}]
    assert asyncio.run(client.tokenize_chat(messages)) == [7, 8, 9]
    url, body = seen[0]
    assert url == "http://a/tokenize"
    assert body == {"model": "m", "messages": messages, "add_generation_prompt": True}


def test_a_tokenize_answer_without_ids_backs_the_replica_off():
    def handler(request):
        return httpx.Response(200, json={"tokens": "no"})

    client, pool = make_client(handler, [make_replica("a")])
    with pytest.raises(NoReplicaError):
        asyncio.run(client.tokenize_chat([{"role": "user", "content": "x"}]))
    assert pool.replicas["a"].failures == 1
