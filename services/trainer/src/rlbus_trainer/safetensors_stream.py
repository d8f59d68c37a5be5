"""Sharded safetensors written tensor by tensor, each file hashed while it is written.

The weight publisher feeds it the model's full tensors one at a time (`stream_state`), so the
writer never holds more than the tensor it is writing, and no file is read back to be hashed.
This works because a safetensors file puts everything but the data first, and the data layout
follows from the shapes and dtypes alone, which are known before any tensor is gathered:

    u64 (little-endian)  N, the header's byte length
    N bytes              JSON {"__metadata__": {"format": "pt"},
                               name: {"dtype": "BF16", "shape": [..], "data_offsets": [b, e]}, ..}
                         padded with spaces to a multiple of 8 (as safetensors pads it)
    the data             each tensor's raw little-endian bytes at [b, e) of this region, in the
                         order they arrive (offsets are contiguous, as readers require)

Shards: tensors fill files of at most `max_shard_bytes` in arrival order (`hf_dir.plan_shards`),
named and indexed as Hugging Face checkpoints are (`hf_dir.shard_names`, `write_index`); one
file needs no index. The directory is written atomically (`hf_dir.atomic_dir`).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from rlbus.broadcast import DTYPES, TensorSpec
from rlbus.checksums import weight_files
from rlbus.wire.weights import WeightFile
from rlbus_trainer.hf_dir import (
    atomic_dir,
    ensure_generation_config,
    plan_shards,
    shard_names,
    write_index,
    write_source_files,
)

SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
}
"""torch dtype -> safetensors' name, for the dtypes a weights version carries (`rlbus.broadcast`)."""


def shard_header(specs: list[TensorSpec]) -> bytes:
    """The length prefix and JSON header of a file holding `specs`, data in that order."""
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    begin = 0
    for spec in specs:
        end = begin + spec.num_bytes
        dtype = SAFETENSORS_DTYPES[DTYPES[spec.dtype]]
        entries[spec.name] = {
            "dtype": dtype,
            "shape": list(spec.shape),
            "data_offsets": [begin, end],
        }
        begin = end
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def write_shard(
    path: Path, specs: list[TensorSpec], tensors: Iterator[tuple[str, torch.Tensor]]
) -> WeightFile:
    """Write the next `len(specs)` tensors of `tensors` (in spec order) as one safetensors file;
    its name, size and sha256, computed from the bytes as they are written."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "wb") as f:
        for chunk in _file_chunks(specs, tensors):
            f.write(chunk)
            digest.update(chunk)
            size += len(chunk)
    return WeightFile(name=path.name, size=size, sha256=digest.hexdigest())


def _file_chunks(
    specs: list[TensorSpec], tensors: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[bytes | memoryview]:
    """The header, then each tensor's bytes (a view of its memory, not a copy)."""
    yield shard_header(specs)
    for spec in specs:
        name, tensor = next(tensors)
        # the walk and the specs come from the same state dict: a mismatch is a bug here
        assert name == spec.name and TensorSpec.of(name, tensor) == spec, (name, spec)
        yield tensor.reshape(-1).view(torch.uint8).numpy().data  # a memoryview, no copy


def write_weights(
    specs: list[TensorSpec],
    tensors: Iterator[tuple[str, torch.Tensor]],
    out_dir: Path,
    max_shard_bytes: int,
) -> list[WeightFile]:
    """The tensors announced by `specs`, arriving in that order, as shards of at most
    `max_shard_bytes` (plus the index when there are several); each shard's checksum."""
    by_name = {spec.name: spec for spec in specs}
    plan = plan_shards([(s.name, s.num_bytes) for s in specs], max_shard_bytes)
    files = []
    for file_name, names in zip(shard_names(len(plan)), plan, strict=True):
        files.append(write_shard(out_dir / file_name, [by_name[n] for n in names], tensors))
    if len(plan) > 1:
        weight_map = {
            n: f for f, names in zip(shard_names(len(plan)), plan, strict=True) for n in names
        }
        write_index(out_dir, weight_map, sum(s.num_bytes for s in specs))
    return files


def write_hf_dir_streamed(
    specs: list[TensorSpec],
    tensors: Iterator[tuple[str, torch.Tensor]],
    model_name: str,
    out_dir: Path,
    *,
    max_shard_bytes: int,
    trust_remote_code: bool = False,
) -> list[WeightFile]:
    """Atomically write an HF model directory at `out_dir` (the source model's config, generation
    config and tokenizer, and the streamed weights in shards); every file's name, size and
    sha256, sorted by name (the shards' hashed while written, the small rest afterwards)."""
    with atomic_dir(out_dir) as tmp:
        write_source_files(model_name, trust_remote_code, tmp)
        ensure_generation_config(tmp)
        shards = write_weights(specs, tensors, tmp, max_shard_bytes)
        files = weight_files(tmp, known={f.name: f for f in shards})
    return files
