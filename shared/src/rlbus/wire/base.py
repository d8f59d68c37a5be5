"""Base struct shared by the wire modules."""

import time

import msgspec


class Message(msgspec.Struct, kw_only=True):
    """Base of every top-level wire message (keyword-only, map-encoded)."""


def now() -> float:
    """Wall-clock timestamp (unix seconds) used as a default in messages."""
    return time.time()
