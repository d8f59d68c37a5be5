"""LoRA in the trainer: adapters start as the identity, only they train, merging them reproduces
the adapted forward, and the published directory is PEFT's format."""

import json

import pytest
import torch
from safetensors.torch import load_file
from trainer_support import make_train_batch

from rlbus.configs.trainer import LoRAConfig, TrainerConfig, TrainerModelConfig
from rlbus_trainer.ckpt import load_checkpoint, save_checkpoint
from rlbus_trainer.engine import build_engine, load_model, setup_distributed
from rlbus_trainer.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_state_dict,
    apply_lora,
    merged_state_dict,
    write_adapter_dir,
)
from rlbus_trainer.loss import build_loss_fn

IDS = torch.tensor([[1, 5, 9, 2, 7, 3]])


def logits(model) -> torch.Tensor:
    positions = torch.arange(IDS.shape[1])[None]
    mask = torch.ones(1, 1, IDS.shape[1], IDS.shape[1], dtype=torch.bool).tril()
    with torch.no_grad():
        return model(input_ids=IDS, position_ids=positions, attention_mask=mask).logits


def load(tiny_model, impl: str):
    return load_model(TrainerModelConfig(name=str(tiny_model), impl=impl), torch.device("cpu"))


def randomize_adapters(model, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)


@pytest.mark.parametrize("impl", ["rlbus", "transformers"])
def test_lora_model_starts_as_the_base_model(tiny_model, impl):
    model = load(tiny_model, impl)
    before = logits(model)
    names = apply_lora(model, LoRAConfig())
    assert len(names) == 7 * model.config.num_hidden_layers
    torch.testing.assert_close(logits(model), before, rtol=0, atol=0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)


@pytest.mark.parametrize("impl", ["rlbus", "transformers"])
def test_merged_weights_reproduce_the_lora_forward(tiny_model, impl):
    config = LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj", "o_proj", "down_proj"])
    model = load(tiny_model, impl)
    base = logits(model)
    apply_lora(model, config)
    randomize_adapters(model)
    adapted = logits(model)
    assert (adapted - base).abs().max() > 1e-3  # the adapters do change the output
    merged = load(tiny_model, impl)
    merged.load_state_dict(merged_state_dict(model.state_dict(), config))
    torch.testing.assert_close(logits(merged), adapted, rtol=1e-4, atol=1e-5)


def test_lora_step_changes_only_adapter_parameters(tiny_model):
    config = TrainerConfig(
        model={"name": str(tiny_model)},
        optim={"type": "adamw", "lr": 1e-2},
        lora={"rank": 4, "alpha": 8.0},
    )
    engine = build_engine(config, setup_distributed())
    optimized = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    adapters = {n: p for n, p in engine.model.named_parameters() if ".lora_" in n}
    assert optimized == {id(p) for p in adapters.values()}
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    micro_batches = make_train_batch(1, num_sequences=4).micro_batches[0]
    for _ in range(2):  # B = 0 at init: A's gradient is zero until B has moved once
        engine.train_step(micro_batches, build_loss_fn(config.loss))
    for name, param in engine.model.named_parameters():
        if name in adapters:
            assert not torch.equal(param, before[name]), f"{name} did not train"
        else:
            assert torch.equal(param, before[name]), f"{name} changed"


def test_lora_checkpoint_resumes_to_the_same_weights(tiny_model, tmp_path):
    config = TrainerConfig(
        model={"name": str(tiny_model)}, optim={"type": "adamw", "lr": 1e-2}, lora={"rank": 4}
    )
    micro_batches = make_train_batch(1, num_sequences=4).micro_batches[0]
    loss_fn = build_loss_fn(config.loss)
    straight = build_engine(config, setup_distributed())
    for _ in range(2):
        straight.train_step(micro_batches, loss_fn)
    save_checkpoint(straight, tmp_path, 2, progress={})
    straight.train_step(micro_batches, loss_fn)
    resumed = build_engine(config, setup_distributed())
    load_checkpoint(resumed, tmp_path, 2)
    resumed.train_step(micro_batches, loss_fn)  # needs the adapters' Adam state to match
    expected = dict(straight.model.named_parameters())
    for name, param in resumed.model.named_parameters():
        torch.testing.assert_close(param, expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_adapter_dir_is_peft_format(tiny_model, tmp_path):
    config = LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    model = load(tiny_model, "rlbus")
    apply_lora(model, config)
    tensors = adapter_state_dict(model.state_dict())
    out = write_adapter_dir(tensors, config, str(tiny_model), tmp_path / "step_1")
    assert sorted(p.name for p in out.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    written = load_file(str(out / ADAPTER_WEIGHTS))
    num_layers = model.config.num_hidden_layers
    assert len(written) == 2 * 2 * num_layers
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert written[key].shape == (4, model.config.hidden_size)
    meta = json.loads((out / ADAPTER_CONFIG).read_text())
    assert meta["peft_type"] == "LORA" and meta["r"] == 4 and meta["lora_alpha"] == 8.0
    assert meta["target_modules"] == ["q_proj", "v_proj"]
    assert meta["base_model_name_or_path"] == str(tiny_model)


def test_unknown_target_modules_are_refused(tiny_model):
    with pytest.raises(ValueError, match="matches no Linear"):
        apply_lora(load(tiny_model, "rlbus"), LoRAConfig(target_modules=["qkv"]))
