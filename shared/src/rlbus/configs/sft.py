"""SFT config (`sft` command): the trainer fed from local files instead of the bus."""

from typing import Literal

from pydantic import Field

from rlbus.configs.base import BaseConfig
from rlbus.configs.trainer import TrainerConfig


class SFTDataConfig(BaseConfig):
    """Supervised data in messages format."""

    path: str = "reverse-text"
    """JSONL/Parquet file, a `datasets` dataset saved to disk, or the built-in `reverse-text` generator."""

    loss_roles: list[str] = ["assistant"]
    """Roles whose turns carry loss."""

    batch_size: int = Field(32, ge=1)
    """Sequences per optimizer step (global)."""

    pack: bool = True
    """Pack sequences into rows of seq_len."""

    val_path: str | None = None
    """Validation data (same formats); validation loss every ckpt/eval interval."""

    val_interval: int = Field(50, ge=1)
    """Validation every N steps."""


class SFTConfig(TrainerConfig):
    """Supervised fine-tuning with the trainer's model, optimizer, checkpoints and offload."""

    data: SFTDataConfig = SFTDataConfig()
    """Training data."""

    num_processes: int = Field(1, ge=1)
    """Processes launched by torchrun (one per GPU; on CPU, gloo ranks)."""

    save_final_model: bool = True
    """Write an HF model directory `<run_dir>/model/` at the end."""

    kind: Literal["sft"] = "sft"
    """Fixed tag for run naming."""
