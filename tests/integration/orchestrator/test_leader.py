"""One coordinator per run (rlbus_orchestrator.leader), on a real nats-server: a standby waits
while another process holds the leader lease, takes over at once when the leader ends cleanly,
after the TTL when it died elsewhere, at once when it died on this host; a stop request ends the
wait; a leader whose lease expired in an outage takes it back, one whose lease another holds raises
`LeaderLost`."""

import asyncio
import os
import socket
import subprocess
import sys
import uuid

import pytest

from rlbus.lifecycle import ServiceState
from rlbus.wire import run
from rlbus.wire.subjects import COORDINATOR_LEADER_KEY
from rlbus_orchestrator.leader import LeaderLost, become_leader, watch_lease


@pytest.fixture
async def bus(make_bus):
    return await make_bus(run_id=f"lead_{uuid.uuid4().hex[:8]}")


def hold(bus, host: str, pid: int, ttl_s: int = 2):
    value = run.encoder.encode(run.CoordinatorLeader(host=host, pid=pid))
    return bus.lease(bus.subjects.state_bucket, COORDINATOR_LEADER_KEY, value, ttl_s=ttl_s)


async def still_waiting(task: asyncio.Task, for_s: float) -> bool:
    done, _ = await asyncio.wait({task}, timeout=for_s)
    return not done


async def test_standby_takes_over_at_once_when_the_leader_ends_cleanly(bus):
    other = await hold(bus, "elsewhere", 1, ttl_s=30).acquire()
    standby = asyncio.create_task(become_leader(bus, 30, ServiceState("orchestrator")))
    assert await still_waiting(standby, 2.0), "became leader while another one holds the lease"
    await other.release()
    lease = await asyncio.wait_for(standby, 5.0)  # far below the 30 s TTL
    assert lease is not None and lease.held
    entry = await bus.kv(bus.subjects.state_bucket).get(COORDINATOR_LEADER_KEY, run.leader_decoder)
    assert entry.value.pid == os.getpid() and entry.value.host == socket.gethostname()
    await lease.release()


async def test_standby_takes_over_after_the_ttl_when_the_leader_died_elsewhere(bus):
    other = await hold(bus, "elsewhere", 1, ttl_s=2).acquire()
    other._task.cancel()  # the holder dies: no more heartbeats, the key expires after 2 s
    standby = asyncio.create_task(become_leader(bus, 2, ServiceState("orchestrator")))
    assert await still_waiting(standby, 1.0)
    lease = await asyncio.wait_for(standby, 10.0)
    assert lease is not None and lease.held
    await lease.release()


async def test_a_lease_left_by_a_dead_process_of_this_host_is_taken_over_at_once(bus):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], text=True,
                          capture_output=True, check=True)  # fmt: skip
    await hold(bus, socket.gethostname(), int(dead.stdout), ttl_s=60).acquire()
    lease = await asyncio.wait_for(become_leader(bus, 60, ServiceState("orchestrator")), 5.0)
    assert lease is not None and lease.held
    await lease.release()


async def test_a_stop_request_ends_the_standby_wait(bus):
    await hold(bus, "elsewhere", 1, ttl_s=30).acquire()
    state = ServiceState("orchestrator")
    standby = asyncio.create_task(become_leader(bus, 30, state))
    assert await still_waiting(standby, 1.0)
    state.drain("test")
    assert await asyncio.wait_for(standby, 5.0) is None


async def test_a_lease_lost_to_an_outage_is_taken_back_when_no_one_else_holds_it(bus):
    lease = await asyncio.wait_for(become_leader(bus, 30, ServiceState("orchestrator")), 5.0)
    watcher = asyncio.create_task(watch_lease(lease))
    kv = bus.kv(bus.subjects.state_bucket)
    await kv.delete(COORDINATOR_LEADER_KEY)  # expired during an outage longer than the grace
    await lease._mark_lost("expired in a test")
    for _ in range(50):
        if lease.held:
            break
        await asyncio.sleep(0.1)
    assert lease.held and not watcher.done()
    entry = await kv.get(COORDINATOR_LEADER_KEY, run.leader_decoder)
    assert entry is not None and entry.value.pid == os.getpid()
    watcher.cancel()
    await lease.release()


async def test_a_leader_whose_lease_another_coordinator_holds_raises(bus):
    lease = await asyncio.wait_for(become_leader(bus, 30, ServiceState("orchestrator")), 5.0)
    watcher = asyncio.create_task(watch_lease(lease))
    await bus.kv(bus.subjects.state_bucket).delete(COORDINATOR_LEADER_KEY)
    await hold(bus, "elsewhere", 1, ttl_s=30).acquire()  # a standby took over meanwhile
    await lease._mark_lost("taken over in a test")
    with pytest.raises(LeaderLost, match="held by another coordinator"):
        await asyncio.wait_for(watcher, 5.0)
