"""`rlbus.checksums`: the sha256 that filesystem weight broadcasts publish and inference verifies."""

import hashlib
from pathlib import Path

import pytest

from rlbus.checksums import ChecksumMismatch, sha256_bytes, verify_files, weight_files


def make_weights_dir(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    weights = tmp_path / "step_1"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"tensor bytes" * 200_000)  # > one 1 MiB chunk
    (weights / "config.json").write_text("{}")
    (weights / "nested").mkdir()  # not a file of the version
    return weights, {f.name: f.sha256 for f in weight_files(weights)}


def test_weight_files_name_size_and_hash_every_file(tmp_path):
    weights, _ = make_weights_dir(tmp_path)
    files = weight_files(weights)
    assert [f.name for f in files] == ["config.json", "model.safetensors"]
    model = (weights / "model.safetensors").read_bytes()
    assert files[1].size == len(model)
    assert files[1].sha256 == hashlib.sha256(model).hexdigest() == sha256_bytes(model)


def test_verify_files_accepts_matching_checksums(tmp_path):
    weights, expected = make_weights_dir(tmp_path)
    verify_files(weights, expected)


def test_verify_files_refuses_a_changed_file(tmp_path):
    weights, expected = make_weights_dir(tmp_path)
    with open(weights / "model.safetensors", "r+b") as f:
        f.write(b"X")
    with pytest.raises(ChecksumMismatch, match="model.safetensors"):
        verify_files(weights, expected)


def test_verify_files_refuses_a_missing_file(tmp_path):
    weights, expected = make_weights_dir(tmp_path)
    (weights / "config.json").unlink()
    with pytest.raises(ChecksumMismatch, match="missing"):
        verify_files(weights, expected)
