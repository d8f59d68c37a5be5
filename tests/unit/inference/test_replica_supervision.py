"""Unit tests of how a replica watches its children and judges weights records: with real child
processes (`sleep`) and an engine stand-in over httpx.MockTransport (only the HTTP answer is
faked; the agent's decisions are what is tested)."""

import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from rlbus.configs.inference import InferenceConfig
from rlbus.netutil import free_port
from rlbus.wire import weights
from rlbus_inference import engine_plugin, engine_process
from rlbus_inference.weight_agent import WeightAgent, WeightApplyError, WeightRejected


@pytest.fixture
def sleepers():
    started: list[subprocess.Popen] = []

    def start(n: int) -> list[subprocess.Popen]:
        started.extend(subprocess.Popen(["sleep", "60"]) for _ in range(n))
        return started[-n:]

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def test_how_it_ended_names_the_signal_or_the_code():
    assert engine_process.how_it_ended(-9) == "was killed by SIGKILL"
    assert engine_process.how_it_ended(3) == "exited with code 3"
    assert engine_process.how_it_ended(None) == "exited"


def test_zombie_returncode_reads_the_status_of_an_unreaped_process(sleepers):
    (proc,) = sleepers(1)
    proc.send_signal(signal.SIGKILL)
    deadline = 50
    while (code := engine_process.zombie_returncode(proc.pid)) is None and deadline:
        deadline -= 1
        subprocess.run(["sleep", "0.1"])
    assert code == -signal.SIGKILL


def watch_of(sleepers, **health) -> tuple[engine_process.ChildWatch, subprocess.Popen]:
    (engine,) = sleepers(1)
    config = InferenceConfig(
        backend_port=free_port(), server={"host": "127.0.0.1"}, health=health or {}
    )
    children = {"engine": (engine, Path("/logs/e.log"))}
    return engine_process.ChildWatch(config, children, engine_log=Path("/logs/e.log")), engine


def test_a_child_that_exits_is_named_with_how_it_ended_and_its_log(sleepers):
    watch, engine = watch_of(sleepers)
    watch.check_processes()  # alive: nothing raised
    engine.send_signal(signal.SIGKILL)
    engine.wait()
    expected = rf"^engine \(pid {engine.pid}\) was killed by SIGKILL; its output is in /logs/e.log"
    with pytest.raises(engine_process.ChildExited, match=expected):
        watch.check_processes()


async def test_health_failing_n_times_in_a_row_is_a_death(sleepers):
    watch, _ = watch_of(sleepers, failures=2, timeout_s=0.5)  # nothing listens on backend_port
    async with httpx.AsyncClient() as http:
        await watch.check_health(http)
        assert watch.failures == 1
        with pytest.raises(engine_process.ChildExited) as raised:
            await watch.check_health(http)
    assert str(raised.value).startswith("engine /health failed 2 times in a row")
    assert str(raised.value).endswith("its output is in /logs/e.log")


class Events:
    """Stands in for the bus: records what the agent publishes."""

    def __init__(self):
        self.published: list = []
        self.subjects = type("S", (), {"weights_failed": "failed", "weights_applied": "applied"})

    async def publish(self, subject, data, msg_id=None):
        self.published.append((subject, weights.decoder.decode(data)))


def agent_with(answer, tmp_path=None, changes=None) -> tuple[WeightAgent, Events]:
    bus = Events()

    async def on_change(version, status, model):
        if changes is not None:
            changes.append((version, status, model))

    http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    config = InferenceConfig(weights_apply_timeout_s=1.0)
    agent = WeightAgent(bus, config, http, on_change, replica_id="r0")
    agent.loaded_version = 5
    return agent, bus


def record(version: int, location: Path, files=()) -> weights.WeightsPublished:
    return weights.WeightsPublished(
        version=version,
        transport="filesystem",
        location=str(location),
        files=[weights.WeightFile(name=n, size=1, sha256="0" * 64) for n in files],
    )


def test_records_that_can_never_apply_are_named(tmp_path):
    agent, _ = agent_with(lambda request: httpx.Response(200, json={}))
    assert "lower than the loaded version 5" in agent.refusal(record(4, tmp_path))
    assert "does not exist" in agent.refusal(record(6, tmp_path / "gone"))
    assert "model.safetensors missing" in agent.refusal(record(6, tmp_path, ["model.safetensors"]))
    assert agent.refusal(record(6, tmp_path)) is None


@pytest.mark.parametrize(
    ("status", "error"), [(422, WeightRejected), (400, WeightRejected), (500, WeightApplyError)]
)
async def test_engine_answers_are_refusals_or_retryable(status, error):
    agent, _ = agent_with(lambda request: httpx.Response(status, text="why"))
    with pytest.raises(error, match=f"/update_weights answered {status}: why"):
        await agent.loader.post("/update_weights", {})


async def test_an_engine_that_does_not_answer_in_time_is_a_retryable_failure():
    def hang(request):
        raise httpx.ReadTimeout("slow", request=request)

    agent, _ = agent_with(hang)
    with pytest.raises(WeightApplyError, match=r"no answer from /update_weights within 1 s"):
        await agent.loader.post("/update_weights", {})


async def test_a_refused_record_is_reported_once_and_never_retried(tmp_path):
    calls = []

    def refuse(request):
        calls.append(request.url.path)
        return httpx.Response(422, text="sha256 mismatch")

    agent, bus = agent_with(refuse)
    bad = record(6, tmp_path)
    await agent.apply_with_retry(bad)
    await agent.apply_with_retry(bad)  # the same record delivered again
    assert calls == ["/update_weights"]
    assert [(s, m.version) for s, m in bus.published] == [("failed", 6)]
    assert "sha256 mismatch" in bus.published[0][1].reason
    assert agent.loaded_version == 5

    lower = record(3, tmp_path)
    await agent.apply_with_retry(lower)
    assert calls == ["/update_weights"]  # refused before asking the engine
    assert bus.published[-1][1].version == 3


async def test_a_replica_serving_an_adapter_advertises_it_as_its_model(tmp_path):
    calls, changes = [], []

    def load(request):
        calls.append(request.url.path)
        return httpx.Response(200, json={"status": "ok"})

    agent, bus = agent_with(load, changes=changes)
    adapter = weights.WeightsPublished(
        version=6, transport="filesystem", location=str(tmp_path), lora_name="policy"
    )
    await agent.apply_with_retry(adapter)
    assert calls == ["/load_lora_adapter"]
    assert changes[-1] == (6, "ready", "policy")
    assert [(s, m.version) for s, m in bus.published] == [("applied", 6)]


def test_the_engine_plugin_acts_only_in_a_marked_engine(monkeypatch):
    monkeypatch.delenv(engine_plugin.GUARD_ENV, raising=False)
    assert not engine_plugin.is_engine_core()
    engine_plugin.register()  # not marked: no patch check, no parent-death signal asked for


def test_leftovers_of_the_mark_are_ended_but_not_our_ancestors(sleepers):
    import os

    from rlbus import process_marks

    mark = process_marks.mark_env(f"unit-{os.getpid()}", "inference-u")
    leftover = subprocess.Popen(["sleep", "60"], env={**os.environ, **mark})
    try:
        # This process stands in for an ancestor carrying the mark (as `uv run` would).
        os.environ.update(mark)
        engine_process.end_marked(mark, grace_s=2.0)
        assert leftover.wait(5) == -signal.SIGTERM
        assert os.getppid() in engine_process.ancestors(os.getpid())
    finally:
        for key in mark:
            os.environ.pop(key, None)
        leftover.kill()
        leftover.wait()


def test_an_undecodable_record_is_skipped_with_one_line_per_revision():
    agent, _ = agent_with(lambda request: httpx.Response(200, json={}))
    assert agent.decode(b"garbage", 7) is None
    assert agent.decode(b"garbage", 7) is None  # the same revision seen again (watch reopened)
    assert agent.undecodable == {7}
