"""Control requests to a real coordinator over a real nats-server (no vLLM): a stand-in worker
in the test takes the tasks and answers them when told, so what is in flight is under control."""

import asyncio
import json
import time
import uuid

import pytest
from orch_support import good_rollout

from rlbus.configs.bus import BusConfig
from rlbus.configs.orchestrator import OrchestratorConfig
from rlbus.lifecycle import ServiceState
from rlbus.wire import control
from rlbus.wire import tasks as tasks_wire
from rlbus_orchestrator.service import serve
from rlbus_orchestrator.state_store import STATE_KEY

BATCH_SIZE = 4
GROUP_SIZE = 2
TASKS_PER_STEP = BATCH_SIZE // GROUP_SIZE


class StandInWorker:
    """Consumes the tasks stream; holds each task until `release()` answers it with a rollout."""

    def __init__(self, bus):
        self.bus = bus
        self.received: list[str] = []
        self.held: asyncio.Queue = asyncio.Queue()
        s = bus.subjects
        self.consumer = bus.consumer(
            s.tasks_stream, s.tasks_durable, tasks_wire.decoder, self.handle, concurrency=64
        )

    async def handle(self, delivery) -> None:
        self.received.append(delivery.data.task_id)
        await self.held.put(delivery.data)

    async def release(self, num: int) -> None:
        for _ in range(num):
            task = await asyncio.wait_for(self.held.get(), 10)
            rollout = good_rollout(task, policy_version=0)
            await self.bus.publish(self.bus.subjects.rollouts, rollout, msg_id=task.task_id)


def make_config(server, run_id: str, tmp_path) -> OrchestratorConfig:
    return OrchestratorConfig(
        role="coordinator",
        run={"name": run_id},
        output_dir=str(tmp_path),
        bus=BusConfig(url=server.url, token=server.token, run_id=run_id),
        batch_size=BATCH_SIZE,
        group_size=GROUP_SIZE,
        async_level=0,  # one step's tasks at a time: what is issued is known exactly
        max_off_policy_steps=100,
        max_steps=None,
        seq_len=64,
        num_train_ranks=1,
        filter_zero_advantage=False,
    )


async def wait_for(predicate, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def saved_state(bus) -> dict:
    kv = await bus.js.key_value(bus.subjects.state_bucket)
    return json.loads((await kv.get(STATE_KEY)).value)


@pytest.fixture
async def coordinator(nats_server, make_bus, tmp_path):
    """(service task, its state, a client bus, the stand-in worker) of one run."""
    run_id = f"ctl_{uuid.uuid4().hex[:8]}"
    bus = await make_bus(run_id=run_id)
    worker = StandInWorker(bus)
    state = ServiceState("orchestrator")
    service = asyncio.create_task(serve(make_config(nats_server, run_id, tmp_path), state))
    async with worker.consumer:
        try:
            yield service, state, bus, worker
        finally:
            service.cancel()
            await asyncio.gather(service, return_exceptions=True)


def weights_applied(version: int) -> bytes:
    from rlbus.wire import weights as weights_wire

    applied = weights_wire.WeightsApplied(version=version, replica_id="replica-a")
    return weights_wire.encoder.encode(applied)


async def request(bus, message) -> control.ControlReply:
    return await bus.request("orchestrator", message, timeout_s=5)


async def test_pause_stops_issuing_until_resume(coordinator):
    service, state, bus, worker = coordinator
    await wait_for(lambda: len(worker.received) == TASKS_PER_STEP)

    reply = await request(bus, control.Pause(reason="test"))
    assert reply.ok and reply.state == "paused"
    await worker.release(TASKS_PER_STEP)  # step 1 is still batched while paused ...
    deadline = time.monotonic() + 15
    while (await saved_state(bus))["next_step"] != 2:
        assert time.monotonic() < deadline, "step 1 was not batched while paused"
        await asyncio.sleep(0.1)
    await bus.publish(bus.subjects.weights_applied, weights_applied(1))  # step 2 may start
    await asyncio.sleep(1.5)
    assert len(worker.received) == TASKS_PER_STEP  # ... but nothing new is issued

    reply = await request(bus, control.Resume())
    assert reply.ok and reply.state == "running"
    await wait_for(lambda: len(worker.received) == 2 * TASKS_PER_STEP)
    assert not service.done()


async def test_drain_waits_for_the_rollouts_in_flight_then_returns(coordinator):
    service, state, bus, worker = coordinator
    await wait_for(lambda: len(worker.received) == TASKS_PER_STEP)

    reply = await request(bus, control.Drain(reason="test"))
    assert reply.ok and reply.state == "draining"
    await asyncio.sleep(1.0)
    assert not service.done(), "drain returned with rollouts still in flight"

    await worker.release(TASKS_PER_STEP)
    await asyncio.wait_for(service, 15)  # returns normally: exit code 0 in the process
    saved = await saved_state(bus)
    assert saved["next_step"] == 2 and saved["outstanding"] == {}  # the in-flight work was batched
    assert len(worker.received) == TASKS_PER_STEP  # and nothing new was issued


async def test_stop_returns_at_once_and_leaves_in_flight_tasks_for_the_next_coordinator(
    coordinator,
):
    service, state, bus, worker = coordinator
    await wait_for(lambda: len(worker.received) == TASKS_PER_STEP)

    reply = await request(bus, control.Stop(reason="test"))
    assert reply.ok and reply.state == "stopping"
    await asyncio.wait_for(service, 5)
    saved = await saved_state(bus)
    assert saved["next_step"] == 1 and len(saved["outstanding"]) == TASKS_PER_STEP


async def test_a_drain_ends_coordinator_and_workers_within_the_budget_even_if_inference_hangs(
    nats_server, tmp_path, monkeypatch
):
    """Inference accepts the workers' requests and never answers (an engine stuck under load):
    the drain still ends the whole service within the drain budget, so a launcher's SIGKILL
    after its grace never comes; the abandoned tasks stay in the stream for the next run."""
    from rlbus_orchestrator import coordinator as coordinator_module
    from rlbus_orchestrator import worker as worker_module

    budget_s = 4.0
    monkeypatch.setattr(coordinator_module, "DRAIN_TIMEOUT_S", 2.0)
    monkeypatch.setattr(coordinator_module, "DRAIN_BUDGET_S", budget_s)
    monkeypatch.setattr(worker_module, "DRAIN_BUDGET_S", budget_s)
    requests = []

    async def never_answer(reader, writer):
        requests.append(await reader.read(100))
        await asyncio.Event().wait()

    stuck = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = stuck.sockets[0].getsockname()[1]
    run_id = f"ctl_{uuid.uuid4().hex[:8]}"
    config = make_config(nats_server, run_id, tmp_path)
    config.role = "all"
    config.inference_urls = [f"http://127.0.0.1:{port}/v1"]
    state = ServiceState("orchestrator")
    service = asyncio.create_task(serve(config, state))
    try:
        await wait_for(lambda: len(requests) >= GROUP_SIZE, 30)  # the workers are stuck in HTTP
        state.drain("test")
        started = time.monotonic()
        await asyncio.wait_for(service, budget_s + 5)
        assert time.monotonic() - started < budget_s + 2
    finally:
        service.cancel()
        await asyncio.gather(service, return_exceptions=True)
        stuck.close()
