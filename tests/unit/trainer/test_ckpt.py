"""Checkpoints: 6 steps straight == 3 steps, kill -9, resume, 3 more (same final weights)."""

import time

import pytest
import torch
from safetensors.torch import load_file
from trainer_support import (
    kill_tree,
    make_sft_config,
    read_metrics,
    run_sft_ranks,
    start_sft_ranks,
)

from rlbus.rundirs import CHECKPOINT_COMPLETE, resolve_resume_step
from rlbus_trainer.ckpt import complete_steps, prune_checkpoints


def wait_for(predicate, timeout_s=180.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.slow
def test_kill_and_resume_reaches_same_weights_as_straight_run(tiny_model, tmp_path):
    out = tmp_path / "out"
    ckpt = {"interval": 3, "keep_last": None}
    run_sft_ranks(tmp_path, make_sft_config(tiny_model, out, "straight", max_steps=6, ckpt=ckpt), 1)

    proc = start_sft_ranks(
        tmp_path, make_sft_config(tiny_model, out, "killed", max_steps=6, ckpt=ckpt), 1
    )
    try:
        wait_for(lambda: 3 in complete_steps(out / "killed") or proc.poll() is not None)
    finally:
        kill_tree(proc)
    assert complete_steps(out / "killed") == [3], "the run finished before it could be killed"
    assert not (out / "killed" / "model").exists()

    run_sft_ranks(
        tmp_path, make_sft_config(tiny_model, out, "killed", max_steps=6, ckpt=ckpt, resume={}), 1
    )
    steps = [m["step"] for m in read_metrics(out / "killed")]
    assert steps[-3:] == [4, 5, 6]
    straight = load_file(out / "straight" / "model" / "model.safetensors")
    resumed = load_file(out / "killed" / "model" / "model.safetensors")
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], atol=1e-6, rtol=1e-5, msg=name)
    assert complete_steps(out / "killed") == [3, 6]


def make_checkpoint(run_dir, step, complete=True):
    path = run_dir / "checkpoints" / f"step_{step}" / "trainer"
    path.mkdir(parents=True)
    if complete:
        (path / CHECKPOINT_COMPLETE).write_text(str(step))


def test_resume_picks_latest_complete_checkpoint(tmp_path):
    make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 4)
    make_checkpoint(tmp_path, 6, complete=False)
    assert resolve_resume_step(tmp_path, None) == 4
    assert resolve_resume_step(tmp_path, 2) == 2
    with pytest.raises(ValueError, match="resume.step 6"):
        resolve_resume_step(tmp_path, 6)
    assert resolve_resume_step(tmp_path / "nothing", None) is None


def test_prune_keeps_last_complete_and_drops_stale_incomplete(tmp_path):
    for step in (1, 2, 3):
        make_checkpoint(tmp_path, step)
    make_checkpoint(tmp_path, 4, complete=False)
    assert prune_checkpoints(tmp_path, 2, current_step=5) == [1, 4]
    assert complete_steps(tmp_path) == [2, 3]
    assert not (tmp_path / "checkpoints" / "step_1").exists()
