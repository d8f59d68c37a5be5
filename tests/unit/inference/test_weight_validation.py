"""The checks before a weight update touches the engine, on a tiny torch model (no vLLM):
`rlbus_inference.validation` (names, shapes, dtypes, bytes, finite values) and
`rlbus_inference.admin_access` (confined paths, the admin token, exposure), the public gate's own
answers, and `inference` refusing an exposed admin port at start (exit 2, before vLLM loads)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import httpx
import pytest
import torch
from replica_support import inference_command, replica_command
from safetensors.torch import save_file

from rlbus.configs.inference import InferenceConfig
from rlbus.netutil import free_port
from rlbus.secrets import SecretError
from rlbus_inference import admin_access, engine_process, gate, validation


def tiny_state_dict() -> dict[str, torch.Tensor]:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3))
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def save(directory: Path, tensors: dict[str, torch.Tensor], name: str = "model.safetensors"):
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / name))
    return directory / name


@pytest.fixture
def reference(tmp_path) -> dict[str, validation.Spec]:
    return validation.file_specs([save(tmp_path / "base", tiny_state_dict())])


def nan_in(tensors):
    tensors["1.weight"][0, 0] = float("nan")
    return tensors


def inf_in(tensors):
    tensors["0.weight"][1, 1] = float("-inf")
    return tensors


def renamed(tensors):
    tensors["2.weight"] = tensors.pop("1.weight")
    return tensors


def extra(tensors):
    tensors["lm_head.weight"] = torch.zeros(3, 4)
    return tensors


def missing(tensors):
    del tensors["1.bias"]
    return tensors


def transposed(tensors):
    tensors["1.weight"] = tensors["1.weight"].t().contiguous()
    return tensors


def int_dtype(tensors):
    tensors["1.bias"] = tensors["1.bias"].to(torch.int64)
    return tensors


# (case, how the update differs from the model, the expected problem)
BAD_UPDATES = [
    ("nan", nan_in, "tensor 1.weight: holds NaN or infinite values"),
    ("inf", inf_in, "tensor 0.weight: holds NaN or infinite values"),
    ("unknown name", renamed, "tensor 2.weight: not a tensor of the served model"),
    ("extra tensor", extra, "tensor lm_head.weight: not a tensor of the served model"),
    ("missing tensor", missing, "tensor 1.bias: missing"),
    ("wrong shape", transposed, "tensor 1.weight: shape [4, 3] but the served model has [3, 4]"),
    ("int for float", int_dtype, "tensor 1.bias: dtype I64 but the served model has F32"),
]


@pytest.mark.parametrize(
    ("case", "change", "problem"), BAD_UPDATES, ids=[c[0] for c in BAD_UPDATES]
)
def test_a_bad_update_is_refused_naming_the_tensor(tmp_path, reference, case, change, problem):
    files = [save(tmp_path / "update", change(tiny_state_dict()))]
    with pytest.raises(validation.WeightsRefused) as refused:
        validation.check_files(files, reference, check_finite=True)
    assert problem in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_good_update_passes_and_float_dtypes_may_differ(tmp_path, reference):
    as_bf16 = {k: v.to(torch.bfloat16) for k, v in tiny_state_dict().items()}
    validation.check_files([save(tmp_path / "a", tiny_state_dict())], reference, check_finite=True)
    validation.check_files([save(tmp_path / "b", as_bf16)], reference, check_finite=True)


def test_the_finite_check_can_be_turned_off(tmp_path, reference):
    files = [save(tmp_path / "update", nan_in(tiny_state_dict()))]
    validation.check_files(files, reference, check_finite=False)


@pytest.mark.parametrize("cut", [1, 100, 10_000])
def test_a_truncated_file_is_refused_by_name(tmp_path, cut):
    path = save(tmp_path / "update", tiny_state_dict())
    os.truncate(path, max(path.stat().st_size - cut, 0))
    with pytest.raises(validation.WeightsRefused, match="file model.safetensors: not a valid"):
        validation.file_specs([path])


def test_garbage_and_duplicate_tensors_are_refused(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\xff" * 64)
    with pytest.raises(validation.WeightsRefused, match="file junk.safetensors"):
        validation.file_specs([junk])
    tensors = tiny_state_dict()
    a = save(tmp_path / "dup", tensors, "a.safetensors")
    b = save(tmp_path / "dup", {"1.bias": tensors["1.bias"]}, "b.safetensors")
    with pytest.raises(validation.WeightsRefused, match="tensor 1.bias: found twice"):
        validation.file_specs([a, b])


def test_broadcast_headers_are_compared_like_files(reference):
    good = [
        (n, str(t.dtype).removeprefix("torch."), tuple(t.shape))
        for n, t in tiny_state_dict().items()
    ]
    assert validation.compare(validation.broadcast_specs(good), reference) == []
    bad = [(n, d, (1, *s)) if n == "0.weight" else (n, d, s) for n, d, s in good]
    assert validation.compare(validation.broadcast_specs(bad), reference) == [
        "tensor 0.weight: shape [1, 10, 4] but the served model has [10, 4]"
    ]
    assert validation.total_bytes(reference) == (10 * 4 + 3 * 4 + 3) * 4


def test_a_long_refusal_lists_the_first_problems_and_counts_the_rest():
    refused = validation.WeightsRefused([f"tensor t{i}: missing" for i in range(12)])
    assert str(refused).endswith("tensor t4: missing; and 7 more")


# ---- paths -----------------------------------------------------------------------------------


@pytest.fixture
def root(tmp_path) -> Path:
    step = tmp_path / "run" / "broadcasts" / "step_1"
    save(step, tiny_state_dict())
    (tmp_path / "outside").mkdir()
    return (tmp_path / "run" / "broadcasts").resolve()


def bad_paths(root: Path) -> list[tuple[str, str, str]]:
    outside = root.parent.parent / "outside"
    return [
        ("relative", "step_1", "must be an absolute path"),
        ("dotdot", f"{root}/step_1/../step_1", "must not contain '..'"),
        ("escape", f"{root}/../../outside", "must not contain '..'"),
        ("outside", str(outside), "is outside the weights directory"),
        ("absolute system dir", "/etc", "is outside the weights directory"),
        ("missing", f"{root}/step_9", "does not exist"),
        ("nul", f"{root}/step_1\0", "not a usable path"),
        ("too long", "/" + "a" * 5000, "not a usable path"),
    ]


@pytest.mark.parametrize("index", range(8))
def test_request_paths_are_confined_to_the_weights_root(root, index):
    case, raw, reason = bad_paths(root)[index]
    with pytest.raises(admin_access.PathRefused, match=reason.replace("(", r"\(")):
        admin_access.confined_dir("path", raw, root)


def test_a_symlink_out_of_the_root_and_a_fifo_are_refused(root, tmp_path):
    link = root / "step_2"
    link.symlink_to(tmp_path / "outside")
    with pytest.raises(admin_access.PathRefused, match="outside the weights directory"):
        admin_access.confined_dir("path", str(link), root)
    fifo = root / "step_1" / "extra.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(admin_access.PathRefused, match="extra.safetensors is not a regular file"):
        admin_access.regular_files(root / "step_1", "*.safetensors", root)
    assert admin_access.confined_dir("path", str(root / "step_1"), root) == root / "step_1"


def test_the_weights_root_is_the_runs_broadcasts_directory_unless_configured(tmp_path):
    assert admin_access.weights_root(InferenceConfig()) is None
    assert admin_access.weights_root(InferenceConfig(run_dir="/r")) == Path("/r/broadcasts")
    config = InferenceConfig(run_dir="/r", admin={"weights_root": "/w"})
    assert admin_access.weights_root(config) == Path("/w")


# ---- the admin token -------------------------------------------------------------------------


def test_a_non_loopback_admin_bind_needs_a_token(monkeypatch, tmp_path):
    monkeypatch.delenv(admin_access.ADMIN_TOKEN_ENV, raising=False)
    assert admin_access.admin_token(InferenceConfig()) is None  # loopback: fine without
    with pytest.raises(admin_access.AdminExposed, match="--admin.host 0.0.0.0 exposes"):
        admin_access.admin_token(InferenceConfig(admin={"host": "0.0.0.0"}))
    monkeypatch.setenv(admin_access.ADMIN_TOKEN_ENV, "s3cret")
    assert admin_access.admin_token(InferenceConfig(admin={"host": "0.0.0.0"})) == "s3cret"


def test_the_token_file_must_be_owner_only(tmp_path):
    token_file = tmp_path / "admin.token"
    token_file.write_text("from-file\n")
    token_file.chmod(0o644)
    config = InferenceConfig(admin={"host": "10.0.0.5", "token_file": str(token_file)})
    with pytest.raises(SecretError, match="admin.token_file: .* `chmod 600"):
        admin_access.admin_token(config)
    token_file.chmod(0o600)
    assert admin_access.admin_token(config) == "from-file"


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        ("Bearer s3cret", True),
        ("bearer s3cret", True),
        ("Bearer wrong", False),
        ("Basic s3cret", False),
        ("s3cret", False),
        ("", False),
        (None, False),
    ],
)
def test_authorized_wants_the_exact_bearer_token(header, ok):
    assert admin_access.authorized(header, "s3cret") is ok


def test_the_engine_gets_the_token_in_its_environment_only(monkeypatch):
    monkeypatch.setenv(admin_access.ADMIN_TOKEN_ENV, "from-parent")
    env = engine_process.engine_env(
        initial_version=0,
        gate_facing_port=1,
        mark={},
        admin=admin_access.engine_env(InferenceConfig(run_dir="/r"), "tok"),
    )
    assert env[admin_access.ADMIN_TOKEN_ENV] == "tok"
    assert env[admin_access.WEIGHTS_ROOT_ENV].endswith("/r/broadcasts")
    assert env[admin_access.CHECK_FINITE_ENV] == "1"
    assert admin_access.ADMIN_TOKEN_ENV not in engine_process.child_env(
        {}
    )  # no other child sees it
    assert "tok" not in " ".join(engine_process.engine_command(InferenceConfig()))


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("node1", False),
    ],
)
def test_loopback_addresses(host, loopback):
    assert admin_access.is_loopback(host) is loopback


@pytest.mark.parametrize(
    ("path", "public"),
    [
        ("/v1/chat/completions", True),
        ("/v1/completions", True),
        ("/v1/models", True),
        ("/health", True),
        ("/metrics", True),
        ("/inference/v1/generate", True),
        ("/tokenize", True),
        ("/detokenize", False),
        ("/tokenize/../pause", False),
        ("/inference/v1/generate/../../render", False),
        ("/render", False),
        ("/derender", False),
        ("/v1/load_lora_adapter", False),
        ("/v1/unload_lora_adapter/", False),
        ("/v1/../add_worker", False),
        ("/add_worker", False),
        ("/remove_worker", False),
        ("/workers", False),
        ("/list_workers", False),
        ("/flush_cache", False),
        ("/scale_elastic_ep", False),
        ("/update_weights", False),
        ("/pause", False),
        ("/", False),
    ],
)
def test_the_public_port_allows_only_the_openai_api_health_and_metrics(path, public):
    assert gate.is_public(path) is public


# ---- the public gate without an upstream: what it answers itself ------------------------------


@contextlib.asynccontextmanager
async def gate_client(origins: list[str]):
    app = gate.PublicGate(f"http://127.0.0.1:{free_port()}", origins)  # nothing listens there
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gate") as client:
            yield client
    finally:
        await app.aclose()


async def test_cors_preflights_are_refused_unless_the_origin_is_configured():
    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"}
    async with gate_client([]) as off, gate_client(["http://ui.example"]) as on:
        refused = await off.options("/v1/chat/completions", headers=preflight)
        allowed = await on.options("/v1/chat/completions", headers=preflight)
        other = await on.options(
            "/v1/chat/completions", headers={**preflight, "Origin": "http://x"}
        )
    assert refused.status_code == 403 and "cors_allowed_origins" in refused.json()["error"]
    assert allowed.status_code == 204
    assert allowed.headers["access-control-allow-origin"] == "http://ui.example"
    assert other.status_code == 403


async def test_the_gate_refuses_closed_paths_huge_bodies_and_names_a_dead_engine():
    async with gate_client([]) as client:
        closed = await client.post("/add_worker", json={"url": "http://evil"})
        huge = await client.post("/v1/completions", content=b"x" * (gate.MAX_BODY_BYTES + 1))
        dead = await client.get("/v1/models")
    assert closed.status_code == 404 and "not served on the public port" in closed.json()["error"]
    assert huge.status_code == 413
    assert dead.status_code == 502 and "engine unreachable" in dead.json()["error"]


async def test_the_gate_passes_answers_byte_for_byte_generate_included():
    """A real upstream HTTP server stands for vLLM: the gate only allows and denies, so vLLM's
    token API answers (logprob entries with `token_id` only) pass unchanged, with their own
    Content-Length; the verifiers env server names the entries itself (docs/environments.md)."""
    from aiohttp import web

    generate = b'{"choices": [{"token_ids": [5], "logprobs": {"content": [{"token_id": 5}]}}]}'
    chat = b'{"choices": [{"logprobs": {"content": [{"token_id": 5}]}}]}'

    async def on_generate(request):
        return web.Response(body=generate, content_type="application/json")

    async def on_chat(request):
        return web.Response(body=chat, content_type="application/json")

    app = web.Application()
    app.router.add_post("/inference/v1/generate", on_generate)
    app.router.add_post("/v1/chat/completions", on_chat)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    public = gate.PublicGate(f"http://127.0.0.1:{port}", [])
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=public), base_url="http://gate"
        ) as client:
            generated = await client.post("/inference/v1/generate", json={"token_ids": [1]})
            chatted = await client.post("/v1/chat/completions", json={})
    finally:
        await public.aclose()
        await runner.cleanup()
    assert generated.status_code == 200 and generated.content == generate
    assert int(generated.headers["content-length"]) == len(generate)
    assert chatted.content == chat


# ---- start-up refusals (no vLLM: the check runs before the engine starts) ----------------------


@pytest.mark.parametrize(
    ("admin_args", "message"),
    [
        (["--admin.host", "0.0.0.0"], "--admin.host 0.0.0.0 exposes"),
        (["--admin.host", "192.0.2.77"], "--admin.host 192.0.2.77 exposes"),
        (["--admin.host", "0.0.0.0", "--admin.token-file", "/nonexistent/t"], "does not exist"),
    ],
)
def test_an_exposed_admin_port_without_a_token_is_refused_at_start(tmp_path, admin_args, message):
    (tmp_path / "config.json").write_text("{}")  # a model directory, as far as loading checks
    port, backend = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "RLBUS_ADMIN_TOKEN"}
    done = subprocess.run(
        [*replica_command(tmp_path, port, backend), *admin_args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert message in " ".join(done.stderr.split())
    assert "Traceback" not in done.stderr


def test_a_readable_token_file_is_refused_at_start(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("t")
    token_file.chmod(0o644)
    (tmp_path / "config.json").write_text("{}")
    port, backend = free_port(), free_port()
    done = subprocess.run(
        [*inference_command(), "--vllm.model", str(tmp_path), "--server.port", str(port)]
        + ["--backend-port", str(backend), "--admin.token-file", str(token_file)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "chmod 600" in done.stderr, done.stderr
