"""The verifiers 0.4 env-server client without verifiers: delta assembly, trace -> sample, and the
ZMQ frames against an in-process ROUTER playing the server (the real server is exercised in
tests/integration/orchestrator/test_vf_env_server.py)."""

import asyncio
import contextlib
import re

import msgpack
import pytest
import zmq
import zmq.asyncio

from rlbus.wire import tasks as wire_tasks
from rlbus.wire.replicas import ReplicaInfo
from rlbus.wire.tasks import SamplingArgs
from rlbus_orchestrator.client import NoReplicaError, ReplicaPool
from rlbus_orchestrator.envs import load_environment
from rlbus_orchestrator.envs.vf_server import (
    VfClient,
    VfServerError,
    apply_delta,
    finished_traces,
    problem_of,
    replica_endpoint,
    trace_sample,
)
from rlbus_orchestrator.envs.vf_server_main import name_logprob_tokens


def make_node(parent, role, token_ids, mask, logprobs=(), sampled=False, content="x"):
    return {
        "parent": parent,
        "message": {"role": role, "content": content},
        "sampled": sampled,
        "token_ids": list(token_ids),
        "mask": list(mask),
        "logprobs": list(logprobs),
    }


def make_trace(**overrides):
    trace = {
        "id": "t1",
        "nodes": [
            make_node(None, "system", [1, 2], [False, False]),
            make_node(0, "user", [3, 4], [False, False]),
            # generation-prompt scaffold (5) then sampled tokens (6, 7)
            make_node(1, "assistant", [5, 6, 7], [False, True, True], [-0.5, -0.25], True, "ab"),
        ],
        "calls": [{"finish_reason": "stop", "error": None}],
        "errors": [],
        "rewards": {"lcs_ratio": {"score": 0.5, "weight": 2.0}, "skipped": None},
        "ok": True,
        "timing": {"agent": {"start": 10.0, "end": 11.5}},
    }
    return trace | overrides


def test_trace_becomes_sample_split_at_the_first_sampled_token():
    sample = trace_sample(make_trace(), SamplingArgs(temperature=0.7), policy_version=3)

    assert sample.prompt_token_ids == [1, 2, 3, 4, 5]
    assert sample.completion_token_ids == [6, 7]
    assert sample.completion_mask == [1, 1]
    assert sample.completion_logprobs == [-0.5, -0.25]
    assert sample.reward == 1.0
    assert sample.reward_components == {"lcs_ratio": 0.5}
    assert sample.completion_text == "ab"
    assert (sample.policy_version, sample.temperature, sample.finish_reason) == (3, 0.7, "stop")
    assert sample.timings == {"episode": 1.5}


def test_multi_turn_trace_masks_environment_tokens_between_model_turns():
    trace = make_trace()
    trace["nodes"] += [
        make_node(2, "user", [8, 9], [False, False]),
        make_node(3, "assistant", [10, 11], [False, True], [-1.0], True, "c"),
    ]
    sample = trace_sample(trace, SamplingArgs(), policy_version=0)

    assert sample.completion_token_ids == [6, 7, 8, 9, 10, 11]
    assert sample.completion_mask == [1, 1, 0, 0, 0, 1]
    assert sample.completion_logprobs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert sample.num_turns == 2


def test_a_trace_that_branches_is_refused_instead_of_cut_to_its_last_branch():
    """A harness that rewrote the conversation between two model calls leaves a sampled node off
    the last branch: training only the last branch would drop a turn without a word."""
    trace = make_trace()
    trace["nodes"] += [
        make_node(
            1, "assistant", [12, 13], [False, True], [-1.0], True, "d"
        ),  # a second answer to the user
    ]
    with pytest.raises(VfServerError, match="trace branches \\(1 sampled node"):
        trace_sample(trace, SamplingArgs(), policy_version=0)


def test_trace_without_token_ids_asks_for_the_train_client():
    trace = make_trace()
    for node in trace["nodes"]:
        node["token_ids"], node["mask"], node["logprobs"] = [], [], []
    with pytest.raises(VfServerError, match="train"):
        trace_sample(trace, SamplingArgs(), policy_version=0)


def test_failed_trace_raises_its_last_error():
    trace = make_trace(ok=False, errors=[{"type": "ProviderError", "message": "502"}])
    with pytest.raises(VfServerError, match="ProviderError: 502"):
        trace_sample(trace, SamplingArgs(), policy_version=0)


def test_deltas_assemble_into_the_traces_the_reply_names():
    traces: dict = {}
    nodes = make_trace()["nodes"]
    apply_delta(traces, {"trace": "gone", "open": {"id": "gone"}, "nodes": nodes[:1]})
    apply_delta(traces, {"trace": "gone", "discard": True})
    apply_delta(traces, {"trace": "t1", "open": {"id": "t1"}, "nodes": nodes[:2]})
    apply_delta(traces, {"trace": "t1", "nodes": nodes[2:], "calls": [{}], "set": {"ok": True}})

    (trace,) = finished_traces(traces, [{"id": "t1", "nodes": 3, "calls": 1}])
    assert trace["nodes"] == nodes and trace["ok"] is True
    with pytest.raises(VfServerError, match="did not assemble"):
        finished_traces(traces, [{"id": "t1", "nodes": 4, "calls": 1}])


async def fake_server(socket: zmq.asyncio.Socket, seen: list) -> None:
    """Answers one health and one run request the way verifiers' EnvServer does."""
    while True:
        client_id, request_id, method, payload = await socket.recv_multipart()
        seen.append((method, msgpack.unpackb(payload)))
        if method == b"run":
            trace = make_trace()
            for delta in (
                {"trace": "t1", "open": {"id": "t1"}, "nodes": trace["nodes"]},
                {"trace": "t1", "calls": trace["calls"], "set": {"ok": True}},
            ):
                await socket.send_multipart([client_id, request_id, b"delta", msgpack.packb(delta)])
            reply = {
                "success": True,
                "head": {"id": "e"},
                "traces": [{"id": "t1", "nodes": 3, "calls": 1}],
            }
        else:
            reply = {"success": True}
        await socket.send_multipart([client_id, request_id, b"reply", msgpack.packb(reply)])


@contextlib.asynccontextmanager
async def served(play, exit_code=lambda: None):
    """(our client, the requests seen) against an in-process ROUTER running `play`."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    seen: list = []
    server = asyncio.create_task(play(router, seen))
    client = VfClient(f"tcp://127.0.0.1:{port}", exit_code)
    try:
        await client.wait_healthy(timeout_s=5)
        yield client, seen
    finally:
        await client.close()
        server.cancel()
        router.close()
        ctx.term()


async def test_client_speaks_the_env_server_protocol():
    async with served(fake_server) as (client, seen):
        episode = await client.run({"prompt": "abc"}, {"type": "train"}, "m", {"max_tokens": 8})

    assert [method for method, _ in seen] == [b"health", b"run"]
    assert seen[1][1] == {
        "task_data": {"prompt": "abc"},
        "client": {"type": "train"},
        "model": "m",
        "sampling": {"max_tokens": 8},
    }
    assert episode["head"] == {"id": "e"}
    assert [len(t["nodes"]) for t in episode["traces"]] == [3]


async def silent_server(socket: zmq.asyncio.Socket, seen: list) -> None:
    """Answers health, never answers a run (a stuck episode or a dead server)."""
    while True:
        client_id, request_id, method, payload = await socket.recv_multipart()
        seen.append((method, request_id, msgpack.unpackb(payload)))
        if method == b"health":
            reply = msgpack.packb({"success": True})
            await socket.send_multipart([client_id, request_id, b"reply", reply])


async def run_against_silent_server(exit_code, timeout_s):
    async with served(silent_server, exit_code) as (client, seen):
        with pytest.raises(VfServerError) as raised:
            await asyncio.wait_for(client.run({}, {}, "m", {}, timeout_s=timeout_s), 10)
        await asyncio.sleep(0.2)  # the cancel frame is on its way
    return str(raised.value), seen


async def test_an_episode_past_its_timeout_is_cancelled_on_the_server_and_fails():
    error, seen = await run_against_silent_server(lambda: None, timeout_s=0.5)
    assert "did not answer in 0.5 s" in error
    assert "episode_timeout_s" in error
    (_, run_id, _), (method, _, payload) = seen[-2:]
    assert method == b"cancel" and payload == {"request_id": run_id.decode()}


async def test_a_dead_server_fails_the_episode_within_seconds_not_never():
    exited = {"code": None}
    loop = asyncio.get_running_loop()
    loop.call_later(0.3, exited.update, {"code": -9})
    started = loop.time()
    error, _ = await run_against_silent_server(lambda: exited["code"], timeout_s=None)
    assert "exited with code -9 during run" in error
    assert loop.time() - started < 5


async def answer_run(socket: zmq.asyncio.Socket, client_id: bytes, request_id: bytes) -> None:
    """A successful run's deltas and reply, as verifiers' EnvServer sends them."""
    trace = make_trace()
    for delta in (
        {"trace": "t1", "open": {"id": "t1"}, "nodes": trace["nodes"]},
        {"trace": "t1", "calls": trace["calls"], "set": {"ok": True}},
    ):
        await socket.send_multipart([client_id, request_id, b"delta", msgpack.packb(delta)])
    reply = {"success": True, "head": {"id": "e"}, "traces": [{"id": "t1", "nodes": 3, "calls": 1}]}
    await socket.send_multipart([client_id, request_id, b"reply", msgpack.packb(reply)])


def breaking_server(bad_answer: list[bytes], num_runs: int):
    """A server that answers health, holds the first `num_runs` runs, then sends `bad_answer`
    (frames after the client id) and plays every later run."""

    async def play(socket: zmq.asyncio.Socket, seen: list) -> None:
        while True:
            client_id, request_id, method, payload = await socket.recv_multipart()
            seen.append(method)
            if method == b"health":
                reply = msgpack.packb({"success": True})
                await socket.send_multipart([client_id, request_id, b"reply", reply])
            elif seen.count(b"run") == num_runs:
                await socket.send_multipart([client_id, *bad_answer])
            elif seen.count(b"run") > num_runs:
                await answer_run(socket, client_id, request_id)

    return play


BAD_ANSWERS = {
    "two frames": ([b"r", b"reply"], "expected 3 frames from the env server, got 2"),
    "undecodable": ([b"r", b"reply", b"\xc1"], "undecodable reply payload"),
    "not a map": ([b"r", b"delta", msgpack.packb([1, 2])], "delta payload is a list, not a map"),
    "unknown kind": ([b"r", b"shout", msgpack.packb({})], "unknown answer kind b'shout'"),
}


@pytest.mark.parametrize("bad", BAD_ANSWERS.values(), ids=BAD_ANSWERS.keys())
async def test_a_bad_frame_fails_every_pending_episode_at_once_with_the_cause(bad):
    bad_answer, cause = bad
    async with served(breaking_server(bad_answer, num_runs=3)) as (client, seen):
        loop = asyncio.get_running_loop()
        started = loop.time()
        episodes = [client.run({}, {}, "m", {}, timeout_s=60) for _ in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*episodes, return_exceptions=True), 10)
        failed_after_s = loop.time() - started
        with pytest.raises(VfServerError, match=re.escape(cause)):
            await asyncio.wait_for(client.run({}, {}, "m", {}, timeout_s=60), 1)

    assert failed_after_s < 2  # at once, not after the 60 s episode timeout
    assert [type(result) for result in results] == [VfServerError] * 3
    assert all(cause in str(result) for result in results)
    assert seen.count(b"run") == 3  # the later episode failed without reaching the server


async def test_a_delta_that_does_not_fit_its_run_fails_that_run_only():
    async def play(socket: zmq.asyncio.Socket, seen: list) -> None:
        while True:
            client_id, request_id, method, _ = await socket.recv_multipart()
            seen.append(method)
            reply = msgpack.packb({"success": True})
            if method == b"health":
                await socket.send_multipart([client_id, request_id, b"reply", reply])
            elif seen.count(b"run") == 1:  # a delta for a trace it never opened
                delta = msgpack.packb({"trace": "t9", "nodes": []})
                await socket.send_multipart([client_id, request_id, b"delta", delta])
            else:
                await answer_run(socket, client_id, request_id)

    async with served(play) as (client, _):
        with pytest.raises(VfServerError, match="bad delta"):
            await asyncio.wait_for(client.run({}, {}, "m", {}, timeout_s=60), 5)
        episode = await asyncio.wait_for(client.run({}, {}, "m", {}, timeout_s=60), 5)
        assert client.failure is None  # the receive loop lives on

    assert [len(t["nodes"]) for t in episode["traces"]] == [3]


class StaticClient:
    """A rollout worker's client without a replica pool: the replica is named directly."""

    base_url, model = "http://127.0.0.1:1/v1", "m"


async def test_vf_environment_connects_again_after_its_connection_failed():
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    server = asyncio.create_task(breaking_server([b"r", b"reply"], num_runs=1)(router, []))
    env = load_environment("vf:r", {"address": f"tcp://127.0.0.1:{port}"})
    problem = problem_of({"prompt": "abc"})
    try:
        with pytest.raises(VfServerError, match="expected 3 frames"):
            await asyncio.wait_for(env.run_episode(StaticClient(), problem, SamplingArgs()), 10)
        sample = await asyncio.wait_for(
            env.run_episode(StaticClient(), problem, SamplingArgs()), 10
        )
    finally:
        await env.aclose()
        server.cancel()
        router.close()
        ctx.term()

    assert sample.completion_token_ids == [6, 7]


def test_vf_environment_without_a_venv_says_how_to_make_one():
    with pytest.raises(ValueError, match="uv venv"):
        load_environment("vf:reverse-text-v1", {"python": "/no/such/python"})


class PoolClient:
    model = "served-model"

    def __init__(self, pool):
        self.pool = pool


def test_episode_counts_as_outstanding_on_the_replica_it_was_given():
    pool = ReplicaPool()
    info = ReplicaInfo(replica_id="r1", base_url="http://h:8000/v1", model="m", weights_version=4)
    pool.update([info])
    with replica_endpoint(PoolClient(pool)) as endpoint:
        assert endpoint == ("http://h:8000/v1", "m", 4)
        assert pool.replicas["r1"].outstanding == 1
    assert pool.replicas["r1"].outstanding == 0

    with pytest.raises(NoReplicaError), replica_endpoint(PoolClient(ReplicaPool())):
        pass


def test_task_carries_the_verifiers_row_over_the_bus():
    row = {"idx": 3, "prompt": "abc", "system_prompt": "Reverse.", "answer": "cba", "skills": []}
    task = wire_tasks.Task(task_id="0-3", step=0, env_id="vf:r", problem=problem_of(row))
    decoded = wire_tasks.decoder.decode(wire_tasks.encoder.encode(task))

    assert decoded.problem.info["vf_task_data"] == row
    assert [m.role for m in decoded.problem.messages] == ["system", "user"]
    assert decoded.problem.answer == "cba"


def test_vllm_logprob_entries_get_the_token_name_renderers_checks():
    """vLLM 0.32's generate answer names entries by `token_id` only; the env server names each
    `token_id:<id>` under `token` too (renderers checks that), and leaves a named entry alone."""
    answer = {
        "choices": [
            {
                "token_ids": [5, 7],
                "logprobs": {
                    "content": [
                        {"token_id": 5, "logprob": -0.5},
                        {"token_id": 7, "token": "token_id:7", "logprob": -0.25},
                    ]
                },
            },
            {"token_ids": [], "logprobs": None},
        ]
    }
    named = name_logprob_tokens(answer)

    assert named["choices"][0]["logprobs"]["content"] == [
        {"token_id": 5, "token": "token_id:5", "logprob": -0.5},
        {"token_id": 7, "token": "token_id:7", "logprob": -0.25},
    ]
    assert named["choices"][1] == {"token_ids": [], "logprobs": None}
