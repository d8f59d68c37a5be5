"""FSDP2 over gloo: 2 ranks follow the same loss trajectory and reach the same weights as 1 rank."""

import pytest
import torch
from safetensors.torch import load_file
from trainer_support import make_sft_config, read_metrics, run_sft_ranks


@pytest.mark.slow
def test_two_ranks_match_one_rank_loss_trajectory(tiny_model, tmp_path):
    out = tmp_path / "out"
    for name, nproc in [("one", 1), ("two", 2)]:
        run_sft_ranks(tmp_path, make_sft_config(tiny_model, out, name, max_steps=3), nproc)
    one, two = read_metrics(out / "one"), read_metrics(out / "two")
    assert [m["step"] for m in two] == [1, 2, 3]
    for a, b in zip(one, two, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert b["num_tokens"] == a["num_tokens"]
    assert one[-1]["loss"] < one[0]["loss"]
    w1 = load_file(out / "one" / "model" / "model.safetensors")
    w2 = load_file(out / "two" / "model" / "model.safetensors")
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], atol=1e-4, rtol=1e-3, msg=name)
