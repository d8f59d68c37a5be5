"""Claim check: the reference sent instead of a payload too large for one NATS message.

Written by `rlbus.bus` on publish (header `Rlbus-Claim-Check: 1`), read back and verified by the
bus on consume; services never see it.
"""

import msgspec


class ClaimCheck(msgspec.Struct, kw_only=True):
    """Where the real payload lies and how to verify it."""

    path: str
    """Path relative to the run's storage directory (absolute when no storage dir is shared)."""
    size: int
    sha256: str


encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(ClaimCheck)
