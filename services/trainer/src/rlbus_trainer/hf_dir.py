"""Writing HF model directories (safetensors + config + tokenizer) that vLLM and transformers load.

Used for weight broadcasts (`<run_dir>/broadcasts/step_N/`) and the final SFT model
(`<run_dir>/model/`). Writes go to a temp directory next to the target, every file is fsynced,
then the directory is renamed into place, so a reader never sees a half-written version.
"""

from __future__ import annotations

import os
import shutil
from functools import lru_cache
from pathlib import Path

import torch

WEIGHTS_FILE = "model.safetensors"


@lru_cache(maxsize=4)
def _source_files(model_name: str, trust_remote_code: bool):
    """Config, generation config and tokenizer of the source model (loaded once per process)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(model_name, trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(model_name, trust_remote_code=trust_remote_code)
    try:
        generation = GenerationConfig.from_pretrained(model_name)
    except OSError:
        generation = None
    return config, tokenizer, generation


def hf_tensors(
    state_dict: dict[str, torch.Tensor], tie_word_embeddings: bool
) -> dict[str, torch.Tensor]:
    """State-dict names as HF checkpoints spell them (what vLLM's loaders accept): a tied
    `lm_head.weight` is left out, tensors are contiguous and on the CPU."""
    return {
        name: t.detach().to("cpu").contiguous()
        for name, t in state_dict.items()
        if not (tie_word_embeddings and name == "lm_head.weight")
    }


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_hf_dir(
    state_dict: dict[str, torch.Tensor],
    model_name: str,
    out_dir: Path,
    *,
    trust_remote_code: bool = False,
) -> Path:
    """Atomically write `state_dict` as an HF model directory at out_dir (replacing it)."""
    from safetensors.torch import save_file

    config, tokenizer, generation = _source_files(model_name, trust_remote_code)
    out_dir = Path(out_dir)
    tmp = out_dir.parent / f".{out_dir.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    save_file(hf_tensors(state_dict, tied), tmp / WEIGHTS_FILE, metadata={"format": "pt"})
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if generation is not None:
        generation.save_pretrained(tmp)
    for file in tmp.iterdir():
        with open(file, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)
    _fsync_dir(out_dir.parent)
    return out_dir
