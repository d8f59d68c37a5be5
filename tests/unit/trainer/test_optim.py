"""Optimizers, schedules and full offload: full_offload matches plain optimizers step for step."""

import copy

import pytest
import torch
from pydantic import ValidationError

from rlbus.configs.trainer import (
    AdamWConfig,
    CosineSchedulerConfig,
    LinearSchedulerConfig,
    MuonConfig,
    SignSGDConfig,
    TrainerConfig,
)
from rlbus_trainer.full_offload import OptimizerInBackward
from rlbus_trainer.optim import LRSchedule, build_optimizer, clip_grad_norm


def make_model(seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(config)


def make_micro_batches(num_steps=5, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [
        [torch.randint(0, 64, (1, 12), generator=gen) for _ in range(2)] for _ in range(num_steps)
    ]


def micro_batch_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def train_plain(model, optim_config, data):
    opt = build_optimizer(optim_config, model)
    for micro_batches in data:
        for ids in micro_batches:
            (micro_batch_loss(model, ids) / len(micro_batches)).backward()
        opt.step()
        opt.zero_grad()
    return model


def train_full_offload(model, optim_config, data, backend="native"):
    offload = OptimizerInBackward(model, optim_config, backend=backend, numa_binding=False)
    for micro_batches in data:
        for i, ids in enumerate(micro_batches):
            offload.last_micro_batch = i == len(micro_batches) - 1
            (micro_batch_loss(model, ids) / len(micro_batches)).backward()
        offload.step()
    return model


def assert_same_weights(a, b, atol):
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=atol, rtol=1e-4, msg=name)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_full_offload_adamw_matches_plain_adamw_over_5_steps(backend):
    cfg = AdamWConfig(lr=1e-2, max_norm=None)
    base = make_model()
    data = make_micro_batches()
    plain = train_plain(copy.deepcopy(base), cfg, data)
    offloaded = train_full_offload(copy.deepcopy(base), cfg, data, backend)
    assert_same_weights(plain, offloaded, atol=1e-5)
    moved = max(
        (p - q).abs().max().item()
        for p, q in zip(base.parameters(), plain.parameters(), strict=True)
    )
    assert moved > 1e-3


def test_full_offload_sign_sgd_matches_plain_sign_sgd_over_5_steps():
    cfg = SignSGDConfig(lr=1e-3, max_norm=None)
    base = make_model()
    data = make_micro_batches()
    assert_same_weights(
        train_plain(copy.deepcopy(base), cfg, data),
        train_full_offload(copy.deepcopy(base), cfg, data),
        atol=1e-6,
    )


def test_full_offload_with_muon_fails_at_config_time():
    with pytest.raises(ValidationError, match="optim.type adamw"):
        TrainerConfig(
            model={"full_offload": True, "optim_cpu_offload": False}, optim={"type": "muon"}
        )


def test_full_offload_with_state_offload_fails_at_config_time():
    with pytest.raises(ValidationError, match="optim_cpu_offload = false"):
        TrainerConfig(model={"full_offload": True})


def test_muon_optimizer_steps_hidden_matrices_and_adamw_the_rest():
    model = make_model()
    opt = build_optimizer(MuonConfig(lr=0.02, adamw_lr=1e-3), model)
    assert [type(o).__name__ for o in opt.optimizers] == ["Muon", "AdamW"]
    before = copy.deepcopy(model)
    train_plain(model, MuonConfig(lr=0.02, adamw_lr=1e-3), make_micro_batches(num_steps=1))
    changed = [
        n
        for (n, p), q in zip(model.named_parameters(), before.parameters(), strict=True)
        if not torch.equal(p, q)
    ]
    assert any("q_proj" in n for n in changed) and any("embed" in n for n in changed)


def test_schedules_warm_up_then_decay_to_min_ratio():
    model = make_model()
    opt = build_optimizer(AdamWConfig(lr=1.0), model)
    for cfg, mid in [
        (LinearSchedulerConfig(warmup_steps=4, min_lr_ratio=0.1), 0.55),
        (CosineSchedulerConfig(warmup_steps=4, min_lr_ratio=0.1), 0.55),
    ]:
        sched = LRSchedule(cfg, opt, max_steps=14)
        lrs = [sched.lr] + [sched.step() or sched.lr for _ in range(14)]
        assert (
            lrs[0] == pytest.approx(0.2)
            and lrs[3] == pytest.approx(0.8)
            and lrs[4] == pytest.approx(1.0)
        )
        assert lrs[9] == pytest.approx(mid)
        assert lrs[14] == pytest.approx(0.1)


def test_clip_grad_norm_returns_norm_before_clipping():
    model = make_model()
    micro_batch_loss(model, make_micro_batches(1)[0][0]).backward()
    norm = clip_grad_norm(model.parameters(), 1e-3)
    assert norm > 1e-3
    assert clip_grad_norm(model.parameters(), None) == pytest.approx(1e-3, rel=1e-3)
