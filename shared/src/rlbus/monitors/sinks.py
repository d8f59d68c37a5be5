"""Where joined step rows go."""

import json
import os
from pathlib import Path
from typing import Any

from rlbus.configs.common import WandbMonitorConfig


class JsonlSink:
    """Appends one JSON object per step to a file, flushed to disk row by row."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row, sort_keys=True) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


class WandbSink:
    """Logs rows to wandb under the run's name (offline mode writes into the run directory)."""

    def __init__(self, config: WandbMonitorConfig, run_name: str, run_dir: Path, run_config: dict):
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError(
                "monitors.wandb is enabled but wandb is not installed: `uv pip install wandb` "
                "(or `uv sync --group wandb`), or drop --monitors.wandb"
            ) from exc
        self._run = wandb.init(
            project=config.project,
            entity=config.entity,
            name=run_name,
            id=run_name,
            resume="allow",
            dir=str(run_dir),
            tags=config.tags,
            mode="offline" if config.offline else "online",
            config=run_config,
        )

    def write(self, row: dict[str, Any]) -> None:
        values = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        self._run.log(values, step=row["step"])

    def close(self) -> None:
        self._run.finish()
