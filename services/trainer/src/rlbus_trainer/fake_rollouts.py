"""`trainer` with `[data.fake]`: the RL trainer alone, on random rollouts, to measure its speed.

No bus, orchestrator or inference server: each of `max_steps` steps trains the configured loss
on `data.fake.batch_size` random samples of `seq_len` tokens (or, with `generate_samples`, of
random lengths packed into rows as rollouts are). A quarter of each sample is its prompt (no
loss); its advantage is drawn from N(0, 1) and its inference logprobs are those of a uniform
policy. Every step logs a `fake_step` line (loss, tokens/s); the run ends with `fake_run_done`
(mean tokens/s from step 2 on: step 1 pays the warm-up). prime-rl's configs/debug/fake/rl.toml
(`trainer @ ...`) runs this. The samples are split over the ranks round-robin.
"""

from __future__ import annotations

import math
import random
import statistics
import time

import msgspec
import structlog

from rlbus.configs import TrainerConfig
from rlbus.wire.batches import MicroBatch
from rlbus_trainer.engine import (
    build_engine,
    setup_distributed,
    teardown_distributed,
    vocab_size_of,
)
from rlbus_trainer.loss import build_loss_fn
from rlbus_trainer.sft_data import Tokenized, pack

log = structlog.get_logger()


def fake_micro_batches(
    config: TrainerConfig, vocab_size: int, step: int, rank: int, world_size: int
) -> list[MicroBatch]:
    """This rank's share of step `step`'s random rollouts, packed (deterministic per step)."""
    fake = config.data.fake
    assert fake is not None
    rng = random.Random(f"fake-rollouts/{config.seed}/{step}")
    samples, advantages = [], []
    for _ in range(fake.batch_size):
        n = rng.randint(8, config.seq_len) if fake.generate_samples else config.seq_len
        prompt = max(1, n // 4)
        samples.append(
            Tokenized(
                [rng.randrange(vocab_size) for _ in range(n)], [0] * prompt + [1] * (n - prompt)
            )
        )
        advantages.append(rng.gauss(0.0, 1.0))
    mine = list(range(rank, fake.batch_size, world_size))
    rows = pack([samples[i] for i in mine], config.seq_len, pack=fake.generate_samples)
    uniform = -math.log(vocab_size)
    per_sample = iter(advantages[i] for i in mine)
    out = []
    for row in rows:
        per_token = [a for n in row.seq_lens for a in [next(per_sample)] * n]
        out.append(
            msgspec.structs.replace(
                row,
                advantages=per_token,
                inference_logprobs=[uniform if m else 0.0 for m in row.loss_mask],
            )
        )
    return out


def run(config: TrainerConfig) -> float:
    """Train `max_steps` fake steps on this rank; returns the mean tokens/s from step 2 on."""
    assert config.data.fake is not None and config.max_steps is not None
    world = setup_distributed(config.collective_timeout_s)
    engine = build_engine(config, world)
    loss_fn = build_loss_fn(config.loss)
    vocab_size = vocab_size_of(engine.model)
    log.info("fake_run_started", max_steps=config.max_steps, seq_len=config.seq_len)
    speeds = []
    for step in range(1, config.max_steps + 1):
        t0 = time.perf_counter()
        batches = fake_micro_batches(config, vocab_size, step, world.rank, world.world_size)
        result = engine.train_step(batches, loss_fn)
        elapsed = time.perf_counter() - t0
        speeds.append(result.num_tokens / elapsed)
        log.info(
            "fake_step",
            step=step,
            loss=round(result.loss, 4),
            grad_norm=round(result.grad_norm, 3),
            num_tokens=result.num_tokens,
            tokens_per_s=round(speeds[-1]),
            step_time_s=round(elapsed, 3),
        )
    mean = statistics.fmean(speeds[1:] or speeds)
    log.info("fake_run_done", steps=config.max_steps, tokens_per_s=round(mean))
    teardown_distributed()
    return mean
