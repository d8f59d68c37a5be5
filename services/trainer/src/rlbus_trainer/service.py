"""The RL trainer service: `run(config)` on every torchrun rank.

    setup: process group, bus, where to start (rlbus.rundirs.trainer_start), engine (model + FSDP2 +
           optimizer), its checkpoint, publisher
    for step in next_step ..:
        wait    every rank polls the step log for step N; an all-reduce keeps ranks in lockstep,
                so all start (or all stop) together. Time spent here is `wait_s`; a
                `waiting_for_batch` line every WAIT_LOG_S says the trainer is alive and waiting.
        check   a batch that does not decode or fails rlbus_trainer.batch_check on any rank is
                quarantined (dead-letter stream, rank 0) and the step SKIPPED on every rank: no
                optimizer update, but version N is still published (version == step) and step
                metrics carry `skipped = 1.0`. A restart meets the same batch and skips it again.
        train   this rank's micro-batches (`batch.micro_batches[rank]`), one optimizer step
        ckpt    every `ckpt.interval` steps (and the last), then prune to keep_last
        publish weights version N (filesystem or nccl), then step metrics (rank 0)

Only the step the trainer expects next is ever read (by subject `batches.<N>`), so a batch
redelivered or republished for a step already trained is never trained twice.

Restarts (docs/trainer.md, "Restarts"): a trainer started again with its original command loads
the newest complete checkpoint K even with `resume` unset, and re-reads K+1, K+2, ... from the
log. The bus may already announce weights version S > K: steps K+1..S are retrained but not
published again (the version never goes backwards, and weights.py refuses it anyway); their
metrics carry `retrained = 1.0`. When S < K (killed between checkpoint K and its publish), version
K is published right after loading. Without a checkpoint but with S > 0 the trainer exits 2 with
one line (rlbus.rundirs.trainer_start) instead of retraining from step 1.

Ending (signals and control requests reach rank 0's `ServiceState`, rlbus.lifecycle; all ranks agree
through an all-reduce, so they end on the same step):
- Drain (SIGTERM/SIGINT, control `Drain`): finish the step in hand (train, checkpoint, publish),
  then exit 0 at the next poll;
- Stop (control `Stop`): the step in hand is not checkpointed nor published (no half-written
  checkpoint, no weights announced for it); a resume retrains it from the last checkpoint.
Pause/Resume are refused: the trainer only follows the batches the orchestrator publishes.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import structlog
import torch
import torch.distributed as dist

from rlbus.lifecycle import ServiceState, control_handler, run_service
from rlbus.rundirs import never_reread_through
from rlbus.wire import events
from rlbus.wire.batches import MicroBatch, TrainBatch

log = structlog.get_logger()

SERVICE = "trainer"
POLL_S = 0.25
WAIT_LOG_S = 30.0
"""While a batch does not come, `waiting_for_batch` is logged this often."""
EXIT_CANNOT_RESUME = 2
"""The run has trained (bus) but no checkpoint is left to continue it from."""


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


@dataclass
class Arrival:
    """Step N's batch as every rank has it: decoded, or poison (`problem` says why)."""

    batch: TrainBatch | None
    headers: dict
    wait_s: float
    problem: str | None = None
    poison: object | None = None
    """The `PoisonBatch` this rank met (its stored bytes are what gets dead-lettered)."""


async def wait_for_batch(bus, step: int, stop: ServiceState) -> Arrival | None:
    """Step `step`'s batch once every rank has it, or knows it is poison (None: stop agreed).
    Collective."""
    from rlbus.bus.errors import PoisonBatch, StepNotFound

    t0 = time.perf_counter()
    next_log = t0 + WAIT_LOG_S
    arrival = Arrival(None, {}, 0.0)
    while True:
        have = arrival.batch is not None or arrival.problem is not None
        if not have:
            try:
                arrival.batch, arrival.headers = await bus.step_log.get_with_headers(
                    step, timeout_s=POLL_S
                )
            except StepNotFound:
                pass
            except PoisonBatch as poison:
                arrival.problem, arrival.poison = poison.reason, poison
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


async def quarantine(bus, step: int, arrival: Arrival) -> None:
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


def step_metrics(
    result, batch: TrainBatch, wait_s: float, step_s: float, extra: dict
) -> dict[str, float]:
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
        "wait_s": wait_s,
        "forward_backward_s": result.forward_backward_s,
        "optimizer_s": result.optimizer_s,
        "step_s": step_s,
        "min_policy_version": float(batch.min_policy_version),
        "max_policy_version": float(batch.max_policy_version),
        **result.metrics,
        **extra,
    }


def _peak_rss_bytes() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # Linux reports KiB


async def publish_event(bus, message) -> None:
    await bus.publish(
        bus.subjects.metrics(SERVICE)
        if isinstance(message, events.StepMetrics)
        else bus.subjects.lifecycle(SERVICE),
        events.encoder.encode(message),
    )


async def last_metrics_step(bus) -> int:
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


def vocab_size_of(model) -> int:
    """Rows of the input embedding (what a token id must stay below), the config's as fallback."""
    embedding = model.get_input_embeddings()
    return int(getattr(embedding, "num_embeddings", None) or model.config.vocab_size)


def agreed_max(value: int) -> int:
    """The largest `value` over the ranks (collective), so every rank decides alike."""
    tensor = torch.tensor([float(value)])
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor[0])


async def connect_and_start(config, world, run_dir, run_id):
    """(bus, TrainerStart, bus version): where this trainer continues, decided before the engine
    is built; a run that cannot be continued ends here with exit 2 and one line."""
    from rlbus.bus import Bus
    from rlbus.rundirs import RunDirError, trainer_start
    from rlbus_trainer.engine import teardown_distributed
    from rlbus_trainer.weights import latest_version

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


async def run_async(config, stop: ServiceState | None = None) -> int:
    """The service body (see module docstring); returns the last trained step."""
    from rlbus.obs import tracing
    from rlbus.obs.metrics import record_train_step
    from rlbus.rundirs import require_run_dir, run_id_of
    from rlbus_trainer import ckpt
    from rlbus_trainer.batch_check import batch_problem
    from rlbus_trainer.engine import build_engine, setup_distributed, teardown_distributed
    from rlbus_trainer.loss import build_loss_fn
    from rlbus_trainer.weights import build_weight_publisher

    world = setup_distributed(config.collective_timeout_s)
    run_dir = require_run_dir(config, SERVICE)
    run_dir.mkdir(parents=True, exist_ok=True)
    run_id = run_id_of(config.bus.run_id, config.run.name)
    structlog.contextvars.bind_contextvars(service=SERVICE, rank=world.rank)
    bus, start, bus_version = await connect_and_start(config, world, run_dir, run_id)
    engine = build_engine(config, world)
    loss_fn = build_loss_fn(config.loss)
    vocab_size = vocab_size_of(engine.model)

    last_step = start.from_step
    replay: dict | None = None
    if start.from_step:
        progress = ckpt.load_checkpoint(engine, run_dir, start.from_step)
        replay = progress.get("metrics") if isinstance(progress, dict) else None
        log.info(
            "trainer_resumed",
            from_step=start.from_step,
            why=start.why,
            bus_version=bus_version,
            retrain_without_publish=max(bus_version - start.from_step, 0),
        )

    stop = stop or ServiceState(SERVICE)
    publisher = build_weight_publisher(config, bus=bus, run_dir=run_dir, world=world)
    published_through = bus_version
    if start.from_step > bus_version:  # killed between checkpoint K and its publish
        await publisher.publish(start.from_step, engine)
        published_through = start.from_step
    if world.is_main:
        if config.max_steps is None or last_step < config.max_steps:
            await bus.clear_finished()  # resumed with steps left: the run goes on
        await bus.serve_control(SERVICE, control_handler(stop, pausable=False))
        await publish_event(bus, events.Lifecycle(service=SERVICE, state="started"))
        if replay and await last_metrics_step(bus) < start.from_step:
            # killed between checkpoint K and K's metrics: send the saved ones (once; the
            # monitor also writes a step it has already written only once)
            await publish_event(
                bus,
                events.StepMetrics(
                    service=SERVICE, step=start.from_step, metrics={**replay, "replayed": 1.0}
                ),
            )
            log.info("step_metrics_replayed", step=start.from_step)
    log.info(
        "trainer_started", run_dir=str(run_dir), next_step=last_step + 1, max_steps=config.max_steps
    )

    step = last_step + 1
    while config.max_steps is None or step <= config.max_steps:
        structlog.contextvars.bind_contextvars(step=step)
        arrival = await wait_for_batch(bus, step, stop)
        if arrival is None:
            break
        batch = arrival.batch
        if arrival.problem is None:
            arrival.problem = batch_problem(batch, step, vocab_size)
        skipped = agreed(arrival.problem is not None)
        if skipped and world.is_main:
            await quarantine(bus, step, arrival)
        # One span for the whole step: training, checkpoint and weights publish are its children,
        # and it is a child of the batch's publish (the step's trace, docs/observability.md).
        with tracing.consumer_span(
            tracing.TRAIN_STEP,
            headers=arrival.headers,
            attributes={tracing.STEP_ATTR: step, "rlbus.skipped": skipped},
        ):
            t0 = time.perf_counter()
            result = None
            if not skipped:
                result = await asyncio.to_thread(
                    engine.train_step,
                    rank_micro_batches(batch, world.rank, world.world_size),
                    loss_fn,
                )
            if agreed(stop.stop_now):
                log.info("train_step_discarded_on_stop", step=step)
                break
            extra: dict[str, float] = {}
            if config.ckpt is not None and (
                step % config.ckpt.interval == 0 or step == config.max_steps
            ):
                c0 = time.perf_counter()
                progress: dict = {"step": step}
                # the step's metrics travel with the checkpoint (replayed on resume)
                if world.is_main:
                    progress["metrics"] = (
                        {"skipped": 1.0, "wait_s": arrival.wait_s}
                        if result is None
                        else step_metrics(result, batch, arrival.wait_s, c0 - t0, {})
                    )
                with tracing.span(tracing.CHECKPOINT):
                    await asyncio.to_thread(ckpt.save_checkpoint, engine, run_dir, step, progress)
                if world.is_main:
                    ckpt.prune_checkpoints(run_dir, config.ckpt.keep_last, current_step=step)
                extra["ckpt_s"] = time.perf_counter() - c0
            if step <= published_through:  # the bus has this version: never publish it again
                extra["retrained"] = 1.0
            else:
                with tracing.span(tracing.WEIGHTS_PUBLISH, attributes={tracing.VERSION: step}):
                    extra.update(await publisher.publish(step, engine))
            if world.is_main:
                step_s = time.perf_counter() - t0
                if result is None:
                    metrics = {"skipped": 1.0, "wait_s": arrival.wait_s, "step_s": step_s, **extra}
                else:
                    metrics = step_metrics(result, batch, arrival.wait_s, step_s, extra)
                await publish_event(
                    bus, events.StepMetrics(service=SERVICE, step=step, metrics=metrics)
                )
                record_train_step(step, metrics)  # Prometheus (rlbus.obs.metrics)
                if result is not None:
                    log.info(
                        "train_step",
                        loss=round(result.loss, 4),
                        grad_norm=round(result.grad_norm, 3),
                        tokens_per_s=round(metrics["tokens_per_s"]),
                        wait_s=round(arrival.wait_s, 3),
                        retrained=bool(extra.get("retrained")),
                    )
                bus.step_log.discard_claims(
                    never_reread_through(run_dir, step, checkpointing=config.ckpt is not None)
                )
        last_step = step
        step += 1

    if world.is_main:
        if stop.reason is None and config.max_steps is not None and last_step >= config.max_steps:
            await bus.mark_finished(last_step)
        await publish_event(
            bus,
            events.Lifecycle(service=SERVICE, state="stopped", reason=stop.reason or "max_steps"),
        )
    await publisher.close()
    await bus.close()
    log.info("trainer_stopped", last_step=last_step)
    teardown_distributed()
    return last_step


def run(config) -> int:
    """Entry point called by `trainer` (entrypoint.py) on every rank."""
    return run_service(SERVICE, lambda state: run_async(config, state))
