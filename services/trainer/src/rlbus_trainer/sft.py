"""SFT: the per-rank training body that `sft` launches under torchrun (`run(config)`).

Same engine as RL (model, FSDP2, optimizer, offload, checkpoints), fed from local data instead of
the bus: step s trains on examples [(s-1)*batch_size, s*batch_size) of the data (sft_data.py),
split round-robin over ranks and packed into rows of seq_len. Validation loss every
`data.val_interval` steps when `data.val_path` is set. At the end rank 0 writes `<run_dir>/model/`,
an HF directory that `inference` and `rl` load. The `sft` command (rlbus_launch.sft) names the
run, writes the resolved config and starts torchrun, whose ranks (sft_entrypoint.py) call
`run(config)`.
"""

from __future__ import annotations

import time
from pathlib import Path

import structlog

log = structlog.get_logger()


def _num_steps(config, data) -> int:
    if config.max_steps is not None:
        return config.max_steps
    if data.num_examples is None:
        raise ValueError(
            "sft: the built-in reverse-text data never ends: set max_steps (--max-steps N)"
        )
    return max(1, data.num_examples // config.data.batch_size)


def run(config) -> Path | None:
    """Train per `config` (an SFTConfig) on this rank; returns the final model dir on rank 0."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from rlbus.obs.sinks import build_sinks
    from rlbus.rundirs import require_run_dir
    from rlbus_trainer import ckpt
    from rlbus_trainer.engine import build_engine, setup_distributed, teardown_distributed
    from rlbus_trainer.hf_dir import write_hf_dir
    from rlbus_trainer.sft_data import SFTData, pack, sft_loss

    world = setup_distributed()
    run_dir = require_run_dir(config, "sft")
    run_dir.mkdir(parents=True, exist_ok=True)
    structlog.contextvars.bind_contextvars(service="sft", rank=world.rank)
    tokenizer = AutoTokenizer.from_pretrained(
        config.model.name, trust_remote_code=config.model.trust_remote_code
    )
    data = SFTData(
        config.data.path,
        tokenizer,
        loss_roles=config.data.loss_roles,
        batch_size=config.data.batch_size,
        seed=config.seed,
        copy_fraction=config.data.copy_fraction,
    )
    val = None
    if config.data.val_path:
        val = SFTData(
            config.data.val_path,
            tokenizer,
            loss_roles=config.data.loss_roles,
            batch_size=config.data.batch_size,
            seed=config.seed,
            split="val",
        )
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

    for step in range(start + 1, num_steps + 1):
        t0 = time.perf_counter()
        samples = data.batch(step)[world.rank :: world.world_size]
        if (
            step == start + 1
            and (longest := max(len(x.input_ids) for x in samples)) > config.seq_len
        ):
            log.warning(
                "sft_samples_truncated",
                longest=longest,
                seq_len=config.seq_len,
                fix=f"raise seq_len to at least {longest}: truncated samples lose their answers",
            )
        micro_batches = pack(samples, config.seq_len, pack=config.data.pack)
        result = engine.train_step(micro_batches, sft_loss)
        elapsed = time.perf_counter() - t0
        record = {
            "step": step,
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            "lr": result.lr,
            "tokens_per_s": result.num_tokens / elapsed,
            "num_tokens": result.num_tokens,
            "step_time_s": elapsed,
            **result.metrics,
        }
        if val is not None and (step % config.data.val_interval == 0 or step == num_steps):
            record["val_loss"] = engine.eval_loss(
                pack(
                    val.batch(1)[world.rank :: world.world_size],
                    config.seq_len,
                    pack=config.data.pack,
                ),
                sft_loss,
            )
        if world.is_main:
            log.info(
                "sft_step",
                step=step,
                loss=round(result.loss, 4),
                lr=result.lr,
                grad_norm=round(result.grad_norm, 3),
                tokens_per_s=round(record["tokens_per_s"]),
                **({"val_loss": round(record["val_loss"], 4)} if "val_loss" in record else {}),
            )
        for sink in sinks:
            sink.write(record)
        if config.ckpt is not None and (step % config.ckpt.interval == 0 or step == num_steps):
            ckpt.save_checkpoint(engine, run_dir, step, progress={"step": step})
            if world.is_main:
                ckpt.prune_checkpoints(run_dir, config.ckpt.keep_last, current_step=step)

    for sink in sinks:
        sink.close()
    out = None
    if config.save_final_model:
        state = engine.full_state_dict()
        if config.lora is not None:  # a plain HF model: the adapters folded into the weights
            from rlbus_trainer.lora import merged_state_dict

            state = merged_state_dict(state, config.lora)
        if world.is_main:
            out = write_hf_dir(
                state,
                config.model.name,
                run_dir / "model",
                trust_remote_code=config.model.trust_remote_code,
            )
            log.info("sft_model_written", path=str(out))
        dist.barrier()
    teardown_distributed()
    return out
