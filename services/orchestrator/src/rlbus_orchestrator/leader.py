"""One coordinator per run: a leader lease in the run's state bucket.

A process with role `all` or `coordinator` takes the TTL lease `COORDINATOR_LEADER_KEY` before its
coordinator starts. If another live process holds it, this one is a standby: it logs
`coordinator_standby` once, keeps asking every `STANDBY_POLL_S`, and becomes the leader when the
key is gone: at once when the leader ended cleanly (it deletes the key), after `leader_ttl_s` when
it died. A lease left by a dead process on this same host (a restarted container, or `rl`
restarting its orchestrator) is taken over at once: the holder's pid is not alive here, or is
this process's own pid (a container's pid namespace starts over).

A leader whose lease expired in a NATS outage longer than `bus.lease_grace_s` takes it back
when no one else holds it; if another process holds it now, this one must not go on
coordinating: `LeaderLost` ends the service with exit 1, and its restart comes back as a standby.
"""

import asyncio
import os
import socket

import structlog

from rlbus.bus.client import Bus
from rlbus.bus.errors import LeaseHeld
from rlbus.bus.kv import Lease
from rlbus.lifecycle import ServiceState
from rlbus.wire import run
from rlbus.wire.subjects import COORDINATOR_LEADER_KEY

log = structlog.get_logger()

STANDBY_POLL_S = 1.0


class LeaderLost(RuntimeError):
    """This coordinator's leader lease is held by another process now."""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def left_by_dead_process(holder: run.CoordinatorLeader | None) -> bool:
    """Whether `holder` is a process of this host that no longer runs (never true elsewhere)."""
    if holder is None or holder.host != socket.gethostname():
        return False
    return holder.pid == os.getpid() or not pid_alive(holder.pid)


async def become_leader(bus: Bus, ttl_s: int, state: ServiceState) -> Lease | None:
    """The held leader lease, once this process is the run's coordinator; None when the service
    is asked to stop while it waits as a standby."""
    bucket = bus.subjects.state_bucket
    kv = bus.kv(bucket)
    me = run.CoordinatorLeader(host=socket.gethostname(), pid=os.getpid())
    lease = bus.lease(bucket, COORDINATOR_LEADER_KEY, run.encoder.encode(me), ttl_s=ttl_s)
    standby_since_logged = False
    while not state.ending:
        try:
            await lease.acquire()
        except LeaseHeld:
            entry = await kv.get(COORDINATOR_LEADER_KEY, run.leader_decoder)
            holder = entry.value if entry is not None else None
            if entry is not None and holder is not None and left_by_dead_process(holder):
                log.warning("coordinator_lease_taken_over", dead_pid=holder.pid, host=holder.host)
                try:  # only that revision: a standby elsewhere may have taken it meanwhile
                    await kv.delete(COORDINATOR_LEADER_KEY, revision=entry.revision)
                except Exception as error:
                    log.info("coordinator_lease_takeover_lost", error=repr(error))
                continue
            if not standby_since_logged:
                log.info(
                    "coordinator_standby",
                    leader_host=holder.host if holder else None,
                    leader_pid=holder.pid if holder else None,
                    takeover_within_s=ttl_s,
                )
                standby_since_logged = True
        except Exception as error:  # the bus is away: keep waiting, the lease TTL decides
            log.warning("coordinator_lease_unavailable", error=repr(error))
        else:
            log.info("coordinator_leader", host=me.host, pid=me.pid, ttl_s=ttl_s)
            return lease
        try:
            await asyncio.wait_for(state.stop_requested.wait(), STANDBY_POLL_S)
        except TimeoutError:
            pass
    return None


async def watch_lease(lease: Lease) -> None:
    """Raise `LeaderLost` once another process holds the lease (runs beside the coordinator). A
    lease lost only to an outage longer than the grace (the key expired, no one took it) is taken
    back: a rival that coordinated meanwhile could not have been reached either."""
    while True:
        await lease.lost.wait()
        try:
            if await lease.reclaim():
                log.warning("coordinator_lease_reclaimed")
                continue
        except Exception as error:  # the bus is still away: ask again
            log.warning("coordinator_lease_unavailable", error=repr(error))
            await asyncio.sleep(STANDBY_POLL_S)
            continue
        raise LeaderLost(
            "the coordinator's leader lease is held by another coordinator now (it took over "
            "during a bus outage); exiting so that this process comes back as a standby"
        )
