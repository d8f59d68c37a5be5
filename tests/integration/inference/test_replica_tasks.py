"""The bus side of a replica (lease + weight agent) in the service shell, over a real
nats-server and without an engine: a drain withdraws the lease and ends the tasks, with lifecycle
events started / ready / draining / stopped (failed after a dead child); a current
weights record that cannot apply is refused once and the replica still registers; a NATS outage
(8 s here, 30 s in the slow tier) does not end the replica and its registry entry comes back."""

import asyncio
import time
import uuid

import pytest
from inference_helpers import registered

from rlbus.bus.errors import LeaseHeld
from rlbus.configs.bus import BusConfig
from rlbus.configs.inference import InferenceConfig
from rlbus.lifecycle import ServiceState, TaskFailed
from rlbus.wire import events
from rlbus_inference.engine_process import FAILED_PREFIX
from rlbus_inference.replica import run_replica_tasks


async def wait_for(predicate, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


async def test_a_drain_withdraws_the_lease_and_ends_the_replica_tasks(nats_server, make_bus):
    run_id = f"rep_{uuid.uuid4().hex[:8]}"
    bus = await make_bus(run_id=run_id)
    config = InferenceConfig(
        replica_id="replica-a",
        bus=BusConfig(url=nats_server.url, token=nats_server.token, run_id=run_id),
    )
    lifecycle = await lifecycle_events(bus)
    state = ServiceState("inference")
    tasks = asyncio.create_task(run_replica_tasks(config, state))
    try:
        await wait_for(lambda: has_lease(bus))
        assert not tasks.done(), tasks.exception()
        info = (await registered(bus))["replica-a"]
        assert info.status == "ready" and info.weights_version == 0
        # Registered under an address other hosts reach (not `localhost`, the wildcard's fqdn
        # on hosts that map their name to 127.0.0.1).
        assert "localhost" not in info.base_url and "0.0.0.0" not in info.base_url

        state.drain("test")
        await asyncio.wait_for(tasks, 10)
        assert await registered(bus) == {}
        await wait_for(has_states(lifecycle, 4))
        assert [e.state for e in lifecycle] == ["started", "ready", "draining", "stopped"]
        assert {(e.service, e.instance_id) for e in lifecycle} == {("inference", "replica-a")}
        assert lifecycle[0].reason == f"serving {info.base_url.removesuffix('/v1')}"
        assert lifecycle[-1].reason == "test"
    finally:
        tasks.cancel()


async def test_a_replica_ended_by_a_dead_child_says_failed(nats_server, make_bus):
    run_id = f"rep_{uuid.uuid4().hex[:8]}"
    bus = await make_bus(run_id=run_id)
    lifecycle = await lifecycle_events(bus)
    state = ServiceState("inference")
    tasks = asyncio.create_task(run_replica_tasks(replica_config(nats_server, run_id), state))
    try:
        await wait_for(lambda: has_lease(bus))
        state.drain(f"{FAILED_PREFIX} a child process ended")  # what `serve` says then
        await asyncio.wait_for(tasks, 10)
        await wait_for(has_states(lifecycle, 4))
        assert lifecycle[-1].state == "failed" and "child process" in lifecycle[-1].reason
    finally:
        tasks.cancel()


async def lifecycle_events(bus) -> list:
    """Inference lifecycle events published from now on, in order."""
    received = []

    async def on_event(event, headers) -> None:
        received.append(event)

    await bus.subscribe(bus.subjects.lifecycle("inference"), events.decoder, on_event)
    return received


def has_states(received: list, count: int):
    async def check() -> bool:
        return len(received) >= count

    return check


async def has_lease(bus) -> bool:
    return "replica-a" in await registered(bus)


def replica_config(nats_server, run_id: str) -> InferenceConfig:
    return InferenceConfig(
        replica_id="replica-a",
        lease_ttl_s=3,
        bus=BusConfig(url=nats_server.url, token=nats_server.token, run_id=run_id),
    )


async def test_a_current_record_that_cannot_apply_is_refused_once_and_the_replica_registers(
    nats_server, make_bus, tmp_path
):
    """At start-up the replica loads the current `latest` record before registering; one whose
    directory is gone is refused (one weights.failed), and the replica registers with version 0."""
    from rlbus.wire import weights
    from rlbus.wire.subjects import WEIGHTS_LATEST_KEY

    run_id = f"rep_{uuid.uuid4().hex[:8]}"
    bus = await make_bus(run_id=run_id)
    missing = weights.WeightsPublished(
        version=4, transport="filesystem", location=str(tmp_path / "gone")
    )
    await bus.kv(bus.subjects.weights_bucket).put(
        WEIGHTS_LATEST_KEY, weights.encoder.encode(missing)
    )
    sub = await bus.nc.subscribe(bus.subjects.weights_failed)
    state = ServiceState("inference")
    tasks = asyncio.create_task(run_replica_tasks(replica_config(nats_server, run_id), state))
    try:
        await wait_for(lambda: has_lease(bus))
        info = (await registered(bus))["replica-a"]
        assert (info.weights_version, info.status) == (0, "ready")
        failed = weights.decoder.decode((await sub.next_msg(timeout=5)).data)
        assert failed.version == 4 and "does not exist" in failed.reason
        await asyncio.sleep(3.0)  # a retry would show up here
        with pytest.raises(TimeoutError):
            await sub.next_msg(timeout=0.5)
        assert not tasks.done()
    finally:
        state.drain("test")
        await asyncio.wait_for(tasks, 10)


@pytest.mark.parametrize(
    "outage_s", [8.0, pytest.param(30.0, marks=pytest.mark.slow)], ids=["8s", "30s"]
)
async def test_a_nats_outage_does_not_end_the_replica_and_its_entry_comes_back(
    nats_server, make_bus, outage_s
):
    """Longer than the lease TTL (3 s): the entry expires meanwhile and must come back."""
    run_id = f"rep_{uuid.uuid4().hex[:8]}"
    state = ServiceState("inference")
    tasks = asyncio.create_task(run_replica_tasks(replica_config(nats_server, run_id), state))
    bus = None
    try:
        probe = await make_bus(run_id=run_id)
        await wait_for(lambda: has_lease(probe))
        nats_server.kill()
        await asyncio.sleep(outage_s)
        assert not tasks.done(), tasks.exception()
        nats_server.start()
        bus = await make_bus(run_id=run_id)
        await wait_for(lambda: has_lease(bus), timeout_s=30)
        assert not tasks.done()
    finally:
        state.drain("test")
        await asyncio.wait_for(tasks, 15)


async def test_with_exit_when_finished_the_replica_drains_once_the_run_is_finished(
    nats_server, make_bus
):
    run_id = f"rep_{uuid.uuid4().hex[:8]}"
    bus = await make_bus(run_id=run_id)
    config = replica_config(nats_server, run_id).model_copy(update={"exit_when_finished": True})
    state = ServiceState("inference")
    tasks = asyncio.create_task(run_replica_tasks(config, state))
    try:
        await wait_for(lambda: has_lease(bus))
        await bus.mark_finished(last_step=5)
        await asyncio.wait_for(tasks, 15)
        assert state.ending and await registered(bus) == {}
    finally:
        tasks.cancel()


async def test_a_replica_whose_id_another_live_holder_has_fails(nats_server, make_bus):
    """Two replicas with one id (a clash): the second must fail (exit 1 in the service shell, so
    `restart: on-failure` and the supervisor see it), never stand by silently with exit 0."""
    run_id = f"rep_{uuid.uuid4().hex[:8]}"
    config = replica_config(nats_server, run_id).model_copy(update={"lease_ttl_s": 1})
    first_state = ServiceState("inference")
    probe = await make_bus(run_id=run_id)
    first = asyncio.create_task(run_replica_tasks(config, first_state))
    try:
        await wait_for(lambda: has_lease(probe))
        with pytest.raises(TaskFailed) as failure:
            await asyncio.wait_for(run_replica_tasks(config, ServiceState("inference")), 15)
        assert isinstance(failure.value.error, LeaseHeld)
        assert not first.done()
    finally:
        first_state.drain("test")
        await asyncio.wait_for(first, 15)
