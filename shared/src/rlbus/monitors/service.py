"""The monitor process: consumes the events stream of a run and writes the joined rows.

It runs in the service shell (rlbus.runtime): the first SIGTERM/SIGINT flushes the rows still held
by the joiner and exits 0, a second one exits at once.
"""

import asyncio

import structlog

from rlbus.bus import Bus
from rlbus.configs import RLConfig
from rlbus.monitors.join import StepJoiner
from rlbus.monitors.sinks import build_sinks
from rlbus.runs import run_dir_of, run_id_of
from rlbus.runtime import run_service
from rlbus.wire import events
from rlbus.wire.events import Lifecycle, StepMetrics
from rlbus.wire.weights import WeightsApplied, WeightsFailed

log = structlog.get_logger()

MONITOR_DURABLE = "monitor"


class Monitor:
    """Feeds events into a StepJoiner and writes released rows to every sink, then acks."""

    def __init__(self, sinks: list, joiner: StepJoiner | None = None):
        self.sinks = sinks
        self.joiner = joiner or StepJoiner()
        self.num_rows = 0

    async def handle(self, delivery) -> None:
        event = delivery.data
        if isinstance(event, StepMetrics) and event.service in self.joiner.expected:
            await self.write(self.joiner.add_metrics(event, delivery))
        elif isinstance(event, (WeightsApplied, WeightsFailed)):
            await self.write(self.joiner.add_weights(event, delivery))
        else:
            if isinstance(event, Lifecycle):
                log.info(
                    "service_lifecycle", of=event.service, state=event.state, reason=event.reason
                )
            await delivery.ack()

    async def write(self, rows) -> None:
        for row, deliveries in rows:
            for sink in self.sinks:
                sink.write(row)
            self.num_rows += 1
            for delivery in deliveries:
                await delivery.ack()

    async def close(self) -> None:
        await self.write(self.joiner.flush())
        for sink in self.sinks:
            sink.close()


async def run_monitor(config: RLConfig, stop: asyncio.Event) -> None:
    run_dir = run_dir_of(config)
    bus = await Bus.connect(config.bus, storage_dir=run_dir, name="monitor")
    monitor = Monitor(
        build_sinks(config.monitors, config.run.name or run_dir.name, run_dir, config.model_dump())
    )
    subjects = bus.subjects
    consumer = bus.consumer(
        subjects.events_stream,
        MONITOR_DURABLE,
        events.decoder,
        monitor.handle,
        auto_ack=False,
        batch=64,
        filter_subject=subjects.events_all,
    )
    try:
        async with consumer:
            await stop.wait()
    finally:
        await monitor.close()
        await bus.close()
        log.info("monitor_stopped", num_rows=monitor.num_rows)


def main(argv: list[str] | None = None) -> None:
    from rlbus.configs.base import parse_cli
    from rlbus.obs.logging import setup_logging

    config = parse_cli(RLConfig, argv, prog="python -m rlbus.monitors")
    run_dir = run_dir_of(config)
    # Logging only: the monitor makes no spans of its own.
    setup_logging(
        "monitor",
        run_dir=run_dir,
        run_id=run_id_of(config.bus.run_id, config.run.name),
        level=config.log.level,
        json_console=config.log.json_console,
    )
    run_service("monitor", lambda state: run_monitor(config, state.stop_requested))
