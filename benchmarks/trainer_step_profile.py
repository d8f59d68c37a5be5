"""Where one RL trainer step of the reverse-text example goes (torch profiler), and what the
engine's knobs change, side by side in one process.

    uv run python benchmarks/trainer_step_profile.py [--model examples/reverse-text/model]
        [--steps 5] [--tokens-per-forward 4096,16384] [--top 12]

The batch is shaped like the example's: 16 prompts x 8 samples, prompts of 50-60 tokens and
completions of 5-14 (the reverse-text chat template around 5-10 letters), packed into rows of
`seq_len` 128 by the orchestrator's own packing (rlbus_orchestrator.packing). The model is the
example's (one gloo rank, FSDP2, AdamW as in examples/reverse-text/rl.toml). For each
`tokens_per_forward` it prints the median forward/backward and optimizer time over the steps
after one warm-up, then the profiler's top ops of one step for the first setting.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time


def reverse_text_like_batch(seed: int, seq_len: int = 128):
    """128 samples with the example's lengths, packed into micro-batches by the orchestrator."""
    from rlbus.wire.rollouts import RolloutSample
    from rlbus_orchestrator.packing import make_train_sample, pack

    rng = random.Random(seed)
    samples = []
    for _ in range(16):
        prompt = [rng.randrange(0, 256) for _ in range(rng.randint(50, 60))]
        for _ in range(8):
            n = rng.randint(5, 14)
            sample = RolloutSample(
                prompt_token_ids=prompt,
                completion_token_ids=[rng.randrange(0, 256) for _ in range(n)],
                completion_logprobs=[-1.0] * n,
                completion_mask=[1] * n,
                reward=rng.random(),
            )
            samples.append(make_train_sample(sample, rng.uniform(-1, 1), seq_len))
    return pack(samples, seq_len=seq_len, num_ranks=1)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="examples/reverse-text/model")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tokens-per-forward", default="4096,16384")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    import torch

    from rlbus.configs.trainer import TrainerConfig
    from rlbus_trainer.engine import build_engine, setup_distributed
    from rlbus_trainer.loss import build_loss_fn

    world = setup_distributed()
    batches = [reverse_text_like_batch(s) for s in range(args.steps + 1)]
    print(
        f"batch: {sum(len(mb.input_ids) for mb in batches[0])} tokens in {len(batches[0])} rows "
        f"of <= 128; torch threads {torch.get_num_threads()}"
    )
    profiled = None
    for budget in [int(b) for b in args.tokens_per_forward.split(",")]:
        config = TrainerConfig(
            model={"name": args.model, "dtype": "float32"},
            optim={"type": "adamw", "lr": 1e-3, "weight_decay": 0.0},
            seq_len=128,
            tokens_per_forward=budget,
        )
        engine = build_engine(config, world)
        loss_fn = build_loss_fn(config.loss)
        engine.train_step(batches[0], loss_fn)  # warm-up
        fb, opt, wall = [], [], []
        for mbs in batches[1:]:
            started = time.perf_counter()
            result = engine.train_step(mbs, loss_fn)
            wall.append(time.perf_counter() - started)
            fb.append(result.forward_backward_s)
            opt.append(result.optimizer_s)
        print(
            f"tokens_per_forward {budget:6d}: forward/backward {statistics.median(fb):.3f} s, "
            f"optimizer {statistics.median(opt):.3f} s, step {statistics.median(wall):.3f} s"
        )
        if profiled is None:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                engine.train_step(batches[1], loss_fn)
            profiled = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top)
    print(profiled)


if __name__ == "__main__":
    main()
