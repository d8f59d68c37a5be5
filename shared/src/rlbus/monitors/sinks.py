"""Where step rows go: the sinks of a `monitors` config (`rl`'s monitor process, `sft`'s rank 0)."""

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from rlbus.configs.common import MonitorsConfig, WandbMonitorConfig

WANDB_MISSING = (
    "monitors.wandb is enabled but wandb is not installed: `uv pip install wandb`, "
    "or drop --monitors.wandb"
)


class JsonlSink:
    """Appends one JSON object per step to a file, flushed to disk row by row.

    A torn last line (the writer was killed mid-row) is cut off on open, so the next row starts
    on a line of its own; that row's events were not acked, so it is written again whole."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        cut_torn_tail(path)
        self._file = open(path, "a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row, sort_keys=True) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def cut_torn_tail(path: Path) -> None:
    """Truncate `path` after its last newline (nothing to do for a missing or clean file)."""
    if not path.exists():
        return
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            f.truncate(end)


class WandbSink:
    """Logs rows to wandb under the run's name (offline mode writes into the run directory)."""

    def __init__(self, config: WandbMonitorConfig, run_name: str, run_dir: Path, run_config: dict):
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError(WANDB_MISSING) from exc
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


def check_sinks_installed(monitors: MonitorsConfig) -> None:
    """Called by the launchers before anything starts: an enabled sink whose package is missing
    is a config error naming the flag, not a traceback in a service's log later."""
    if monitors.wandb is not None and importlib.util.find_spec("wandb") is None:
        from rlbus.configs.base import exit_with_config_error

        exit_with_config_error(WANDB_MISSING)


def build_sinks(
    monitors: MonitorsConfig, run_name: str, run_dir: Path, run_config: dict[str, Any]
) -> list[JsonlSink | WandbSink]:
    """The sinks `monitors` enables; `run_config` is what wandb records as the run's config."""
    sinks: list[JsonlSink | WandbSink] = []
    if monitors.file is not None:
        sinks.append(JsonlSink(run_dir / monitors.file.path))
    if monitors.wandb is not None:
        sinks.append(WandbSink(monitors.wandb, run_name, run_dir, run_config))
    return sinks
