"""Weights written tensor by tensor (`rlbus_trainer.safetensors_stream`): files that safetensors
loads, checksums computed while writing that match the files, the Hugging Face index, bounded
shards, and no ready directory after a failure half-way."""

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlbus.broadcast import TensorSpec
from rlbus.checksums import sha256_file, verify_files
from rlbus_trainer.safetensors_stream import write_hf_dir_streamed, write_weights


def make_state() -> dict[str, torch.Tensor]:
    """Mixed dtypes, a scalar and an empty tensor, names out of alphabetical order."""
    torch.manual_seed(0)
    return {
        "z.weight": torch.randn(16, 8),
        "a.bias": torch.randn(8).bfloat16(),
        "m.half": torch.randn(3, 5).half(),
        "scale": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "ids": torch.arange(6, dtype=torch.int64),
        "big": torch.randn(200),
    }


def specs_of(state: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec.of(n, t) for n, t in state.items()]


def stream(state: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    yield from state.items()


def read_dir(out: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_streamed_shards_load_with_safetensors_and_are_indexed(tmp_path):
    state = make_state()
    files = write_weights(specs_of(state), stream(state), tmp_path, max_shard_bytes=600)
    read = read_dir(tmp_path)
    assert read.keys() == state.keys()
    for name, tensor in state.items():
        assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor), name
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    names = [f.name for f in files]
    assert len(names) > 1 and names[0] == f"model-00001-of-{len(names):05d}.safetensors"
    assert set(index["weight_map"].values()) == set(names)
    assert all(name in load_file(tmp_path / f) for name, f in index["weight_map"].items())
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert index["metadata"]["total_size"] == total


def test_each_shard_holds_at_most_the_limit_unless_one_tensor_is_bigger(tmp_path):
    state = make_state()
    write_weights(specs_of(state), stream(state), tmp_path, max_shard_bytes=600)
    for file in tmp_path.glob("*.safetensors"):
        tensors = load_file(file)
        num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        assert num_bytes <= 600 or len(tensors) == 1, (file.name, num_bytes)
    # in arrival order: z.weight (512 B) + a.bias + m.half + scale + empty make 562 B, ids
    # would make 610; big (800 B) alone
    shards = [list(load_file(f)) for f in sorted(tmp_path.glob("*.safetensors"))]
    assert [sorted(s) for s in shards] == [
        sorted(["z.weight", "a.bias", "m.half", "scale", "empty"]),
        ["ids"],
        ["big"],
    ]


def test_checksums_computed_while_writing_are_the_files_sha256(tiny_model, tmp_path):
    state = load_file(tiny_model / "model.safetensors")
    out = tmp_path / "step_1"
    files = write_hf_dir_streamed(
        specs_of(state), stream(state), str(tiny_model), out, max_shard_bytes=100_000
    )
    assert sorted(f.name for f in files) == sorted(p.name for p in out.iterdir())
    assert any(f.name.startswith("model-00001-of-") for f in files)
    for f in files:
        assert f.sha256 == sha256_file(out / f.name) and f.size == (out / f.name).stat().st_size
    verify_files(out, {f.name: f.sha256 for f in files})
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    read = read_dir(out)
    assert read.keys() == state.keys()
    assert all(torch.equal(read[k], state[k]) for k in state)


def test_one_file_when_the_weights_fit_and_no_index(tmp_path):
    state = make_state()
    files = write_weights(specs_of(state), stream(state), tmp_path, max_shard_bytes=10**9)
    assert [f.name for f in files] == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()
    assert load_file(tmp_path / "model.safetensors").keys() == state.keys()


def test_a_failure_half_way_leaves_no_ready_directory(tiny_model, tmp_path):
    state = load_file(tiny_model / "model.safetensors")

    def failing() -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(state.items()):
            if i == len(state) // 2:
                raise OSError("disk full")
            yield item

    out = tmp_path / "step_2"
    with pytest.raises(OSError, match="disk full"):
        write_hf_dir_streamed(
            specs_of(state), failing(), str(tiny_model), out, max_shard_bytes=100_000
        )
    assert not out.exists()  # only the dot-named temp directory, which nothing serves
    assert [p.name for p in tmp_path.iterdir()] == [".step_2.tmp"]
