"""Base struct shared by the wire modules."""

import time
from typing import Annotated

import msgspec

# Constrained field types: a message that breaks them fails to decode with the field named
# (`Expected `int` >= 0 - at `$.step``), so the consumer quarantines it at once instead of a
# service crashing on it or retrying it until max_deliver.
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
"""A step, a version, a count that may be zero."""
Positive = Annotated[int, msgspec.Meta(ge=1)]
"""A size that must be at least one (group size, max tokens)."""
FileName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_][A-Za-z0-9._-]*$", max_length=255)]
"""A bare file name: no directory part, no `..`, not hidden."""


class Message(msgspec.Struct, kw_only=True):
    """Base of every top-level wire message (keyword-only, map-encoded)."""


def now() -> float:
    """Wall-clock timestamp (unix seconds) used as a default in messages."""
    return time.time()
