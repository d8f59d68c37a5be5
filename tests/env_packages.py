"""Environment packages under `environments/` installed into the test venv, the way users
install them (`uv pip install -e environments/<name>`, docs/environments.md): the one place the
test suite does it (tests/conftest.py puts this folder on sys.path)."""

import fcntl
import importlib
import importlib.util
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_installed: set[str] = set()


def install_env_package(name: str | Path) -> None:
    """`uv pip install -e environments/<name>` (or the package folder `name`) into this
    interpreter's venv, once per process (a file lock keeps parallel test workers from
    installing at the same time). Afterwards the package imports in this process too: an editable
    install is a `.pth` file, which a running interpreter reads only when site-packages is added
    again."""
    if str(name) in _installed:
        return
    path = name if isinstance(name, Path) else REPO / "environments" / name
    assert (path / "pyproject.toml").exists(), f"no environment package at {path}"
    uv = os.environ.get("UV") or shutil.which("uv") or str(REPO / ".uv" / "bin" / "uv")
    lock_path = (
        Path(os.environ.get("RLBUS_TEST_CACHE", "/tmp/rlbus-test-cache")) / "env-install.lock"
    )
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run(
            [uv, "pip", "install", "-q", "--python", sys.executable, "-e", str(path)], check=True
        )
    site.addsitedir(sysconfig.get_paths()["purelib"])
    importlib.invalidate_caches()
    _installed.add(str(name))


def ensure_env_package(module: str, folder: str) -> None:
    """Install `environments/<folder>` unless this checkout's copy of `module` already imports
    (then the install would only cost seconds per test worker)."""
    spec = importlib.util.find_spec(module)
    here = REPO / "environments" / folder
    if spec is None or spec.origin is None or not Path(spec.origin).is_relative_to(here):
        install_env_package(folder)
