"""Two environments in one orchestrator (coordinator and in-process workers) on a real
nats-server, against a small stand-in for vLLM's chat endpoint: each environment's tasks carry
its own sampling and group size, a flaky per-episode environment trains on partial groups, and
every step reports per-environment metrics (docs/orchestrator.md, "Several environments in one
run", "Partial groups").

The stand-in answers chat completions the way vLLM does with `return_token_ids` and `logprobs`
(one token per character, so rewards vary) and records each request's first user message and
sampling. No model: the fast tier runs this; the real engine is in test_orchestrator.py."""

import asyncio
import http.server
import json
import random
import threading
import uuid
from collections.abc import Iterator

import pytest

from rlbus.bus import Bus
from rlbus.configs.bus import BusConfig
from rlbus.configs.orchestrator import OrchestratorConfig
from rlbus_orchestrator.env_mix import EnvMix
from rlbus_orchestrator.service import serve

FLAKY_ENV = '''
"""A verifiers-style environment whose reward function fails every 5th call."""

import itertools

_calls = itertools.count()


def length_reward(text):
    if next(_calls) % 5 == 4:
        raise RuntimeError("flaky reward")
    return len(text) / 10


class _Rubric:
    funcs = [length_reward]


class _Env:
    dataset = [{"question": f"count {i}", "answer": ""} for i in range(40)]
    rubric = _Rubric()


def load_environment(**args):
    return _Env()
'''


class ChatStandIn(http.server.BaseHTTPRequestHandler):
    """`POST /v1/chat/completions` -> n choices of 1..8 random letters (one token each)."""

    requests: list[dict] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        user = next(m["content"] for m in body["messages"] if m["role"] == "user")
        self.requests.append({"user": user, **{k: body.get(k) for k in ("temperature", "n")}})
        rng = random.Random()
        choices = []
        for index in range(body.get("n", 1)):
            text = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 8)))
            choices.append(
                {
                    "index": index,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                    "token_ids": [ord(c) for c in text],
                    "logprobs": {"content": [{"token": c, "logprob": -0.5} for c in text]},
                }
            )
        data = json.dumps({"prompt_token_ids": [1, 2, 3], "choices": choices}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def chat_stand_in() -> Iterator[str]:
    ChatStandIn.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ChatStandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def flaky_env(tmp_path, monkeypatch) -> str:
    """The id of FLAKY_ENV, importable as a module (the verifiers convention of env lookup)."""
    name = f"flaky_env_{uuid.uuid4().hex[:6]}"
    (tmp_path / f"{name}.py").write_text(FLAKY_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name.replace("_", "-")


async def test_two_environments_train_with_their_own_settings_and_report_per_env_metrics(
    nats_server, chat_stand_in, flaky_env, tmp_path
):
    run_id = f"envs_{uuid.uuid4().hex[:8]}"
    config = OrchestratorConfig(
        run={"name": run_id},
        output_dir=str(tmp_path),
        bus=BusConfig(url=nats_server.url, token=nats_server.token, run_id=run_id),
        model={"name": "stand-in"},
        inference_urls=[chat_stand_in],
        env=[
            {"id": "reverse-text", "group_size": 2, "sampling": {"temperature": 0.3}},
            {"id": flaky_env, "group_size": 4, "episode_timeout_s": 30},
        ],
        batch_size=8,
        min_group_size=2,
        async_level=100,
        max_off_policy_steps=100,
        max_steps=4,
        seq_len=128,
        filter_zero_advantage=False,
        sampling={"max_tokens": 8},
    )
    await asyncio.wait_for(serve(config), timeout=120)

    bus = await Bus.connect(config.bus, run_id=run_id, storage_dir=tmp_path / run_id, name="test")
    try:
        batches = [await bus.step_log.read(step) for step in range(1, 5)]
    finally:
        await bus.close()
    rows = [batch.metrics for batch in batches]
    for env_id in ("reverse-text", flaky_env):
        assert sum(m[f"env/{env_id}/trained_samples"] for m in rows) > 0, env_id
        assert all(f"env/{env_id}/dropped/error" in m for m in rows)
    assert all(
        m["env/reverse-text/trained_samples"] + m[f"env/{flaky_env}/trained_samples"]
        == m["reward/num_samples"]
        for m in rows
    )
    # every 5th reward call of the flaky env fails: its groups of 4 lose episodes, not whole groups
    assert sum(m[f"env/{flaky_env}/episodes_dropped/error"] for m in rows) > 0
    assert sum(m["env/reverse-text/episodes_dropped/error"] for m in rows) == 0
    mix = EnvMix(config)  # a batch holding fewer samples than its groups' sizes trained partials
    full = sum(mix.of_task(task_id).group_size for b in batches for task_id in b.task_ids)
    assert sum(b.num_samples for b in batches) < full
    # each environment's tasks were sampled with its own settings
    temperatures = {(r["user"].startswith("count"), r["temperature"]) for r in ChatStandIn.requests}
    assert temperatures == {(False, 0.3), (True, 1.0)}
    assert {r["n"] for r in ChatStandIn.requests if not r["user"].startswith("count")} == {2}
