"""The real wandb package, offline, in tests: an environment that cannot reach the network or
need a login, and what a run wrote, read back from its `.wandb` log.

wandb 0.31 no longer ships a Python reader for `.wandb` files (`wandb.sdk.internal.datastore` is
gone); `wandb leet inspect --json` prints the log's records, one JSON object a line.
"""

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

INSPECT_TIMEOUT_S = 30


def use_offline_wandb(monkeypatch, tmp_path: Path) -> None:
    """Environment for wandb in this test and the processes it starts: no API key, wandb's own
    files under `tmp_path`, nothing slow or chatty. WANDB_MODE is unset, so that the code under
    test picks the mode; a stray online call goes to a closed local port and fails, it never
    reaches the internet."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    home = tmp_path / "wandb-home"
    env = {
        "WANDB_BASE_URL": "http://127.0.0.1:9",
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
        "WANDB_ARTIFACT_DIR": str(home / "artifacts"),
        "WANDB_SILENT": "true",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_X_DISABLE_STATS": "true",
        "WANDB_INIT_TIMEOUT": "30",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@dataclass
class OfflineRun:
    """What one offline run directory (`<run_dir>/wandb/offline-run-*`) holds."""

    path: Path
    run: dict
    """The `run` record: run_id, display_name, project, run_group, tags, config."""
    history: dict[int, dict]
    """step -> the logged values (wandb's own `_runtime`, `_step`, `_timestamp` left out)."""
    exit_code: int | None
    """From the `exit` record that `finish()` writes; None: the run was not finished."""

    @property
    def config(self) -> dict:
        return self.run["config"]["update"]


def offline_runs(run_dir: Path) -> list[OfflineRun]:
    """Every offline wandb run under `run_dir`, oldest first (one per `wandb.init`)."""
    paths = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    return [read_offline_run(path) for path in paths]


def read_offline_run(path: Path) -> OfflineRun:
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=INSPECT_TIMEOUT_S,
        check=True,
    ).stdout
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    history = {}
    for record in records:
        if record["type"] == "history":
            item = record["history"]["item"]
            history[int(record["history"]["step"].get("num", 0))] = {
                k: v for k, v in item.items() if not k.startswith("_")
            }
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    exits = [r["exit"].get("exit_code", 0) for r in records if r["type"] == "exit"]
    return OfflineRun(path, run, history, exits[-1] if exits else None)
