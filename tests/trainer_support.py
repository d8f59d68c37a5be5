"""Helpers for the trainer's tests (and other services' tests that need a trained model):
config factories and running SFT ranks under torchrun in a killable process group.
(tests/conftest.py puts this folder on sys.path; benchmarks/trainer.py adds it itself.)"""

import json
import math
import os
import random
import subprocess
import sys
import textwrap
import time

from rlbus.wire.batches import MicroBatch, TrainBatch

RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from rlbus_trainer.entrypoint import die_with_agent
    die_with_agent()
    from rlbus.obs.logging import setup_logging
    setup_logging(sys.argv[1])
    if sys.argv[1] == "sft":
        from rlbus.configs.sft import SFTConfig as Config
        from rlbus_trainer.sft import run
    else:
        from rlbus.configs.trainer import TrainerConfig as Config
        from rlbus_trainer.service import run
    run(Config.model_validate(json.loads(open(sys.argv[2]).read())))
    """
)


def start_ranks(tmp_path, config: dict, num_processes: int, kind: str = "sft") -> subprocess.Popen:
    """Start `num_processes` SFT (`kind="sft"`) or RL trainer (`"trainer"`) ranks with torchrun,
    (kill them all with `kill_tree(proc)`). Log: `<kind>-<name>.log`."""
    name = config["run"]["name"]
    config_file = tmp_path / f"{kind}-{name}.json"
    config_file.write_text(json.dumps(config))
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={num_processes}",
        str(script),
        kind,
        str(config_file),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    log = open(tmp_path / f"{kind}-{name}.log", "a")
    return subprocess.Popen(
        argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def descendants(pid: int) -> list[int]:
    """PIDs of every process below `pid` (Linux /proc). torchrun starts its workers in their own
    sessions, so killing torchrun's process group does not reach them."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        out += children
        todo += children
    return out


def is_alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def kill_tree(proc: subprocess.Popen, timeout_s: float = 10.0) -> list[int]:
    """kill -9 torchrun and every rank below it, wait until they are dead; returns their PIDs."""
    pids = [proc.pid, *descendants(proc.pid)]
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    proc.wait()
    deadline = time.monotonic() + timeout_s
    while any(is_alive(pid) for pid in pids[1:]):
        assert time.monotonic() < deadline, f"processes survived kill -9: {pids}"
        time.sleep(0.05)
    return pids


def start_sft_ranks(tmp_path, config: dict, num_processes: int) -> subprocess.Popen:
    return start_ranks(tmp_path, config, num_processes, "sft")


def wait_ranks(
    tmp_path, proc: subprocess.Popen, config: dict, kind: str = "sft", timeout_s: float = 300
) -> None:
    """Wait for the ranks to exit 0 (killing them on timeout); the log tail on failure."""
    try:
        rc = proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    log = (tmp_path / f"{kind}-{config['run']['name']}.log").read_text()
    assert rc == 0, log[-4000:]


def run_sft_ranks(tmp_path, config: dict, num_processes: int, timeout_s: float = 300) -> None:
    wait_ranks(tmp_path, start_sft_ranks(tmp_path, config, num_processes), config, "sft", timeout_s)


def make_sft_config(model_dir, output_dir, name, **overrides) -> dict:
    config = {
        "model": {"name": str(model_dir)},
        "optim": {"type": "adamw", "lr": 2e-3, "weight_decay": 0.0},
        "max_steps": 4,
        "seq_len": 256,
        "output_dir": str(output_dir),
        "run": {"name": name},
        "data": {"batch_size": 16},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def make_train_batch(step: int, *, num_ranks: int = 1, num_sequences: int = 8, seed: int = 0):
    """A deterministic RL `TrainBatch` for step `step`: random prompts + completions, one packed
    micro-batch per rank, advantages of both signs, inference logprobs of a near-uniform policy."""
    rng = random.Random(f"train-batch/{seed}/{step}")
    per_rank = []
    for _ in range(num_ranks):
        ids, pos, mask, adv, lps, seq_lens = [], [], [], [], [], []
        for _ in range(num_sequences):
            prompt, completion = rng.randint(4, 8), rng.randint(3, 6)
            advantage = rng.choice([-1.0, 1.0]) * rng.random()
            n = prompt + completion
            ids += [rng.randrange(97, 123) for _ in range(n)]
            pos += list(range(n))
            mask += [0] * prompt + [1] * completion
            adv += [0.0] * prompt + [advantage] * completion
            lps += [0.0] * prompt + [-math.log(300)] * completion
            seq_lens.append(n)
        per_rank.append(
            [
                MicroBatch(
                    input_ids=ids,
                    position_ids=pos,
                    loss_mask=mask,
                    advantages=adv,
                    inference_logprobs=lps,
                    temperatures=[1.0] * len(ids),
                    seq_lens=seq_lens,
                )
            ]
        )
    return TrainBatch(
        step=step,
        micro_batches=per_rank,
        num_samples=num_sequences * num_ranks,
        num_tokens=sum(len(mbs[0].input_ids) for mbs in per_rank),
    )


def make_trainer_config(model_dir, output_dir, name: str, bus: dict, **overrides) -> dict:
    config = {
        "model": {"name": str(model_dir)},
        "optim": {"type": "adamw", "lr": 1e-3, "weight_decay": 0.0},
        "loss": {"type": "default", "mask_low": 1.0, "mask_high": 1.0},
        "seq_len": 256,
        "output_dir": str(output_dir),
        "run": {"name": name},
        "bus": bus,
    }
    config.update(overrides)
    return config


CUSTOM_LOSS_CALLS: list[dict] = []
"""What `recording_loss` saw, one entry per call (the custom-loss test reads it)."""


def recording_loss(inputs, num_global_tokens: int, *, scale: float = 1.0):
    """A custom loss for `loss.type = "custom"` tests (import path
    `trainer_support:recording_loss`): `scale` x the on-policy policy gradient, token-normalised,
    recording each call and reporting a `custom_calls` metric."""
    CUSTOM_LOSS_CALLS.append(
        {
            "num_global_tokens": num_global_tokens,
            "num_global_samples": inputs.num_global_samples,
            "num_samples": len(set(inputs.sample_ids[inputs.loss_mask].tolist())),
            "scale": scale,
        }
    )
    per_token = -inputs.trainer_logprobs * inputs.advantages * inputs.loss_mask
    loss = scale * per_token.sum() / max(num_global_tokens, 1)
    return loss, {"custom_calls": inputs.advantages.new_tensor(1.0)}
