"""Installed size of each service image's Python environment, measured outside a container.

Each deploy/Dockerfile target runs `uv sync --no-default-groups --package <member> [--group cpu]`;
this script runs the same sync into a fresh venv per target and prints the size of each venv
(site-packages and scripts: what the image adds on top of its base image).

    python benchmarks/image_sizes.py [REPO_DIR]        # default: this checkout
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

# target -> (workspace member, extra uv arguments); the same pairs as deploy/Dockerfile's stages.
TARGETS = {
    "launcher": ("rlbus-launch", []),
    "orchestrator": ("rlbus-orchestrator", []),
    "inference": ("rlbus-inference", ["--group", "cpu"]),
    "trainer": ("rlbus-trainer", ["--group", "cpu"]),
}


def tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = Path(dirpath, name)
            if not path.is_symlink():
                total += path.stat().st_size
    return total


def member_names(repo: Path) -> set[str]:
    text = (repo / "pyproject.toml").read_text()
    return {line.split('"')[1] for line in text.splitlines() if line.strip().startswith('"rlbus-')}


def measure(repo: Path, member: str, extra: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="rlbus-image-") as venv:
        env = dict(os.environ, UV_PROJECT_ENVIRONMENT=venv, UV_COMPILE_BYTECODE="1")
        argv = [
            str(repo / "uvw"),
            "sync",
            "--quiet",
            "--no-default-groups",
            "--package",
            member,
            *extra,
        ]
        subprocess.run(argv, cwd=repo, env=env, check=True)
        return tree_bytes(Path(venv))


def main() -> None:
    repo = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
    members = member_names(repo)
    print(f"{'image':<14}{'member':<22}{'installed MB':>14}")
    for target, (member, extra) in TARGETS.items():
        if member not in members:  # before the split the launcher image synced rlbus-shared
            member = "rlbus-shared"
        size = measure(repo, member, extra)
        print(f"{target:<14}{member:<22}{size / 1e6:>14.0f}")


if __name__ == "__main__":
    main()
