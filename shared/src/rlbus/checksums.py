"""The one checksum of rlbus: hex sha256, of bytes in memory or of a file read in chunks.

Filesystem weight broadcasts carry, per file, a `WeightFile(name, size, sha256)`
(`rlbus.wire.weights`): the trainer hashes each safetensors shard while writing it
(`rlbus_trainer.safetensors_stream`, hex sha256 of the same bytes) and the other files with
`weight_files`; inference checks them with `verify_files` before loading a single tensor, so a
truncated or corrupted directory is refused and the engine keeps serving the version it has.
Claim-check payloads (`rlbus.bus.claimcheck`) are named and verified with `sha256_bytes`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

from rlbus.wire.weights import WeightFile

_CHUNK = 1 << 20  # weights files are GBs: hash them without holding them in memory


class ChecksumMismatch(ValueError):
    """A directory does not match the checksums published with it."""


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    """Hex sha256 of one file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def weight_files(
    directory: Path, known: Mapping[str, WeightFile] | None = None
) -> list[WeightFile]:
    """Name, size and sha256 of every file directly in `directory`, sorted by name; a file in
    `known` (hashed while it was written, the trainer's shards) is taken as given, not read."""
    known = known or {}
    return [
        known.get(f.name) or WeightFile(name=f.name, size=f.stat().st_size, sha256=sha256_file(f))
        for f in sorted(Path(directory).iterdir())
        if f.is_file()
    ]


def verify_files(directory: Path, expected: dict[str, str]) -> None:
    """Raise ChecksumMismatch naming the first file that is missing or differs from `expected`.

    `expected` maps file names relative to `directory` to hex sha256. An empty map checks nothing
    (a publisher that sends no checksums gets no verification, which the caller logs).
    """
    directory = Path(directory)
    for name, want in sorted(expected.items()):
        path = directory / name
        if not path.is_file():
            raise ChecksumMismatch(f"{path} is missing (published with sha256 {want[:12]}...)")
        got = sha256_file(path)
        if got != want:
            raise ChecksumMismatch(
                f"{path} has sha256 {got[:12]}... but {want[:12]}... was published; "
                "the directory is corrupt or still being written"
            )
