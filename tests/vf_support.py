"""The verifiers 0.4 venv the `vf:` tests run their environment server in: the one place the
test suite builds it (tests/conftest.py puts this folder on sys.path).

The venv is made by `rl env install environments/reverse_text_v1` (verifiers==0.4.0 from PyPI,
the package editable) into the environment directory `$RLBUS_TEST_CACHE/envs` (default
`/tmp/rlbus-test-cache/envs`), once, and reused: `<that>/reverse-text-v1/bin/python`, recorded
in `<that>/index.json`. A lock keeps test processes running side by side from building it twice.
"""

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VF_ENV_ID = "reverse-text-v1"
VF_PACKAGE = REPO / "environments" / "reverse_text_v1"


def vf_env_dir() -> Path:
    """The environment directory (venvs and index) the tests share."""
    return Path(os.environ.get("RLBUS_TEST_CACHE", "/tmp/rlbus-test-cache")) / "envs"


def find_uv() -> str:
    return os.environ.get("UV") or shutil.which("uv") or str(REPO / ".uv" / "bin" / "uv")


def rl_env_install(directory: Path, package: Path = VF_PACKAGE) -> subprocess.CompletedProcess:
    """`rl env install <package> --venv-dir <directory>` (default environments/reverse_text_v1),
    output captured."""
    return subprocess.run(
        [sys.executable, "-m", "rlbus_launch.envinstall", "install", str(package)]
        + ["--venv-dir", str(directory)],
        capture_output=True,
        text=True,
        env={**os.environ, "UV": find_uv()},
    )


def make_vf_venv() -> Path:
    """The env venv's python (installed once; needs PyPI the first time)."""
    directory = vf_env_dir()
    directory.mkdir(parents=True, exist_ok=True)
    done = directory / f"{VF_ENV_ID}.ok"
    with open(directory / ".tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            result = rl_env_install(directory)
            assert result.returncode == 0, result.stdout + result.stderr
            done.touch()
    return directory / VF_ENV_ID / "bin" / "python"
