"""The RL trainer service: `run(config)` on every torchrun rank.

    setup (start_trainer): process group, bus, where to start (rlbus.rundirs.trainer_start),
           engine (model + FSDP2 + optimizer), its checkpoint, publisher, `started` (rank 0)
    for step in next_step ..:                                   (run_async, one screen)
        wait    (wait_for_batch) every rank polls the step log for step N; an all-reduce keeps
                ranks in lockstep, so all start (or all stop) together. Time spent here is
                `wait_s`; a `waiting_for_batch` line every WAIT_LOG_S says the trainer is alive.
        check   (check_batch) a batch that does not decode or fails rlbus_trainer.batch_check on
                any rank is quarantined (dead-letter stream, rank 0) and the step SKIPPED on every
                rank: no optimizer update, but version N is still published (version == step) and
                step metrics carry `skipped = 1.0`. A restart meets the same batch and skips it.
        train   (train) this rank's micro-batches (`batch.micro_batches[rank]`), one optimizer step
        ckpt    (checkpoint_if_due) every `ckpt.interval` steps (and the last), then prune to
                keep_last
        publish (publish_weights) weights version N (filesystem or nccl), then (report_step) step
                metrics (rank 0)
    end (stop_trainer): `finished` on the bus after max_steps, `stopped`, close everything

Only the step the trainer expects next is ever read (by subject `batches.<N>`), so a batch
redelivered or republished for a step already trained is never trained twice.

Restarts (docs/trainer.md, "Restarts"): a trainer started again with its original command loads
the newest complete checkpoint K even with `resume` unset, and re-reads K+1, K+2, ... from the
log. The bus may already announce weights version S > K: steps K+1..S are retrained but not
published again (the version never goes backwards, and weights.py refuses it anyway); their
metrics carry `retrained = 1.0`. When S < K (killed between checkpoint K and its publish), version
K is published right after loading. Without a checkpoint but with S > 0 the trainer exits 2 with
one line (rlbus.rundirs.trainer_start) instead of retraining from step 1.

Ending (signals and control requests reach rank 0's `ServiceState`, rlbus.lifecycle; all ranks
agree through an all-reduce, so they end on the same step):
- Drain (SIGTERM/SIGINT, control `Drain`): finish the step in hand (train, checkpoint, publish),
  then exit 0 at the next poll;
- Stop (control `Stop`): the step in hand is not checkpointed nor published (no half-written
  checkpoint, no weights announced for it); a resume retrains it from the last checkpoint.
Pause/Resume are refused: the trainer only follows the batches the orchestrator publishes.
"""

from __future__ import annotations

import asyncio
import itertools
import resource
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch
import torch.distributed as dist

from rlbus.bus import Bus
from rlbus.bus.errors import PoisonBatch, StepNotFound
from rlbus.configs.trainer import TrainerConfig
from rlbus.lifecycle import ServiceState, control_handler, run_service
from rlbus.obs import tracing
from rlbus.rundirs import (
    RunDirError,
    TrainerStart,
    never_reread_through,
    require_run_dir,
    run_id_of,
    trainer_start,
)
from rlbus.wire import events
from rlbus.wire.batches import MicroBatch, TrainBatch
from rlbus_trainer import ckpt
from rlbus_trainer.batch_check import batch_problem
from rlbus_trainer.engine import (
    Engine,
    StepResult,
    World,
    build_engine,
    setup_distributed,
    teardown_distributed,
    vocab_size_of,
)
from rlbus_trainer.export import export_final
from rlbus_trainer.loss import LossFn, build_loss_fn
from rlbus_trainer.metrics import record_train_step
from rlbus_trainer.weights import WeightPublisher, build_weight_publisher, latest_version

log = structlog.get_logger()

SERVICE = "trainer"
POLL_S = 0.25
WAIT_LOG_S = 30.0
"""While a batch does not come, `waiting_for_batch` is logged this often."""
EXIT_CANNOT_RESUME = 2
"""The run has trained (bus) but no checkpoint is left to continue it from."""


@dataclass
class TrainerRun:
    """What the step loop works with: built once by `start_trainer`, ended by `stop_trainer`."""

    config: TrainerConfig
    world: World
    run_dir: Path
    bus: Bus
    engine: Engine
    loss_fn: LossFn
    publisher: WeightPublisher
    stop: ServiceState
    start_step: int
    """The checkpoint step this trainer continues from (0: none); the loop starts after it."""
    published_through: int
    """The newest weights version the bus has: steps up to it are retrained, never published."""
    vocab_size: int


@dataclass
class Arrival:
    """Step N's batch as every rank has it: decoded, or poison (`problem` says why)."""

    batch: TrainBatch | None
    headers: dict[str, str] = field(default_factory=dict)
    wait_s: float = 0.0
    problem: str | None = None
    poison: PoisonBatch | None = None
    """The `PoisonBatch` this rank met (its stored bytes are what gets dead-lettered)."""


# ---- the service body ---------------------------------------------------------------------


async def run_async(config: TrainerConfig, stop: ServiceState | None = None) -> int:
    """The service body (see module docstring); returns the last trained step."""
    trainer = await start_trainer(config, stop or ServiceState(SERVICE))
    last_step = trainer.start_step
    for step in steps_from(last_step + 1, config.max_steps):
        structlog.contextvars.bind_contextvars(step=step)
        arrival = await wait_for_batch(trainer.bus, step, trainer.stop)
        if arrival is None:
            break  # a drain or stop, agreed by every rank
        skipped = await check_batch(trainer, step, arrival)
        # One span for the whole step: training, checkpoint and weights publish are its children,
        # and it is a child of the batch's publish (the step's trace, docs/observability.md).
        with tracing.consumer_span(
            tracing.TRAIN_STEP,
            headers=arrival.headers,
            attributes={tracing.STEP_ATTR: step, "rlbus.skipped": skipped},
        ):
            t0 = time.perf_counter()
            result = None if skipped else await train(trainer, arrival)
            if agreed(trainer.stop.stop_now):
                log.info("train_step_discarded_on_stop", step=step)
                break
            extra = await checkpoint_if_due(trainer, step, arrival, result, t0)
            extra.update(await publish_weights(trainer, step))
            if trainer.world.is_main:
                await report_step(trainer, step, arrival, result, time.perf_counter() - t0, extra)
        last_step = step
    await stop_trainer(trainer, last_step)
    return last_step


def run(config: TrainerConfig) -> int:
    """Entry point called by `trainer` (entrypoint.py) on every rank."""
    return run_service(SERVICE, lambda state: run_async(config, state))


def steps_from(first: int, max_steps: int | None) -> Iterable[int]:
    """first, first + 1, ... through `max_steps` (without end when None)."""
    return itertools.count(first) if max_steps is None else range(first, max_steps + 1)


# ---- setup and end --------------------------------------------------------------------------


async def start_trainer(config: TrainerConfig, stop: ServiceState) -> TrainerRun:
    """Everything above the step loop (module docstring, "setup"). Collective."""
    world = setup_distributed(config.collective_timeout_s)
    run_dir = require_run_dir(config, SERVICE)
    run_dir.mkdir(parents=True, exist_ok=True)
    run_id = run_id_of(config.bus.run_id, config.run.name)
    structlog.contextvars.bind_contextvars(service=SERVICE, rank=world.rank)
    bus, start, bus_version = await connect_and_start(config, world, run_dir, run_id)
    engine = build_engine(config, world)
    loss_fn = build_loss_fn(config.loss)
    replay = resume_engine(engine, run_dir, start, bus_version)
    publisher = build_weight_publisher(config, bus=bus, run_dir=run_dir, world=world)
    published_through = bus_version
    if start.from_step > bus_version:  # killed between checkpoint K and its publish
        await publisher.publish(start.from_step, engine)
        published_through = start.from_step
    trainer = TrainerRun(
        config=config,
        world=world,
        run_dir=run_dir,
        bus=bus,
        engine=engine,
        loss_fn=loss_fn,
        publisher=publisher,
        stop=stop,
        start_step=start.from_step,
        published_through=published_through,
        vocab_size=vocab_size_of(engine.model),
    )
    if world.is_main:
        await announce_start(trainer, replay)
    log.info(
        "trainer_started",
        run_dir=str(run_dir),
        next_step=start.from_step + 1,
        max_steps=config.max_steps,
    )
    return trainer


async def connect_and_start(
    config: TrainerConfig, world: World, run_dir: Path, run_id: str | None
) -> tuple[Bus, TrainerStart, int]:
    """(bus, TrainerStart, bus version): where this trainer continues, decided before the engine
    is built; a run that cannot be continued ends here with exit 2 and one line."""
    bus = await Bus.connect(
        config.bus, run_id=run_id, storage_dir=run_dir, name=f"{SERVICE}-{world.rank}"
    )
    bus_version = agreed_max(await latest_version(bus) if world.is_main else 0)
    try:
        start = trainer_start(
            run_dir, config.resume.step if config.resume is not None else None, bus_version
        )
    except RunDirError as error:
        if world.is_main:
            log.error("trainer_cannot_resume", reason=str(error))
        await bus.close()
        teardown_distributed()
        raise SystemExit(EXIT_CANNOT_RESUME) from None
    return bus, start, bus_version


def resume_engine(
    engine: Engine, run_dir: Path, start: TrainerStart, bus_version: int
) -> dict[str, float] | None:
    """Load the checkpoint this trainer continues from, if any (collective); returns the metrics
    of its step saved with it (replayed by `announce_start`), None when there are none."""
    if not start.from_step:
        return None
    progress = ckpt.load_checkpoint(engine, run_dir, start.from_step)
    log.info(
        "trainer_resumed",
        from_step=start.from_step,
        why=start.why,
        bus_version=bus_version,
        retrain_without_publish=max(bus_version - start.from_step, 0),
    )
    return progress.get("metrics") if isinstance(progress, dict) else None


async def announce_start(trainer: TrainerRun, replay: dict[str, float] | None) -> None:
    """Rank 0: the run goes on (unless it is already through max_steps), control requests are
    served, `started` is published, and a checkpoint's metrics the monitor never got are sent."""
    bus, config, start_step = trainer.bus, trainer.config, trainer.start_step
    if config.max_steps is None or start_step < config.max_steps:
        await bus.clear_finished()  # resumed with steps left: the run goes on
    await bus.serve_control(SERVICE, control_handler(trainer.stop, pausable=False))
    await publish_event(bus, events.Lifecycle(service=SERVICE, state="started"))
    if replay and await last_metrics_step(bus) < start_step:
        # killed between checkpoint K and K's metrics: send the saved ones (once; the monitor
        # also writes a step it has already written only once)
        await publish_event(
            bus,
            events.StepMetrics(
                service=SERVICE, step=start_step, metrics={**replay, "replayed": 1.0}
            ),
        )
        log.info("step_metrics_replayed", step=start_step)


async def stop_trainer(trainer: TrainerRun, last_step: int) -> None:
    """Below the step loop: a run that reached max_steps (and was not told to end) writes its
    model (`<run_dir>/model/`, export.py; every rank takes part) and rank 0 marks it finished;
    rank 0 publishes `stopped`; every rank closes its publisher, bus and group."""
    config, stop = trainer.config, trainer.stop
    finished = not agreed(  # on every rank
        stop.reason is not None or config.max_steps is None or last_step < config.max_steps
    )
    if finished and config.save_final_model:  # before `finished`: a finished run has its model
        await asyncio.to_thread(
            export_final, trainer.engine, config, trainer.run_dir, trainer.world
        )
    if trainer.world.is_main:
        if finished:
            await trainer.bus.mark_finished(last_step)
        await publish_event(
            trainer.bus,
            events.Lifecycle(service=SERVICE, state="stopped", reason=stop.reason or "max_steps"),
        )
    await trainer.publisher.close()
    await trainer.bus.close()
    log.info("trainer_stopped", last_step=last_step)
    teardown_distributed()


# ---- one step -------------------------------------------------------------------------------


async def wait_for_batch(bus: Bus, step: int, stop: ServiceState) -> Arrival | None:
    """Step `step`'s batch once every rank has it, or knows it is poison (None: stop agreed).
    Collective."""
    t0 = time.perf_counter()
    next_log = t0 + WAIT_LOG_S
    arrival = Arrival(None)
    while True:
        have = arrival.batch is not None or arrival.problem is not None
        if not have:
            await poll_batch(bus, step, arrival)
            have = arrival.batch is not None or arrival.problem is not None
        flags = torch.tensor([float(have), float(stop.ending)])
        dist.all_reduce(flags)
        if flags[1] > 0:
            return None
        if int(flags[0]) == dist.get_world_size():
            arrival.wait_s = time.perf_counter() - t0
            return arrival
        if time.perf_counter() >= next_log:
            log.info("waiting_for_batch", step=step, waited_s=round(time.perf_counter() - t0))
            next_log += WAIT_LOG_S
        if have:
            await asyncio.sleep(0.05)  # waiting for the other ranks to see it


async def poll_batch(bus: Bus, step: int, arrival: Arrival) -> None:
    """One look (up to POLL_S) at the step log: fills `arrival` with the batch or its poison."""
    try:
        arrival.batch, arrival.headers = await bus.step_log.get_with_headers(step, timeout_s=POLL_S)
    except StepNotFound:
        pass
    except PoisonBatch as poison:
        arrival.problem, arrival.poison = poison.reason, poison


async def check_batch(trainer: TrainerRun, step: int, arrival: Arrival) -> bool:
    """Whether step `step` is skipped: its batch is poison or unsound on any rank (collective);
    rank 0 then quarantines it."""
    if arrival.problem is None:
        assert arrival.batch is not None  # wait_for_batch returns a batch or a problem
        arrival.problem = batch_problem(arrival.batch, step, trainer.vocab_size)
    skipped = agreed(arrival.problem is not None)
    if skipped and trainer.world.is_main:
        await quarantine(trainer.bus, step, arrival)
    return skipped


async def quarantine(bus: Bus, step: int, arrival: Arrival) -> None:
    """Copy step `step`'s stored batch to the dead-letter stream with the reason (rank 0). A bus
    error here is logged, not raised: the step is skipped either way."""
    subjects = bus.subjects
    reason = arrival.problem or "rejected by another rank"
    try:
        if arrival.poison is not None:
            data, headers = arrival.poison.data, arrival.poison.headers
        else:
            data, headers = await bus.step_log.stored(step) or (b"", {})
        await bus.dead_letter(subjects.batches_stream, subjects.batch(step), data, headers, reason)
    except Exception as error:
        log.warning("batch_dead_letter_failed", step=step, error=f"{type(error).__name__}: {error}")
    log.error("batch_quarantined", step=step, reason=reason, subject=subjects.batch(step))


async def train(trainer: TrainerRun, arrival: Arrival) -> StepResult:
    """One optimizer step on this rank's micro-batches (collective). In a thread, so the event
    loop keeps serving the bus and control requests meanwhile."""
    assert arrival.batch is not None  # a skipped step is never trained
    world = trainer.world
    micro_batches = rank_micro_batches(arrival.batch, world.rank, world.world_size)
    return await asyncio.to_thread(trainer.engine.train_step, micro_batches, trainer.loss_fn)


async def checkpoint_if_due(
    trainer: TrainerRun, step: int, arrival: Arrival, result: StepResult | None, t0: float
) -> dict[str, float]:
    """Step `step`'s checkpoint every `ckpt.interval` steps and at max_steps (collective), then
    prune to keep_last (rank 0); returns `ckpt_s`, or nothing when no checkpoint is due."""
    config = trainer.config
    if config.ckpt is None or not (step % config.ckpt.interval == 0 or step == config.max_steps):
        return {}
    c0 = time.perf_counter()
    progress: dict[str, object] = {"step": step}
    if trainer.world.is_main:  # the step's metrics travel with the checkpoint (replayed on resume)
        progress["metrics"] = (
            {"skipped": 1.0, "wait_s": arrival.wait_s}
            if result is None
            else step_metrics(result, arrival, c0 - t0, {})
        )
    with tracing.span(tracing.CHECKPOINT):
        await asyncio.to_thread(
            ckpt.save_checkpoint, trainer.engine, trainer.run_dir, step, progress
        )
    if trainer.world.is_main:
        ckpt.prune_checkpoints(trainer.run_dir, config.ckpt.keep_last, current_step=step)
    return {"ckpt_s": time.perf_counter() - c0}


async def publish_weights(trainer: TrainerRun, step: int) -> dict[str, float]:
    """Weights version `step` (collective), unless the bus already has it: then `retrained`."""
    if step <= trainer.published_through:  # the bus has this version: never publish it again
        return {"retrained": 1.0}
    with tracing.span(tracing.WEIGHTS_PUBLISH, attributes={tracing.VERSION: step}):
        return await trainer.publisher.publish(step, trainer.engine)


async def report_step(
    trainer: TrainerRun,
    step: int,
    arrival: Arrival,
    result: StepResult | None,
    step_s: float,
    extra: dict[str, float],
) -> None:
    """Rank 0: the step's metrics on the bus and in Prometheus, a `train_step` line, and the
    claim-check files of batches no restart reads again deleted."""
    if result is None:
        metrics = {"skipped": 1.0, "wait_s": arrival.wait_s, "step_s": step_s, **extra}
    else:
        metrics = step_metrics(result, arrival, step_s, extra)
    bus = trainer.bus
    await publish_event(bus, events.StepMetrics(service=SERVICE, step=step, metrics=metrics))
    record_train_step(step, metrics)  # Prometheus (rlbus_trainer.metrics)
    if result is not None:
        log.info(
            "train_step",
            loss=round(result.loss, 4),
            grad_norm=round(result.grad_norm, 3),
            tokens_per_s=round(metrics["tokens_per_s"]),
            wait_s=round(arrival.wait_s, 3),
            retrained=bool(extra.get("retrained")),
        )
    checkpointing = trainer.config.ckpt is not None
    bus.step_log.discard_claims(
        never_reread_through(trainer.run_dir, step, checkpointing=checkpointing)
    )


# ---- small parts ----------------------------------------------------------------------------


def rank_micro_batches(batch: TrainBatch, rank: int, world_size: int) -> list[MicroBatch]:
    """This rank's micro-batches; a batch packed for another world size is re-split round-robin."""
    if len(batch.micro_batches) == world_size:
        return list(batch.micro_batches[rank])
    flat = [mb for per_rank in batch.micro_batches for mb in per_rank]
    return flat[rank::world_size]


def agreed(flag: bool) -> bool:
    """Whether any rank has `flag` (collective: every rank must call it at the same point)."""
    value = torch.tensor([float(flag)])
    dist.all_reduce(value)
    return bool(value[0] > 0)


def agreed_max(value: int) -> int:
    """The largest `value` over the ranks (collective), so every rank decides alike."""
    tensor = torch.tensor([float(value)])
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor[0])


def step_metrics(
    result: StepResult, arrival: Arrival, step_s: float, extra: dict[str, float]
) -> dict[str, float]:
    """The metrics of a trained step (a `StepMetrics` event, and saved with its checkpoint)."""
    assert arrival.batch is not None  # a trained step has its batch
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else _peak_rss_bytes()
    return {
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "lr": result.lr,
        "num_tokens": float(result.num_tokens),
        "num_loss_tokens": float(result.num_loss_tokens),
        "tokens_per_s": result.num_tokens
        / max(result.forward_backward_s + result.optimizer_s, 1e-9),
        "peak_memory_gb": peak / 1e9,
        "wait_s": arrival.wait_s,
        "forward_backward_s": result.forward_backward_s,
        "optimizer_s": result.optimizer_s,
        "step_s": step_s,
        "min_policy_version": float(arrival.batch.min_policy_version),
        "max_policy_version": float(arrival.batch.max_policy_version),
        **result.metrics,
        **extra,
    }


def _peak_rss_bytes() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # Linux reports KiB


async def publish_event(bus: Bus, message: events.Lifecycle | events.StepMetrics) -> None:
    """A trainer event on its subject: step metrics, or a lifecycle change."""
    await bus.publish(
        bus.subjects.metrics(SERVICE)
        if isinstance(message, events.StepMetrics)
        else bus.subjects.lifecycle(SERVICE),
        events.encoder.encode(message),
    )


async def last_metrics_step(bus: Bus) -> int:
    """The step of the newest trainer metrics stored on the events stream (0 when none, or when
    it cannot be read: then the saved metrics are sent, and the monitor keeps one row)."""
    subjects = bus.subjects
    try:
        raw = await bus.last_stored(subjects.events_stream, subjects.metrics(SERVICE))
        event = None if raw is None else events.decoder.decode(raw.data or b"")
    except Exception as error:
        log.warning("trainer_metrics_unread", error=repr(error))
        return 0
    return event.step if isinstance(event, events.StepMetrics) else 0
