"""Writing HF model directories (safetensors + config + tokenizer) that vLLM and transformers load.

Used for weight broadcasts (`<run_dir>/broadcasts/step_N/`) and the final SFT model
(`<run_dir>/model/`). Writes go to a temp directory next to the target, every file is fsynced,
then the directory is renamed into place, so a reader never sees a half-written version.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

if TYPE_CHECKING:  # only names for annotations: the import itself is deferred (see below)
    from transformers import GenerationConfig, PreTrainedConfig, PreTrainedTokenizerBase

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
"""A sharded checkpoint's map of tensor names to shard files."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt", ".gguf")
WEIGHT_INDEX_SUFFIX = ".index.json"


def local_model_dir(name: str) -> Path | None:
    """The directory holding model `name`'s files: `name` itself when it is a directory, else its
    snapshot in the local HF cache; None when neither has its config.json."""
    path = Path(name)
    if path.is_dir():
        return path if (path / "config.json").is_file() else None
    try:
        # deferred: importing it costs ~0.13 s, and only a model named by hub id needs it
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json")
    except Exception:  # not a repo id either (HFValidationError): transformers says why
        return None
    return Path(cached).parent if isinstance(cached, str) else None


def is_weights_file(name: str) -> bool:
    """A file of weights (or a sharded checkpoint's index): what `source_files` leaves out."""
    return name.endswith(WEIGHT_SUFFIXES) or name.endswith(WEIGHT_INDEX_SUFFIX)


def source_files(model_dir: Path) -> list[Path]:
    """The files of a model directory besides its weights (config, generation config,
    tokenizer, chat template, remote code): copied as they are into every written directory."""
    return sorted(p for p in model_dir.iterdir() if p.is_file() and not is_weights_file(p.name))


@lru_cache(maxsize=4)
def _loaded_source_files(
    model_name: str, trust_remote_code: bool
) -> tuple[PreTrainedConfig, PreTrainedTokenizerBase, GenerationConfig | None]:
    """Config, generation config and tokenizer of a model that is not on local disk (loaded
    once per process through transformers, which fetches them)."""
    # transformers only here: a local model is written without it (its import costs seconds)
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(model_name, trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(model_name, trust_remote_code=trust_remote_code)
    try:
        generation = GenerationConfig.from_pretrained(model_name)
    except OSError:
        generation = None
    return config, tokenizer, generation


def write_source_files(model_name: str, trust_remote_code: bool, out_dir: Path) -> bool:
    """The model's non-weight files into out_dir; whether its lm_head is tied to the embeddings.
    A local model's files are copied (no transformers import); others come through transformers."""
    model_dir = local_model_dir(model_name)
    # (a cache snapshot may hold the config without the tokenizer)
    if model_dir is not None and any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        for file in source_files(model_dir):
            shutil.copyfile(file, out_dir / file.name)
        config = json.loads((model_dir / "config.json").read_text())
        return bool(config.get("tie_word_embeddings", False))
    config, tokenizer, generation = _loaded_source_files(model_name, trust_remote_code)
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if generation is not None:
        generation.save_pretrained(out_dir)
    return bool(getattr(config, "tie_word_embeddings", False))


TIED_HEAD = "lm_head.weight"
"""The output projection that a model with `tie_word_embeddings` shares with its embeddings."""


def is_hf_tensor(name: str, tie_word_embeddings: bool) -> bool:
    """Whether a state-dict entry goes into an HF checkpoint (what vLLM's loaders accept): all but
    a tied `lm_head.weight`, which the checkpoint does not repeat."""
    return not (tie_word_embeddings and name == TIED_HEAD)


def hf_tensors(
    state_dict: dict[str, torch.Tensor], tie_word_embeddings: bool
) -> dict[str, torch.Tensor]:
    """The HF checkpoint's tensors (`is_hf_tensor`), contiguous and on the CPU."""
    return {
        name: t.detach().to("cpu").contiguous()
        for name, t in state_dict.items()
        if is_hf_tensor(name, tie_word_embeddings)
    }


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Names (with their byte sizes) grouped, in the order given, into files of at most
    `max_shard_bytes` each; a tensor larger than that gets a file of its own."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def shard_plan(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """`plan_shards` of a state dict, in name order."""
    sizes = [(n, tensors[n].numel() * tensors[n].element_size()) for n in sorted(tensors)]
    return plan_shards(sizes, max_shard_bytes)


def shard_names(num_shards: int) -> list[str]:
    """The weights files of a checkpoint in `num_shards` files: `model.safetensors` alone, else
    `model-0000i-of-0000N.safetensors` (the Hugging Face layout, which transformers and vLLM
    read, with `WEIGHTS_INDEX`)."""
    if num_shards == 1:
        return [WEIGHTS_FILE]
    return [f"model-{i:05d}-of-{num_shards:05d}.safetensors" for i in range(1, num_shards + 1)]


def write_index(out_dir: Path, weight_map: dict[str, str], total_size: int) -> Path:
    """`model.safetensors.index.json`: tensor name -> shard file, and the tensors' total bytes."""
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (out_dir / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
    return out_dir / WEIGHTS_INDEX


def save_weights(
    tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int | None
) -> list[Path]:
    """`model.safetensors`, or, when the weights exceed `max_shard_bytes`, shards and their
    index (`shard_names`)."""
    shards = [sorted(tensors)] if max_shard_bytes is None else shard_plan(tensors, max_shard_bytes)
    files, weight_map = [], {}
    for file_name, names in zip(shard_names(len(shards)), shards, strict=True):
        save_file({n: tensors[n] for n in names}, out_dir / file_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file_name))
        files.append(out_dir / file_name)
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        write_index(out_dir, weight_map, total)
    return files


GENERATION_CONFIG = "generation_config.json"
GENERATION_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def ensure_generation_config(out_dir: Path) -> None:
    """A `generation_config.json` when the model came without one: its special tokens, from its
    config.json (what `generate` and vLLM read for the stop tokens)."""
    if (out_dir / GENERATION_CONFIG).exists():
        return
    config = json.loads((out_dir / "config.json").read_text())
    generation = {k: config[k] for k in GENERATION_KEYS if config.get(k) is not None}
    (out_dir / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2))


@contextlib.contextmanager
def atomic_dir(out_dir: Path) -> Iterator[Path]:
    """A temp directory next to `out_dir` to write into; on success every file in it is fsynced
    and it is renamed to `out_dir` (replacing it), so a reader never sees a half-written version.
    On an error the temp directory stays (the next write replaces it; pruning skips dot names)."""
    out_dir = Path(out_dir)
    tmp = out_dir.parent / f".{out_dir.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    yield tmp
    for file in tmp.iterdir():
        with open(file, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)
    _fsync_dir(out_dir.parent)


def write_hf_dir(
    state_dict: dict[str, torch.Tensor],
    model_name: str,
    out_dir: Path,
    *,
    trust_remote_code: bool = False,
    max_shard_bytes: int | None = None,
) -> Path:
    """Atomically write `state_dict` as an HF model directory at out_dir (replacing it): the
    source model's config, generation config and tokenizer, and the weights in one file or, with
    `max_shard_bytes`, in shards of at most that size."""
    with atomic_dir(out_dir) as tmp:
        tied = write_source_files(model_name, trust_remote_code, tmp)
        ensure_generation_config(tmp)
        save_weights(hf_tensors(state_dict, tied), tmp, max_shard_bytes)
    return Path(out_dir)
