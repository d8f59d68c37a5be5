"""`loss.ref_kl_coef`: the reference model is the initial weights (a frozen copy under full
fine-tuning, the base model with adapters off under LoRA); its KL to the trained model starts at
0, grows as the model moves, and the penalty holds it closer."""

import pytest
import torch
from trainer_support import make_train_batch

from rlbus.configs.trainer import TrainerConfig
from rlbus_trainer.attention import block_causal_mask
from rlbus_trainer.engine import World, build_engine, build_reference, setup_distributed
from rlbus_trainer.lora import adapters_disabled
from rlbus_trainer.loss import build_loss_fn


def make_config(tiny_model, **overrides) -> TrainerConfig:
    return TrainerConfig(
        model={"name": str(tiny_model)},
        optim={"type": "adamw", "lr": 1e-2, "weight_decay": 0.0},
        **overrides,
    )


def ref_kls(config: TrainerConfig, num_steps: int) -> tuple[list[float], object]:
    engine = build_engine(config, setup_distributed())
    micro_batches = make_train_batch(1, num_sequences=4).micro_batches[0]
    loss_fn = build_loss_fn(config.loss)
    kls = [engine.train_step(micro_batches, loss_fn).metrics["ref_kl"] for _ in range(num_steps)]
    return kls, engine


def test_full_fine_tuning_reference_is_a_frozen_copy_of_the_initial_weights(tiny_model):
    config = make_config(tiny_model, loss={"ref_kl_coef": 0.5})
    engine = build_engine(config, setup_distributed())
    initial = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    micro_batches = make_train_batch(1, num_sequences=4).micro_batches[0]
    loss_fn = build_loss_fn(config.loss)
    kls = [engine.train_step(micro_batches, loss_fn).metrics["ref_kl"] for _ in range(3)]
    assert kls[0] == 0  # same weights, same logits: every x = 0
    assert kls[1] > 0 and kls[2] > 0
    assert engine.reference is not None
    for name, param in engine.reference.named_parameters():
        assert not param.requires_grad
        assert torch.equal(param, initial[name]), name
    moved = dict(engine.model.named_parameters())
    assert any(not torch.equal(moved[n], initial[n]) for n in initial)


def test_reference_kl_penalty_keeps_the_model_closer_to_the_reference(tiny_model):
    # ref_kl is measured in every run; only the second one pays for it.
    free, _ = ref_kls(make_config(tiny_model, loss={"ref_kl_coef": 1e-9}), 5)
    held, _ = ref_kls(make_config(tiny_model, loss={"ref_kl_coef": 50.0}), 5)
    assert held[-1] < 0.5 * free[-1]


def test_lora_reference_is_the_base_model_with_adapters_off(tiny_model):
    config = make_config(tiny_model, loss={"ref_kl_coef": 0.5}, lora={"rank": 4})
    kls, engine = ref_kls(config, 3)
    assert engine.reference is None  # no copy kept
    assert kls[0] == 0 and 0 < kls[2]  # B = 0 at init: the adapted model starts as the base

    inputs = {
        "input_ids": torch.tensor([[5, 6, 7, 8]]),
        "position_ids": torch.arange(4)[None],
        "attention_mask": block_causal_mask([4]),
    }
    base = build_engine(make_config(tiny_model), setup_distributed()).model
    with torch.no_grad(), adapters_disabled(engine.model):
        off = engine.model(**inputs).logits
    with torch.no_grad():
        on = engine.model(**inputs).logits
        torch.testing.assert_close(off, base(**inputs).logits)
    assert (on - off).abs().max() > 1e-4  # and back on after the block


def test_offloaded_reference_stays_in_host_memory(tiny_model):
    config = make_config(tiny_model, loss={"ref_kl_coef": 0.5}, reference={"offload": True})
    kls, engine = ref_kls(config, 2)
    assert kls[0] == 0 and kls[1] > 0
    assert {p.device.type for p in engine.reference.parameters()} == {"cpu"}


def test_no_reference_without_a_kl_term(tiny_model):
    engine = build_engine(make_config(tiny_model), setup_distributed())
    assert engine.reference is None and not engine.use_reference


def test_offloaded_reference_on_several_ranks_is_refused(tiny_model):
    config = make_config(tiny_model, loss={"ref_kl_coef": 0.5}, reference={"offload": True})
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="trainer.reference.offload needs one trainer rank"):
        build_reference(config, World(0, 2, torch.device("cpu")), model)
