"""The RL trainer service: `run(config)` on every torchrun rank.

    setup: process group, engine (model + FSDP2 + optimizer), checkpoint on --resume, bus, publisher
    for step in next_step ..:
        wait    every rank polls the step log for step N; an all-reduce keeps ranks in lockstep,
                so all start (or all stop) together. Time spent here is `wait_s`.
        train   this rank's micro-batches (`batch.micro_batches[rank]`), one optimizer step
        ckpt    every `ckpt.interval` steps (and the last), then prune to keep_last
        publish weights version N (filesystem or nccl), then step metrics (rank 0)

Only the step the trainer expects next is ever read (by subject `batches.<N>`), so a batch
redelivered or republished for a step already trained is never trained twice; after a resume from
checkpoint K the trainer re-reads K+1, K+2, ... from the log.

Ending (signals and control requests reach rank 0's `ServiceState`, rlbus.runtime; all ranks agree
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
from contextlib import nullcontext

import structlog
import torch
import torch.distributed as dist

from rlbus.runtime import ServiceState, control_handler, run_service
from rlbus.wire import events
from rlbus.wire.batches import MicroBatch, TrainBatch

log = structlog.get_logger()

SERVICE = "trainer"
POLL_S = 0.25


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


async def wait_for_batch(
    bus, step: int, stop: ServiceState
) -> tuple[TrainBatch | None, dict, float]:
    """Step `step`'s batch once every rank has it (None: stop agreed). Collective."""
    from rlbus.bus.errors import StepNotFound

    t0 = time.perf_counter()
    batch, headers = None, {}
    while True:
        if batch is None:
            try:
                batch, headers = await bus.step_log.get_with_headers(step, timeout_s=POLL_S)
            except StepNotFound:
                pass
        flags = torch.tensor([float(batch is not None), float(stop.ending)])
        dist.all_reduce(flags)
        if flags[1] > 0:
            return None, {}, time.perf_counter() - t0
        if int(flags[0]) == dist.get_world_size():
            return batch, headers, time.perf_counter() - t0
        if batch is not None:
            await asyncio.sleep(0.05)  # waiting for the other ranks to see it


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


async def run_async(config, stop: ServiceState | None = None) -> int:
    """The service body (see module docstring); returns the last trained step."""
    from rlbus.bus import Bus
    from rlbus.obs import tracing
    from rlbus.runs import require_run_dir, run_id_of
    from rlbus_trainer import ckpt
    from rlbus_trainer.engine import build_engine, setup_distributed, teardown_distributed
    from rlbus_trainer.loss import build_loss_fn
    from rlbus_trainer.weights import build_weight_publisher

    world = setup_distributed()
    run_dir = require_run_dir(config, SERVICE)
    run_dir.mkdir(parents=True, exist_ok=True)
    run_id = run_id_of(config.bus.run_id, config.run.name)
    structlog.contextvars.bind_contextvars(service=SERVICE, rank=world.rank)
    engine = build_engine(config, world)
    loss_fn = build_loss_fn(config.loss)

    last_step = ckpt.load_for_resume(engine, run_dir, config.resume)

    stop = stop or ServiceState(SERVICE)
    bus = await Bus.connect(
        config.bus, run_id=run_id, storage_dir=run_dir, name=f"{SERVICE}-{world.rank}"
    )
    publisher = build_weight_publisher(config, bus=bus, run_dir=run_dir, world=world)
    if world.is_main:
        await bus.serve_control(SERVICE, control_handler(stop, pausable=False))
        await publish_event(bus, events.Lifecycle(service=SERVICE, state="started"))
    log.info(
        "trainer_started", run_dir=str(run_dir), next_step=last_step + 1, max_steps=config.max_steps
    )

    step = last_step + 1
    while config.max_steps is None or step <= config.max_steps:
        structlog.contextvars.bind_contextvars(step=step)
        batch, headers, wait_s = await wait_for_batch(bus, step, stop)
        if batch is None:
            break
        if batch.step != step:  # the log is keyed by step; a mismatch is a producer bug
            log.warning("batch_step_mismatch_skipped", expected=step, got=batch.step)
            step += 1
            continue
        t0 = time.perf_counter()
        with (
            tracing.consumer_span("train_step", headers=headers)
            if tracing.enabled()
            else nullcontext()
        ):
            result = await asyncio.to_thread(
                engine.train_step, rank_micro_batches(batch, world.rank, world.world_size), loss_fn
            )
        if agreed(stop.stop_now):
            log.info("train_step_discarded_on_stop", step=step)
            break
        extra: dict[str, float] = {}
        if config.ckpt is not None and (
            step % config.ckpt.interval == 0 or step == config.max_steps
        ):
            c0 = time.perf_counter()
            await asyncio.to_thread(ckpt.save_checkpoint, engine, run_dir, step, {"step": step})
            if world.is_main:
                ckpt.prune_checkpoints(run_dir, config.ckpt.keep_last, current_step=step)
            extra["ckpt_s"] = time.perf_counter() - c0
        with (
            tracing.tracer().start_as_current_span(
                "weights_publish", attributes={"weights.version": step}
            )
            if tracing.enabled()
            else nullcontext()
        ):
            extra.update(await publisher.publish(step, engine))
        if world.is_main:
            metrics = step_metrics(result, batch, wait_s, time.perf_counter() - t0, extra)
            await publish_event(
                bus, events.StepMetrics(service=SERVICE, step=step, metrics=metrics)
            )
            log.info(
                "train_step",
                loss=round(result.loss, 4),
                grad_norm=round(result.grad_norm, 3),
                tokens_per_s=round(metrics["tokens_per_s"]),
                wait_s=round(wait_s, 3),
            )
        last_step = step
        step += 1

    if world.is_main:
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
