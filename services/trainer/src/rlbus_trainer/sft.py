"""SFT: the per-rank training body that `sft` launches under torchrun (`run(config)`).

Same engine as RL (model, FSDP2, optimizer, offload, checkpoints), fed from local data instead of
the bus: step s trains on examples [(s-1)*batch_size, s*batch_size) of the data (sft_data.py),
split round-robin over ranks and packed into rows of seq_len. Validation loss every
`data.val_interval` steps when `data.val_path` is set. At the end rank 0 writes `<run_dir>/model/`,
an HF directory that `inference` and `rl` load (a LoRA run: its adapter, or with
`export.merge_lora` the merged model; export.py). The `sft` command (rlbus_launch.sft) names the
run, writes the resolved config and starts torchrun, whose ranks (sft_entrypoint.py) call
`run(config)`.

    setup: process group, run dir, data (train, val), engine, its checkpoint, sinks (rank 0)
    for step in start + 1 .. num_steps:
        train    this rank's share of the step's examples, packed (train_step)
        validate every `data.val_interval` steps and at the last (validation_loss)
        evaluate on environments at `eval` steps (sft_eval.py; step 0 before the loop)
        report   an `sft_step` line and a row for every sink (rank 0)
        ckpt     every `ckpt.interval` steps and at the last, then prune to keep_last
    end: the final model (export.export_final), unless `save_final_model` is off
"""

from __future__ import annotations

import time
from pathlib import Path

import structlog
from transformers import AutoTokenizer

from rlbus.configs.sft import SFTConfig
from rlbus.obs.sinks import build_sinks
from rlbus.rundirs import require_run_dir
from rlbus_trainer import ckpt
from rlbus_trainer.engine import (
    Engine,
    World,
    build_engine,
    setup_distributed,
    teardown_distributed,
)
from rlbus_trainer.export import export_final
from rlbus_trainer.sft_data import SFTData, Tokenized, pack, sft_loss
from rlbus_trainer.sft_eval import SFTEvaluator

log = structlog.get_logger()


def run(config: SFTConfig) -> Path | None:
    """Train per `config` (an SFTConfig) on this rank; returns the final model dir on rank 0."""
    world = setup_distributed()
    run_dir = require_run_dir(config, "sft")
    run_dir.mkdir(parents=True, exist_ok=True)
    structlog.contextvars.bind_contextvars(service="sft", rank=world.rank)
    data, val = load_data(config)
    num_steps = _num_steps(config, data)
    engine = build_engine(config, world)
    start = ckpt.load_for_resume(engine, run_dir, config.resume)
    log.info("sft_started", run_dir=str(run_dir), start_step=start, num_steps=num_steps)
    # Rank 0 writes the step rows: metrics.jsonl and, with --monitors.wandb, wandb.
    sinks = (
        build_sinks(config.monitors, config.run.name or run_dir.name, run_dir, config.model_dump())
        if world.is_main
        else []
    )

    evaluator = SFTEvaluator(config, run_dir, world, num_steps) if config.eval is not None else None
    if evaluator is not None and start == 0 and evaluator.is_due(0):
        record0: dict[str, float] = {"step": 0, **evaluator.evaluate(engine, 0)}
        for sink in sinks:
            sink.write(record0)

    for step in range(start + 1, num_steps + 1):
        t0 = time.perf_counter()
        samples = data.batch(step)[world.rank :: world.world_size]
        if step == start + 1:
            warn_if_truncated(samples, config.seq_len)
        record = train_step(engine, config, step, samples, t0)
        if val is not None and (step % config.data.val_interval == 0 or step == num_steps):
            record["val_loss"] = validation_loss(engine, config, val, world)
        if evaluator is not None and evaluator.is_due(step):
            record |= evaluator.evaluate(engine, step)
        if world.is_main:
            log_step(record)
        for sink in sinks:
            sink.write(record)
        if config.ckpt is not None and (step % config.ckpt.interval == 0 or step == num_steps):
            ckpt.save_checkpoint(engine, run_dir, step, progress={"step": step})
            if world.is_main:
                ckpt.prune_checkpoints(run_dir, config.ckpt.keep_last, current_step=step)

    for sink in sinks:
        sink.close()
    out = export_final(engine, config, run_dir, world) if config.save_final_model else None
    teardown_distributed()
    return out


def _num_steps(config: SFTConfig, data: SFTData) -> int:
    if config.max_steps is not None:
        return config.max_steps
    if data.num_examples is None:
        raise ValueError(
            "sft: the built-in reverse-text data never ends: set max_steps (--max-steps N)"
        )
    return max(1, data.num_examples // config.data.batch_size)


def load_data(config: SFTConfig) -> tuple[SFTData, SFTData | None]:
    """The training data and, with `data.val_path`, the validation data (same tokenizer)."""
    tokenizer = AutoTokenizer.from_pretrained(
        config.model.name, trust_remote_code=config.model.trust_remote_code
    )
    data = SFTData.from_config(config.data, tokenizer, seed=config.seed, seq_len=config.seq_len)
    return data, SFTData.validation(config.data, tokenizer, seed=config.seed)


def warn_if_truncated(samples: list[Tokenized], seq_len: int) -> None:
    """One warning when a sample is longer than a row (packing cuts its end: its answer)."""
    longest = max(len(x.input_ids) for x in samples)
    if longest > seq_len:
        log.warning(
            "sft_samples_truncated",
            longest=longest,
            seq_len=seq_len,
            fix=f"raise seq_len to at least {longest}: truncated samples lose their answers",
        )


def train_step(
    engine: Engine, config: SFTConfig, step: int, samples: list[Tokenized], t0: float
) -> dict[str, float]:
    """One optimizer step on this rank's samples (collective); the step's row of metrics, timed
    from `t0` (the start of the step, tokenizing included)."""
    micro_batches = pack(samples, config.seq_len, pack=config.data.pack)
    result = engine.train_step(micro_batches, sft_loss)
    elapsed = time.perf_counter() - t0
    return {
        "step": step,
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "lr": result.lr,
        "tokens_per_s": result.num_tokens / elapsed,
        "num_tokens": result.num_tokens,
        "step_time_s": elapsed,
        **result.metrics,
    }


def validation_loss(engine: Engine, config: SFTConfig, val: SFTData, world: World) -> float:
    """Mean loss over the validation batch, this rank's share packed as for training
    (collective)."""
    samples = val.batch(1)[world.rank :: world.world_size]
    return engine.eval_loss(pack(samples, config.seq_len, pack=config.data.pack), sft_loss)


def log_step(record: dict[str, float]) -> None:
    """The `sft_step` line of one step's row (rank 0)."""
    log.info(
        "sft_step",
        step=record["step"],
        loss=round(record["loss"], 4),
        lr=record["lr"],
        grad_norm=round(record["grad_norm"], 3),
        tokens_per_s=round(record["tokens_per_s"]),
        **({"val_loss": round(record["val_loss"], 4)} if "val_loss" in record else {}),
    )
