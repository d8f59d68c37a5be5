"""prime-rl's SFT example and its fake-data debug configs (tests/fixtures/prime_rl/, prime-rl's own
files) run here with only the model path changed:
- basic/reverse-text/sft.toml reads its dataset by name, from a local HF cache written by the
  test (the hub is out of reach: HF_ENDPOINT is a closed port), trains and evaluates on
  reverse-text through the inference server `sft` starts. The flags size it to two CPU cores.
- debug/fake/sft.toml (`sft @`) and debug/fake/rl.toml (`trainer @`, the trainer alone, no bus;
  it names no model, so `--model.name` gives ours) train on random tokens and report their
  throughput."""

import json
import os
import subprocess
import tomllib

import pytest
from e2e_support import BIN, REPO, configured_model
from hf_cache_support import HF_VARIABLES_UNSET, cache_dataset, reverse_rows, unreachable_hub

from rlbus.samples import read_records

pytestmark = pytest.mark.slow

FIXTURES = REPO / "tests" / "fixtures" / "prime_rl"
TEXTS = ["listen", "silent", "garden", "planet", "rocket", "marble", "window", "forest"] * 8


def with_model(name: str, tmp_path) -> os.PathLike:
    """prime-rl's config `name` with only `model.name` changed (to our tiny example model)."""
    text = (FIXTURES / name).read_text()
    prime_model = tomllib.loads(text)["model"]["name"]
    config = tmp_path / name.replace("/", "-")
    config.write_text(text.replace(f'name = "{prime_model}"', f'name = "{configured_model()}"'))
    return config


def offline_hf(tmp_path) -> dict[str, str]:
    """An environment whose HF cache is `tmp_path/hf` and whose hub does not answer."""
    env = {**os.environ, **unreachable_hub(tmp_path / "hf")}
    for name in HF_VARIABLES_UNSET:
        env.pop(name, None)
    return env


def test_prime_rl_reverse_text_sft_reads_its_dataset_from_the_local_hf_cache(tmp_path):
    config = with_model("examples/reverse-text-sft.toml", tmp_path)
    dataset = tomllib.loads(config.read_text())["data"]["name"]
    cache_dataset(tmp_path / "hf", dataset, {"default": {"train": reverse_rows(TEXTS)}})
    fit_to_two_cpu_cores = [
        "--max-steps", "4", "--data.batch-size", "8", "--eval.interval", "2",
        "--eval.num-examples", "4", "--eval.sampling.max-tokens", "32",
        "--eval.inference.vllm.cpu-kv-cache-bytes", "256MiB",
        "--eval.inference.vllm.enforce-eager", "true",
    ]  # fmt: skip
    done = subprocess.run(
        [str(BIN / "sft"), "@", str(config), *fit_to_two_cpu_cores,
         "--output-dir", str(tmp_path / "out"), "--run.name", "rt"],
        cwd=tmp_path, env=offline_hf(tmp_path), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    run_dir = tmp_path / "out" / "rt"
    rows = {row["step"]: row for row in read_records(run_dir / "metrics.jsonl")}
    assert [s for s in sorted(rows) if "loss" in rows[s]] == [1, 2, 3, 4]
    assert [s for s in sorted(rows) if "eval/reverse-text/reward/mean" in rows[s]] == [0, 2, 4]
    resolved = tomllib.loads((run_dir / "configs" / "sft.toml").read_text())
    assert resolved["data"]["name"] == dataset
    assert (run_dir / "model" / "config.json").exists()


def fake_steps(output: str) -> list[dict]:
    return [
        json.loads(line)
        for line in output.splitlines()
        if '"fake_step"' in line or '"sft_step"' in line
    ]


def test_prime_rl_fake_sft_config_trains_on_random_tokens(tmp_path):
    config = with_model("debug/fake-sft.toml", tmp_path)
    done = subprocess.run(
        [str(BIN / "sft"), "@", str(config), "--output-dir", str(tmp_path / "out"), "--run.name", "f"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rows = read_records(tmp_path / "out" / "f" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["num_tokens"] == 2 * 1024 and r["tokens_per_s"] > 0 for r in rows)


def test_prime_rl_fake_rl_config_runs_the_trainer_alone(tmp_path):
    config = FIXTURES / "debug" / "fake-rl.toml"  # names no model: prime-rl's default one
    done = subprocess.run(
        [str(BIN / "trainer"), "@", str(config), "--model.name", str(configured_model()),
         "--output-dir", str(tmp_path / "out")],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    steps = fake_steps(done.stdout + done.stderr)
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert all(s["num_tokens"] == 2 * 1024 for s in steps)
    assert "trainer: prime-rl key model.seq_len -> seq_len" in done.stderr
