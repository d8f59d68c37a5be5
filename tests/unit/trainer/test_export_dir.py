"""Exported model directories: shards with their index, a generation config, LoRA adapter or
merged weights (the e2e export tests load them in transformers and vLLM)."""

import json

import torch
from safetensors.torch import load_file

from rlbus.configs import TrainerConfig
from rlbus_trainer.export import is_adapter_dir, write_model
from rlbus_trainer.hf_dir import shard_plan, write_hf_dir


def tensors(*sizes: int) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((n,), float(i)) for i, n in enumerate(sizes)}  # float32: 4 B each


def test_shard_plan_fills_each_shard_up_to_the_limit_and_gives_a_big_tensor_its_own():
    assert shard_plan(tensors(10, 10, 10), 80) == [["w0", "w1"], ["w2"]]
    assert shard_plan(tensors(5, 100, 5), 80) == [["w0"], ["w1"], ["w2"]]
    assert shard_plan(tensors(10, 10), 10_000) == [["w0", "w1"]]


def test_a_sharded_directory_indexes_every_tensor_once(tiny_model, tmp_path):
    state = load_file(tiny_model / "model.safetensors")
    out = write_hf_dir(state, str(tiny_model), tmp_path / "m", max_shard_bytes=200_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    read = {k: v for f in files for k, v in load_file(out / f).items()}
    assert read.keys() == index["weight_map"].keys()
    assert all(torch.equal(read[k], state[k]) for k in read)
    assert not (out / "model.safetensors").exists()
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in read.values())


def test_a_model_without_generation_config_gets_one_from_its_special_tokens(tiny_model, tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for f in tiny_model.iterdir():
        if f.name != "generation_config.json":
            (source / f.name).write_bytes(f.read_bytes())
    out = write_hf_dir(load_file(source / "model.safetensors"), str(source), tmp_path / "m")
    config = json.loads((source / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]


def test_a_lora_state_exports_as_adapter_or_folded_into_the_weights(tiny_model, tmp_path):
    config = TrainerConfig.model_validate(
        {
            "model": {"name": str(tiny_model)},
            "lora": {"rank": 2, "alpha": 4, "target_modules": ["q_proj"]},
        }
    )
    state = load_file(tiny_model / "model.safetensors")
    weight = next(k for k in state if k.endswith("q_proj.weight"))
    module = weight.removesuffix(".weight")
    out_features, in_features = state[weight].shape
    a, b = torch.ones(2, in_features), torch.full((out_features, 2), 0.5)
    state |= {f"{module}.lora_A.weight": a, f"{module}.lora_B.weight": b}

    adapter = write_model(state, config, tmp_path / "adapter", merged=False)
    assert is_adapter_dir(adapter) and (adapter / "tokenizer.json").exists()
    saved = load_file(adapter / "adapter_model.safetensors")
    assert len(saved) == 2 and all(".lora_" in k for k in saved)

    merged = write_model(state, config, tmp_path / "merged", merged=True)
    folded = load_file(merged / "model.safetensors")[weight]
    # W + alpha / rank * B @ A: every entry of B @ A is 0.5 * 2 = 1.0, times 4 / 2
    torch.testing.assert_close(folded, state[weight] + 2.0)
    assert not is_adapter_dir(merged)
