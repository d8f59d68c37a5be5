"""The weights watcher: the newest weights version inference has applied, and how far ahead that
lets the coordinator work.

Two sources, so the coordinator reacts fast and never misses a version: `weights.applied` events
(a core subscription, at once) and the replica registry (`applied` = the newest `weights_version`
a replica reports, polled every `WEIGHTS_POLL_S`). `weights.failed` events are logged, one error
line each, so a run gated on a version a replica refused never waits in silence.

`max_step()` is the newest step whose work may be produced now: `applied + 1 + async_level`
(rlbus_orchestrator.staleness), never past `max_steps`. Time the coordinator spends gated on it
counts as `time/wait_weights_s` of the step.
"""

import asyncio
import time
from collections.abc import Callable
from typing import Any

import structlog

from rlbus.bus import Subscription, unsubscribe_quietly
from rlbus.bus.client import Bus
from rlbus.configs.orchestrator import OrchestratorConfig
from rlbus.wire import weights as weights_wire
from rlbus_orchestrator.staleness import max_allowed_step
from rlbus_orchestrator.state_store import StateStore
from rlbus_orchestrator.step_metrics import StepStats

log = structlog.get_logger()

WEIGHTS_POLL_S = 1.0


class WeightsWatcher:
    """Tracks the applied weights version; `on_new_version()` is called when it moves."""

    def __init__(
        self,
        bus: Bus,
        config: OrchestratorConfig,
        *,
        store: StateStore,
        stats: StepStats,
        on_new_version: Callable[[], None],
    ) -> None:
        self.bus = bus
        self.async_level = config.async_level
        self.max_steps = config.max_steps
        self.store = store
        self.stats = stats
        self.on_new_version = on_new_version
        self.applied_version = 0

    def max_step(self) -> int:
        """The newest step whose work may be produced while inference serves `applied_version`."""
        limit = max_allowed_step(self.applied_version, self.async_level)
        return min(limit, self.max_steps) if self.max_steps else limit

    def on_weights_applied(self, version: int) -> None:
        if version > self.applied_version:
            self.applied_version = version
            log.info("weights_applied_seen", version=version)
            self.on_new_version()

    async def newest_applied_version(self) -> int:
        infos = await self.bus.read_replicas()
        return max((i.weights_version for i in infos), default=self.applied_version)

    async def subscribe_weights_applied(self) -> Subscription:
        """Core subscription to `weights.applied` events: reacts faster than the registry poll."""

        async def on_event(event: Any, headers: dict[str, str]) -> None:
            # the bus logs and skips undecodable ones
            if isinstance(event, weights_wire.WeightsApplied):
                self.on_weights_applied(event.version)

        return await self.bus.subscribe(
            self.bus.subjects.weights_applied, weights_wire.decoder, on_event
        )

    async def subscribe_weights_failed(self) -> Subscription:
        """Core subscription to `weights.failed`: a replica that refused or failed a version says
        why (one error line each), so a run gated on that version never waits in silence."""

        async def on_event(event: Any, headers: dict[str, str]) -> None:
            if isinstance(event, weights_wire.WeightsFailed):
                log.error(
                    "weights_failed_seen",
                    version=event.version,
                    replica_id=event.replica_id,
                    reason=event.reason,
                )

        return await self.bus.subscribe(
            self.bus.subjects.weights_failed, weights_wire.decoder, on_event
        )

    async def watch(self) -> None:
        """Until cancelled: both subscriptions, and the registry poll."""
        subscriptions = [
            await self.subscribe_weights_applied(),
            await self.subscribe_weights_failed(),
        ]
        try:
            await self.poll()
        finally:
            for subscription in subscriptions:
                await unsubscribe_quietly(subscription)

    async def poll(self) -> None:
        while True:
            gated = self.store.state.next_step > self.max_step()
            started = time.monotonic()
            try:
                version = await self.newest_applied_version()
            except Exception as error:
                log.warning("weights_version_read_failed", error=repr(error))
                version = self.applied_version
            self.on_weights_applied(version)
            await asyncio.sleep(WEIGHTS_POLL_S)
            if gated:
                self.stats.wait_weights_s += time.monotonic() - started
