"""The verifiers 0.4 venv the `vf:` tests run their environment server in: the one place the
test suite builds it (tests/conftest.py puts this folder on sys.path).

The venv (verifiers==0.4.0 from PyPI + the repo's `environments/reverse_text_v1`, editable) is
built once under `$RLBUS_TEST_CACHE` (default `/tmp/rlbus-test-cache`) and reused.
"""

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def make_vf_venv() -> Path:
    """The env venv's python (created once; needs PyPI the first time)."""
    venv = Path(os.environ.get("RLBUS_TEST_CACHE", "/tmp/rlbus-test-cache")) / "vf04-reverse-text"
    python = venv / "bin" / "python"
    if not (venv / "ok").exists():
        uv = os.environ.get("UV") or shutil.which("uv") or str(REPO / ".uv" / "bin" / "uv")
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([uv, "venv", "-q", "-p", "3.11", str(venv)], check=True)
        subprocess.run(
            [uv, "pip", "install", "-q", "--python", str(python), "verifiers==0.4.0"]
            + ["-e", str(REPO / "environments" / "reverse_text_v1")],
            check=True,
        )
        (venv / "ok").touch()
    return python
