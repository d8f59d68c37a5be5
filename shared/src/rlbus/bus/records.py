"""Records of a run kept in its KV buckets: the inference replica registry and the end of the run.

- the replica registry: one `ReplicaInfo` lease per replica in `subjects.replicas_bucket`;
- the run's end: `RunFinished` under key `finished` of `subjects.state_bucket`, written by
  trainer rank 0 after its last step and read by every service that exits with the run.

`Bus` exposes each function as a method (`bus.read_replicas()`, `bus.mark_finished(step)`, ...).
"""

import asyncio

import structlog

from rlbus.bus.core import BusCore
from rlbus.bus.kv import KV
from rlbus.wire import replicas, run
from rlbus.wire.subjects import RUN_FINISHED_KEY

log = structlog.get_logger()


async def read_replicas(bus: BusCore) -> list[replicas.ReplicaInfo]:
    """Every inference replica registered now (the leases in `subjects.replicas_bucket`).

    An entry that does not decode is skipped and quarantined (once per key and revision, kind
    `replica-entry`), so one bad writer cannot hide the other replicas from the rollout workers
    and the trainer."""
    kv = KV(bus, bus.subjects.replicas_bucket)
    infos = []
    for key in await kv.keys():
        entry = await kv.get(key, replicas.decoder)
        if entry is None or entry.value is None:  # expired between keys() and get(), or garbage
            continue
        infos.append(entry.value)
    return infos


async def mark_finished(bus: BusCore, last_step: int) -> None:
    """Record that the run is finished (trainer rank 0, after its last step)."""
    await KV(bus, bus.subjects.state_bucket).put(
        RUN_FINISHED_KEY, run.RunFinished(last_step=last_step)
    )
    log.info("run_marked_finished", last_step=last_step)


async def clear_finished(bus: BusCore) -> None:
    """Forget a finished record (a resumed run with steps left is not finished)."""
    kv = KV(bus, bus.subjects.state_bucket)
    if await kv.get(RUN_FINISHED_KEY) is not None:
        await kv.delete(RUN_FINISHED_KEY)
        log.info("run_finished_cleared")


async def run_finished(bus: BusCore) -> run.RunFinished | None:
    """The run's `RunFinished` record, or None while the run goes on."""
    entry = await KV(bus, bus.subjects.state_bucket).get(RUN_FINISHED_KEY, run.decoder)
    return entry.value if entry is not None else None


async def wait_finished(bus: BusCore, poll_s: float) -> run.RunFinished:
    """Return once the run is finished. Polled (one direct get per `poll_s`): a bus outage only
    delays the answer (each failed read is logged once per outage)."""
    failing = False
    while True:
        try:
            record = await run_finished(bus)
            failing = False
        except Exception as error:  # an outage: keep asking
            if not failing:
                log.warning("run_finished_unreadable", error=repr(error))
            failing = True
            record = None
        if record is not None:
            return record
        await asyncio.sleep(poll_s)
