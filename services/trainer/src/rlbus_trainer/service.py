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
checkpoint K the trainer re-reads K+1, K+2, ... from the log. A stop (SIGTERM, or a `drain`/`stop`
control request to rank 0) is agreed by all ranks at the next poll and ends after the current step.
"""

from __future__ import annotations

import asyncio
import signal
import time
from contextlib import nullcontext
from pathlib import Path

import structlog
import torch
import torch.distributed as dist

from rlbus.wire import control, events
from rlbus.wire.batches import MicroBatch, TrainBatch

log = structlog.get_logger()

SERVICE = "trainer"
POLL_S = 0.25


def run_dir_of(config) -> Path:
    from rlbus.runs import resolve_run_dir

    if not (config.run.name or config.run.dir):
        raise ValueError(
            "trainer: run.name is not set; pass --run.name (the `rl` launcher sets it)"
        )
    return resolve_run_dir(config.output_dir, config.run.name, config.run.dir)


def rank_micro_batches(batch: TrainBatch, rank: int, world_size: int) -> list[MicroBatch]:
    """This rank's micro-batches; a batch packed for another world size is re-split round-robin."""
    if len(batch.micro_batches) == world_size:
        return list(batch.micro_batches[rank])
    flat = [mb for per_rank in batch.micro_batches for mb in per_rank]
    return flat[rank::world_size]


class StopFlag:
    """Set by SIGTERM/SIGINT or a control request; read at every poll."""

    def __init__(self):
        self.reason: str | None = None

    def set(self, reason: str) -> None:
        if self.reason is None:
            log.info("trainer_stop_requested", reason=reason)
            self.reason = reason


async def wait_for_batch(bus, step: int, stop: StopFlag) -> tuple[TrainBatch | None, dict, float]:
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
        flags = torch.tensor([float(batch is not None), float(stop.reason is not None)])
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


def install_signal_handlers(stop: StopFlag) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set, sig.name)


async def serve_control(bus, stop: StopFlag) -> None:
    async def handle(request) -> control.ControlReply:
        if isinstance(request, (control.Drain, control.Stop)):
            stop.set(f"control {type(request).__name__.lower()}: {request.reason or ''}".strip())
            return control.ControlReply(ok=True, service=SERVICE, state="draining")
        return control.ControlReply(
            ok=False, service=SERVICE, message=f"{type(request).__name__} is not supported"
        )

    await bus.serve_control(SERVICE, handle)


async def run_async(config) -> int:
    """The service body (see module docstring); returns the last trained step."""
    from rlbus.bus import Bus
    from rlbus.obs import tracing
    from rlbus_trainer import ckpt
    from rlbus_trainer.engine import build_engine, setup_distributed, teardown_distributed
    from rlbus_trainer.loss import build_loss_fn
    from rlbus_trainer.weights import build_weight_publisher

    world = setup_distributed()
    run_dir = run_dir_of(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    run_id = config.bus.run_id or config.run.name
    structlog.contextvars.bind_contextvars(service=SERVICE, rank=world.rank)
    if world.is_main:
        tracing.setup_tracing(
            SERVICE,
            run_dir=run_dir,
            endpoint=config.otel.endpoint,
            enabled=config.otel.enabled,
            run_id=run_id,
        )
    engine = build_engine(config, world)
    loss_fn = build_loss_fn(config.loss)

    last_step = 0
    if config.resume is not None:
        resume_step = ckpt.resolve_resume_step(run_dir, config.resume.step)
        if resume_step is not None:
            ckpt.load_checkpoint(engine, run_dir, resume_step)
            last_step = resume_step

    stop = StopFlag()
    install_signal_handlers(stop)
    bus = await Bus.connect(
        config.bus, run_id=run_id, storage_dir=run_dir, name=f"{SERVICE}-{world.rank}"
    )
    publisher = build_weight_publisher(config, bus=bus, run_dir=run_dir, world=world)
    if world.is_main:
        await serve_control(bus, stop)
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
    if world.is_main:
        tracing.shutdown_tracing()
    log.info("trainer_stopped", last_step=last_step)
    teardown_distributed()
    return last_step


def run(config) -> int:
    """Entry point called by `trainer` (entrypoint.py) on every rank."""
    return asyncio.run(run_async(config))
