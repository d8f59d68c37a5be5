"""Claim check: payloads too large for one NATS message travel through the run's shared storage.

`store()` writes the bytes atomically (temp file, fsync, rename) under
`<storage_dir>/claims/<subject>/<sha256>-<message id hash>.bin` and returns a `ClaimCheck`
(relative path, size, sha256) that the bus publishes instead, with header `Rlbus-Claim-Check: 1`.
A publish retried with the same message id writes the same file; two messages with equal
payloads get a file each, so deleting one never takes the other's.

A claim check arrives from the bus, so its path is untrusted: `open_claimed()` accepts only a
relative path without `..` that stays inside `<storage_dir>/claims` after symlinks are resolved,
and only a regular file of the recorded size (a FIFO would block the reader forever, a device or
a huge file would exhaust it). `load()` then verifies the checksum. Any refusal raises
`ClaimCheckError` (the consumer sends the message to the dead-letter subject; the step log raises
`PoisonBatch` to its caller).

Files are deleted once consumed: a work-queue message's after its ack is confirmed (`discard`),
a train batch's once no checkpoint a trainer may resume from precedes its step
(`discard_subjects`). Dead letters keep theirs, for inspection.
"""

import errno
import hashlib
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import msgspec
import structlog

from rlbus.bus.errors import BusError, ClaimCheckError
from rlbus.checksums import sha256_bytes
from rlbus.wire import claims
from rlbus.wire.claims import ClaimCheck

log = structlog.get_logger()

CLAIM_HEADER = "Rlbus-Claim-Check"
CLAIMS_DIR = "claims"


def store(storage_dir: Path, subject: str, payload: bytes, msg_id: str) -> ClaimCheck:
    """Write `payload` under the run's storage and return its claim check."""
    digest = sha256_bytes(payload)
    per_message = hashlib.sha256(msg_id.encode()).hexdigest()[:16]
    relative = PurePosixPath(CLAIMS_DIR, subject, f"{digest}-{per_message}.bin")
    path = storage_dir / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    if not (path.exists() and path.stat().st_size == len(payload)):
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "wb") as out:
            out.write(payload)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    return ClaimCheck(path=str(relative), size=len(payload), sha256=digest)


def check_in(
    storage_dir: Path | None, subject: str, payload: bytes, msg_id: str, threshold: int
) -> bytes:
    """Store a payload above `threshold` bytes under `storage_dir`; the encoded `ClaimCheck` to
    publish instead. Without a storage dir the publisher was built wrong: `BusError` says so."""
    if storage_dir is None:
        raise BusError(
            f"a {len(payload)}-byte message to {subject} exceeds the claim-check threshold "
            f"({threshold} bytes) but this Bus has no storage_dir: pass storage_dir=<run_dir>"
        )
    claim = store(storage_dir, subject, payload, msg_id)
    log.debug("claim_check_stored", subject=subject, size=claim.size, path=claim.path)
    return claims.encoder.encode(claim)


def claim_of(data: bytes, headers: dict[str, str] | None) -> ClaimCheck | None:
    """The claim check a received message carries instead of its payload (None: inline).
    Undecodable claim bytes raise `ClaimCheckError`."""
    if not (headers and headers.get(CLAIM_HEADER)):
        return None
    try:
        return claims.decoder.decode(data)
    except msgspec.DecodeError as error:
        raise ClaimCheckError(f"undecodable claim check: {error}") from None


def resolve(storage_dir: Path | None, claim: ClaimCheck) -> Path:
    """The file `claim` names, refused unless it lies inside `<storage_dir>/claims`."""
    if storage_dir is None:
        raise ClaimCheckError(
            f"claim check {claim.path!r} needs the run's storage_dir, which this Bus lacks"
        )
    relative = PurePosixPath(claim.path)
    if relative.is_absolute() or not relative.parts or relative.parts[0] != CLAIMS_DIR:
        raise ClaimCheckError(
            f"claim check path {claim.path!r} refused: it must be relative and under {CLAIMS_DIR}/"
        )
    if ".." in relative.parts or "\x00" in claim.path:
        raise ClaimCheckError(f"claim check path {claim.path!r} refused: '..' is not allowed")
    root = (storage_dir / CLAIMS_DIR).resolve()
    path = (storage_dir / relative).resolve()
    if not path.is_relative_to(root):
        raise ClaimCheckError(
            f"claim check path {claim.path!r} refused: it leads outside {root} (a symlink)"
        )
    return path


def open_claimed(storage_dir: Path | None, claim: ClaimCheck) -> bytes:
    """The bytes of the regular file `claim` names, if it has the recorded size."""
    path = resolve(storage_dir, claim)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; O_NOFOLLOW: no last-hop symlink.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise ClaimCheckError(f"claim-check file {path} is missing") from None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ClaimCheckError(f"claim-check file {path} refused: a symlink") from None
        raise ClaimCheckError(f"claim-check file {path}: {error.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ClaimCheckError(f"claim-check file {path} refused: not a regular file")
        if info.st_size != claim.size:
            raise ClaimCheckError(
                f"claim-check file {path} has {info.st_size} bytes, expected {claim.size}"
            )
        chunks, left = [], claim.size + 1
        while left and (chunk := os.read(fd, min(left, 1 << 24))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def load(storage_dir: Path | None, claim: ClaimCheck) -> bytes:
    """Read a claimed payload back; raise `ClaimCheckError` if it is refused, missing or corrupted."""
    payload = open_claimed(storage_dir, claim)
    if len(payload) != claim.size:  # changed while we read it
        raise ClaimCheckError(
            f"claim-check file {claim.path} has {len(payload)} bytes, expected {claim.size}"
        )
    digest = sha256_bytes(payload)
    if digest != claim.sha256:
        raise ClaimCheckError(
            f"claim-check file {claim.path} sha256 {digest} != recorded {claim.sha256}"
        )
    return payload


def discard(storage_dir: Path | None, claim: ClaimCheck) -> None:
    """Delete the file of a consumed claim check (and its subject directory once empty)."""
    try:
        path = resolve(storage_dir, claim)
    except ClaimCheckError:
        return  # never ours to delete
    path.unlink(missing_ok=True)
    try:
        path.parent.rmdir()
    except OSError:  # other claims of the subject remain
        pass


def discard_subjects(storage_dir: Path | None, doomed: Callable[[str], bool]) -> list[str]:
    """Delete the claim files of every subject for which `doomed(subject)` holds; returns them."""
    if storage_dir is None or not (root := storage_dir / CLAIMS_DIR).is_dir():
        return []
    removed = []
    for entry in root.iterdir():
        if entry.is_dir() and not entry.is_symlink() and doomed(entry.name):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return sorted(removed)
