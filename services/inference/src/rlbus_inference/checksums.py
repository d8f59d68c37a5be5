"""sha256 checks of a published weights directory (no torch, no vLLM: importable anywhere).

The trainer publishes, with every filesystem version, the sha256 of each file it wrote. Inference
verifies them before loading a single tensor, so a truncated or corrupted directory is refused and
the engine keeps serving the version it already has.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

_CHUNK = 1 << 20


class ChecksumMismatch(ValueError):
    """A weights directory does not match the checksums published with it."""


def sha256_file(path: Path) -> str:
    """Hex sha256 of one file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify_weights_dir(weights_dir: Path, expected: dict[str, str]) -> None:
    """Raise ChecksumMismatch naming the first file that is missing or differs from `expected`.

    `expected` maps file names relative to `weights_dir` to hex sha256. An empty map checks nothing
    (a publisher that sends no checksums gets no verification, which the caller logs).
    """
    weights_dir = Path(weights_dir)
    for name, want in sorted(expected.items()):
        path = weights_dir / name
        if not path.is_file():
            raise ChecksumMismatch(f"{path} is missing (published with sha256 {want[:12]}...)")
        got = sha256_file(path)
        if got != want:
            raise ChecksumMismatch(
                f"{path} has sha256 {got[:12]}... but {want[:12]}... was published; "
                "the directory is corrupt or still being written"
            )


def safetensors_files(weights_dir: Path) -> list[Path]:
    """The `*.safetensors` files of a weights directory, sorted; raises if there are none."""
    files = sorted(Path(weights_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {weights_dir}")
    return files
