"""Helpers for tests that drive the real console scripts (`rl`, `sft`, `trainer`, ...)."""

import os
import subprocess
import sys
from pathlib import Path

import tomli

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]


def run_command(
    command: str, *args: str, cwd: Path, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run `command` (a console script of this venv) with `args`; never raises on failure."""
    full_env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", **(env or {})}
    return subprocess.run(
        [str(BIN / command), *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def resolved_config(command: str, *args: str, cwd: Path) -> dict:
    """The config `command args` resolves to, read back from `--print-config`."""
    result = run_command(command, *args, "--print-config", cwd=cwd)
    assert result.returncode == 0, result.stderr
    return tomli.loads(result.stdout)


def error_text(result: subprocess.CompletedProcess) -> str:
    """stderr with the box drawing and line wrapping flattened, for substring checks."""
    flat = result.stderr
    for char in "│╭╮╰╯─":
        flat = flat.replace(char, " ")
    return " ".join(flat.split())


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
