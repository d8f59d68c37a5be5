"""Claim check: payloads too large for one NATS message travel through the run's shared storage.

`store()` writes the bytes atomically (temp file, fsync, rename) under
`<storage_dir>/claims/<subject>/<sha256>.bin` and returns a `ClaimCheck` (relative path, size,
sha256) that the bus publishes instead, with header `Rlbus-Claim-Check: 1`. `load()` reads them
back and verifies size and checksum; a mismatch raises `ClaimCheckError` (the consumer then sends
the message to the dead-letter subject; the step log raises to its caller).
"""

import os
from pathlib import Path

from rlbus.bus.errors import ClaimCheckError
from rlbus.checksums import sha256_bytes
from rlbus.wire.claims import ClaimCheck

CLAIM_HEADER = "Rlbus-Claim-Check"


def store(storage_dir: Path, subject: str, payload: bytes) -> ClaimCheck:
    """Write `payload` under the run's storage and return its claim check."""
    digest = sha256_bytes(payload)
    relative = Path("claims") / subject / f"{digest}.bin"
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


def load(storage_dir: Path | None, claim: ClaimCheck) -> bytes:
    """Read a claimed payload back; raise `ClaimCheckError` if it is missing or corrupted."""
    path = Path(claim.path)
    if not path.is_absolute():
        if storage_dir is None:
            raise ClaimCheckError(
                f"claim check {claim.path} needs the run's storage_dir, which this Bus lacks"
            )
        path = storage_dir / path
    try:
        payload = path.read_bytes()
    except FileNotFoundError as error:
        raise ClaimCheckError(f"claim-check file {path} is missing") from error
    if len(payload) != claim.size:
        raise ClaimCheckError(
            f"claim-check file {path} has {len(payload)} bytes, expected {claim.size}"
        )
    digest = sha256_bytes(payload)
    if digest != claim.sha256:
        raise ClaimCheckError(f"claim-check file {path} sha256 {digest} != recorded {claim.sha256}")
    return payload
