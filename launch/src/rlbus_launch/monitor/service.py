"""The monitor process: consumes the events stream of a run and writes the joined rows.

It runs in the service shell (rlbus.lifecycle): the first SIGTERM/SIGINT stops it cleanly (rows not
ready yet are handed back to the bus for the next monitor, see monitors/join.py) and exits 0, a
second one exits at once. Every row carries `dead_letters/total`, the number of messages the run
has quarantined (docs/bus.md, "Dead letters").
"""

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import structlog

from rlbus.bus import Bus, Delivery
from rlbus.configs import RLConfig
from rlbus.lifecycle import run_service
from rlbus.obs.sinks import (
    EvalRowSink,
    JoinedRow,
    JsonlEvalSink,
    RowSink,
    build_sinks,
    eval_sinks,
)
from rlbus.rundirs import EVALS_FILE, run_dir_of, run_id_of
from rlbus.samples import read_records
from rlbus.wire import events
from rlbus.wire.events import EvalResult, Lifecycle, StepMetrics
from rlbus.wire.weights import WeightsApplied, WeightsFailed
from rlbus_launch.monitor.join import StepJoiner

log = structlog.get_logger()

MONITOR_DURABLE = "monitor"
DEAD_LETTERS_KEY = "dead_letters/total"
DEAD_COUNT_EVERY_S = 1.0
"""The dead-letter stream is asked for its count at most this often."""
LAST_ROW_WAIT_S = 60.0
"""`--exit-when-finished`: how long the monitor waits for the last step's row after the finish."""
FINISH_READ_TIMEOUT_S = 5.0


read_rows = read_records
"""The rows of a metrics.jsonl or evals.jsonl (rlbus.samples.read_records)."""


class Monitor:
    """Feeds events into a StepJoiner and writes released rows to every sink, then acks.

    `count_dead` returns the run's dead-letter count (None: the rows carry none)."""

    def __init__(
        self,
        sinks: Sequence[RowSink],
        joiner: StepJoiner | None = None,
        count_dead: Callable[[], Awaitable[int]] | None = None,
        eval_sinks: Sequence[EvalRowSink] = (),
    ) -> None:
        self.sinks = sinks
        self.eval_sinks = eval_sinks
        self.evals_written: set[tuple[int, str]] = set()
        """(step, env) of the evaluation rows written (evals.jsonl): each is written once."""
        self.joiner = joiner or StepJoiner()
        self.count_dead = count_dead
        self.num_rows = 0
        self.num_skipped = 0
        self.dead_letters = 0
        self._dead_checked_at = float("-inf")

    def resume(self, rows: list[dict[str, Any]], eval_rows: Sequence[dict[str, Any]] = ()) -> None:
        """Continue after the rows already written (one row per step across restarts)."""
        self.evals_written.update((int(r["step"]), str(r["env"])) for r in eval_rows if "env" in r)
        self.joiner.resume(rows)
        self.dead_letters = max(
            [self.dead_letters, *(int(r.get(DEAD_LETTERS_KEY, 0)) for r in rows)]
        )
        if rows:
            log.info("monitor_resumed", num_rows=len(rows), last_step=self.joiner.last_written)

    async def handle(self, delivery: Delivery[Any]) -> None:
        event = delivery.data
        if isinstance(event, StepMetrics) and event.service in self.joiner.expected:
            if self.joiner.is_written(event.step):  # redelivered, or a retrained step
                self.num_skipped += 1
                log.info("monitor_step_already_written", step=event.step, of=event.service)
                await delivery.ack()
                return
            await self.write(self.joiner.add_metrics(event, delivery))
        elif isinstance(event, (WeightsApplied, WeightsFailed)):
            await self.write(self.joiner.add_weights(event, delivery))
        elif isinstance(event, EvalResult):
            self.write_eval(event)
            await delivery.ack()
        else:
            if isinstance(event, Lifecycle):
                log.info(
                    "service_lifecycle", of=event.service, state=event.state, reason=event.reason
                )
            await delivery.ack()

    async def update_dead_count(self) -> None:
        if self.count_dead is None:
            return
        now = time.monotonic()
        if now - self._dead_checked_at < DEAD_COUNT_EVERY_S:
            return
        self._dead_checked_at = now
        try:
            count = await self.count_dead()
        except Exception as error:  # the stream may be briefly unavailable: keep the last count
            log.warning("dead_letter_count_failed", error=repr(error))
            return
        if count > self.dead_letters:
            log.warning("dead_letters", total=count, new=count - self.dead_letters)
        self.dead_letters = count

    async def write(self, rows: list[tuple[JoinedRow, list[Any]]]) -> None:
        """Write each row to every sink, then ack its events (a kill in between: the next monitor
        skips the step, see `resume`)."""
        if not rows:
            return
        await self.update_dead_count()
        for row, deliveries in rows:
            if self.count_dead is not None:
                row[DEAD_LETTERS_KEY] = self.dead_letters
            for sink in self.sinks:
                sink.write(row)
            self.num_rows += 1
            for delivery in deliveries:
                await delivery.ack()

    def write_eval(self, event: EvalResult) -> None:
        """An evaluation's row, once per (step, environment) across restarts."""
        key = (event.step, event.env)
        if key in self.evals_written:
            return
        row = {"step": event.step, "time": event.time, "env": event.env, **event.metrics}
        for sink in self.eval_sinks:
            sink.write_eval(row)
        self.evals_written.add(key)
        log.info("eval_row_written", step=event.step, env=event.env)

    async def close(self, run_over: bool = False) -> None:
        """Write the complete rows still held behind an incomplete one, hand the events of the
        incomplete ones back to the bus (nak: the next monitor gets them at once), then close
        the sinks. When the run is over (`run_over`: its finish is on the bus) no later monitor
        will complete a row, so every row holding a service's metrics is written as it is."""
        try:
            rows = self.joiner.rows_with_metrics() if run_over else self.joiner.complete_rows()
            await self.write(rows)
        except Exception as error:  # the bus is gone: their events are redelivered anyway
            log.warning("monitor_final_rows_failed", error=repr(error))
        for delivery in self.joiner.held_tokens():
            if delivery is not None and not delivery.settled:
                try:
                    await delivery.nak()
                except Exception as error:  # disconnected: redelivered after AckWait anyway
                    log.warning("monitor_nak_failed", error=repr(error))
        self.joiner.pending.clear()
        for sink in self.sinks:
            sink.close()
        for eval_sink in self.eval_sinks:
            if isinstance(eval_sink, JsonlEvalSink):
                eval_sink.close()


def metrics_path(config: RLConfig, run_dir: Path) -> Path | None:
    return run_dir / config.monitors.file.path if config.monitors.file is not None else None


async def run_monitor(config: RLConfig, stop: asyncio.Event) -> None:
    run_dir = run_dir_of(config)
    bus = await Bus.connect(config.bus, storage_dir=run_dir, name="monitor")
    written = read_rows(metrics_path(config, run_dir))
    run_id = run_id_of(config.bus.run_id, config.run.name, str(run_dir))
    assert run_id is not None, "the run directory names the run at least"
    sinks = build_sinks(config.monitors, run_id, run_dir, config.model_dump(mode="json"))
    monitor = Monitor(
        sinks, count_dead=bus.dead_letter_count, eval_sinks=eval_sinks(run_dir, sinks)
    )
    monitor.resume(written, read_rows(run_dir / EVALS_FILE))
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
            if config.exit_when_finished:
                finished = asyncio.create_task(until_rows_written(bus, monitor))
                stopped = asyncio.create_task(stop.wait())
                await asyncio.wait({finished, stopped}, return_when=asyncio.FIRST_COMPLETED)
                finished.cancel()
                stopped.cancel()
            else:
                await stop.wait()
    finally:
        await monitor.close(run_over=await run_is_over(bus))
        await bus.close()
        log.info("monitor_stopped", num_rows=monitor.num_rows, num_skipped=monitor.num_skipped)


async def run_is_over(bus: Bus) -> bool:
    """Whether the run's finish is on the bus (False when it cannot be read: rows are then kept
    for the next monitor, as on any stop)."""
    try:
        return await asyncio.wait_for(bus.run_finished(), FINISH_READ_TIMEOUT_S) is not None
    except Exception as error:
        log.warning("run_finished_unread", error=repr(error))
        return False


async def until_rows_written(bus: Bus, monitor: Monitor) -> None:
    """`--exit-when-finished`: return once the run is finished and the row of its last step is
    written (or LAST_ROW_WAIT_S after the finish, with a line naming the rows still missing)."""
    record = await bus.wait_finished()
    log.info("run_finished_seen", last_step=record.last_step)
    deadline = time.monotonic() + LAST_ROW_WAIT_S
    while monitor.joiner.last_written < record.last_step:
        if time.monotonic() > deadline:
            log.warning(
                "monitor_rows_missing",
                last_written=monitor.joiner.last_written,
                last_step=record.last_step,
                waited_s=LAST_ROW_WAIT_S,
            )
            return
        await asyncio.sleep(0.5)


def main(argv: list[str] | None = None) -> None:
    from rlbus.configs.base import parse_cli
    from rlbus.obs.logging import setup_logging

    config = parse_cli(RLConfig, argv, prog="python -m rlbus_launch.monitor")
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
