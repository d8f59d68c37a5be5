"""Helpers for the trainer's tests (and other services' tests that need a trained model):
config factories and running SFT ranks under torchrun in a killable process group."""

import json
import os
import subprocess
import sys
import textwrap

RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from rlbus.configs.sft import SFTConfig
    from rlbus_trainer.sft import run
    run(SFTConfig.model_validate(json.loads(open(sys.argv[1]).read())))
    """
)


def start_sft_ranks(tmp_path, config: dict, num_processes: int) -> subprocess.Popen:
    """Start `num_processes` SFT ranks with torchrun (a new process group, killable as a whole)."""
    config_file = tmp_path / f"sft-{config['run']['name']}.json"
    config_file.write_text(json.dumps(config))
    script = tmp_path / "sft_rank.py"
    script.write_text(RANK_SCRIPT)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={num_processes}",
            str(script), str(config_file)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    log = open(tmp_path / f"sft-{config['run']['name']}.log", "w")
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def run_sft_ranks(tmp_path, config: dict, num_processes: int, timeout_s: float = 300) -> None:
    proc = start_sft_ranks(tmp_path, config, num_processes)
    try:
        rc = proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    log = (tmp_path / f"sft-{config['run']['name']}.log").read_text()
    assert rc == 0, log[-4000:]


def make_sft_config(model_dir, output_dir, name, **overrides) -> dict:
    config = {
        "model": {"name": str(model_dir)},
        "optim": {"type": "adamw", "lr": 2e-3, "weight_decay": 0.0},
        "max_steps": 4,
        "seq_len": 256,
        "rows_per_forward": 16,
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
