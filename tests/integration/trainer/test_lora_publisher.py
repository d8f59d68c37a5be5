"""The LoRA publisher against a real nats-server: a PEFT adapter directory with checksums,
announced with `lora_name`, chosen by `build_weight_publisher` whenever `trainer.lora` is set."""

from types import SimpleNamespace

import torch

from rlbus.checksums import sha256_file
from rlbus.configs.trainer import TrainerConfig
from rlbus.wire import weights
from rlbus.wire.subjects import WEIGHTS_LATEST_KEY
from rlbus_trainer.engine import World
from rlbus_trainer.weights import LoraWeightPublisher, build_weight_publisher


def make_engine(state: dict[str, torch.Tensor]):
    return SimpleNamespace(full_state_dict=lambda: state)


async def test_lora_publisher_announces_a_peft_adapter_dir(bus, tmp_path):
    config = TrainerConfig(
        model={"name": "some/base"},
        lora={"rank": 2, "target_modules": ["q_proj"]},
        weight_broadcast={"type": "nccl"},  # LoRA goes through the filesystem whatever this says
    )
    world = World(0, 1, torch.device("cpu"))
    publisher = build_weight_publisher(config, bus=bus, run_dir=tmp_path, world=world)
    assert isinstance(publisher, LoraWeightPublisher)
    prefix = "model.layers.0.self_attn.q_proj"
    state = {
        f"{prefix}.weight": torch.randn(8, 8),
        f"{prefix}.lora_A.weight": torch.randn(2, 8),
        f"{prefix}.lora_B.weight": torch.randn(8, 2),
        "model.embed_tokens.weight": torch.randn(16, 8),
    }
    metrics = await publisher.publish(3, make_engine(state))
    entry = await bus.kv(bus.subjects.weights_bucket).get(
        WEIGHTS_LATEST_KEY, weights.published_decoder
    )
    published = entry.value
    assert published.version == 3 and published.lora_name == "policy"
    assert published.transport == "filesystem"
    out = tmp_path / "broadcasts" / "step_3"
    assert published.location == str(out.resolve())
    names = {f.name: f for f in published.files}
    assert sorted(names) == ["adapter_config.json", "adapter_model.safetensors"]
    for name, record in names.items():
        assert record.sha256 == sha256_file(out / name)
    assert metrics["publish_bytes"] == sum(f.size for f in published.files)
    assert metrics["publish_bytes"] < 4 * (2 * 8 + 8 * 2) + 4096  # adapters + header + config
