"""The bus side of a replica (lease + weight agent) in the service shell, over a real
nats-server and without an engine: a drain withdraws the lease and ends the tasks."""

import asyncio
import time
import uuid

from inference_helpers import registered

from rlbus.configs.bus import BusConfig
from rlbus.configs.inference import InferenceConfig
from rlbus.runtime import ServiceState
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
    state = ServiceState("inference")
    tasks = asyncio.create_task(run_replica_tasks(config, state))
    try:
        await wait_for(lambda: has_lease(bus))
        assert not tasks.done(), tasks.exception()
        info = (await registered(bus))["replica-a"]
        assert info.status == "ready" and info.weights_version == 0

        state.drain("test")
        await asyncio.wait_for(tasks, 10)
        assert await registered(bus) == {}
    finally:
        tasks.cancel()


async def has_lease(bus) -> bool:
    return "replica-a" in await registered(bus)
