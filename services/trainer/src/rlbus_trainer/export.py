"""Models out of a run: the trainer's weights as a directory that transformers and vLLM load.

- Full fine-tuning (or a LoRA run with `merged`): a Hugging Face model directory (config,
  generation config, tokenizer and chat template from `model.name`; safetensors weights, in
  shards of at most `export.max_shard_size`, with adapters folded in).
- A LoRA run without `merged`: a PEFT adapter directory (adapter_config.json naming `model.name`
  as its base, adapter_model.safetensors) plus the base's tokenizer files, which vLLM serves with
  `--enable-lora` and peft loads over the base model.

`export_final` writes `<run_dir>/model/` when a run reaches `max_steps` (the RL trainer in
service.stop_trainer, SFT at its end); `export_checkpoint.py` (`rl export`) writes any
checkpoint. docs/export.md.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import structlog
import torch
import torch.distributed as dist

from rlbus.configs import TrainerConfig
from rlbus.rundirs import FINAL_MODEL_DIR
from rlbus_trainer.engine import Engine, World
from rlbus_trainer.hf_dir import TOKENIZER_FILES, local_model_dir, source_files, write_hf_dir
from rlbus_trainer.lora import (
    ADAPTER_CONFIG,
    adapter_state_dict,
    merged_state_dict,
    write_adapter_dir,
)

log = structlog.get_logger()


def write_model(
    state: dict[str, torch.Tensor], config: TrainerConfig, out: Path, *, merged: bool
) -> Path:
    """Write a full state dict of the trainer's model to `out` (see the module docstring)."""
    if config.lora is not None and not merged:
        out = write_adapter_dir(adapter_state_dict(state), config.lora, config.model.name, out)
        copy_tokenizer(config.model.name, out)
        return out
    if config.lora is not None:
        state = merged_state_dict(state, config.lora)
    return write_hf_dir(
        state,
        config.model.name,
        out,
        trust_remote_code=config.model.trust_remote_code,
        max_shard_bytes=int(config.export.max_shard_size),
    )


def copy_tokenizer(model_name: str, out: Path) -> None:
    """The base model's tokenizer and chat template beside an adapter (where the base is a local
    directory), so the adapter directory alone renders chats as the run did."""
    model_dir = local_model_dir(model_name)
    if model_dir is None:
        return
    for file in source_files(model_dir):
        if file.name in TOKENIZER_FILES or "tokenizer" in file.name or "chat_template" in file.name:
            shutil.copyfile(file, out / file.name)


def export_final(engine: Engine, config: TrainerConfig, run_dir: Path, world: World) -> Path | None:
    """`<run_dir>/model/` from the engine's weights, written by rank 0 (returned there; None
    elsewhere). Collective: every rank calls it."""
    state = engine.full_state_dict()
    out = None
    if world.is_main:
        out = write_model(state, config, run_dir / FINAL_MODEL_DIR, merged=config.export.merge_lora)
        log.info("final_model_written", path=str(out), lora_adapter=is_adapter_dir(out))
    if dist.is_initialized():
        dist.barrier()
    return out


def is_adapter_dir(path: Path) -> bool:
    """Whether an exported directory is a LoRA adapter (not a whole model)."""
    return (path / ADAPTER_CONFIG).is_file()
