"""Weights: published versions and the replicas' acknowledgements.

- `WeightsPublished`: sender trainer rank 0, stored in the KV bucket `subjects.weights_bucket`
  under key `subjects.WEIGHTS_LATEST_KEY` (and appended to the events stream); receivers: the
  inference weight agents (KV watch) and the orchestrator (off-policy control).
- `WeightsApplied` / `WeightsFailed`: sender an inference replica's weight agent, on
  `subjects.weights_applied` / `subjects.weights_failed` (events stream); receivers: orchestrator,
  trainer (pruning old broadcasts), monitors.
- `WEIGHTS_VERSION_HEADER`: not a bus message but the same contract over HTTP: every response of
  an inference engine carries the version it was produced with (decimal int); sender the
  inference admin middleware, receiver the orchestrator's inference client.
"""

from typing import Literal

import msgspec

from rlbus.wire.base import FileName, Message, NonNegative, now

WEIGHTS_VERSION_HEADER = "X-Rlbus-Weights-Version"


class WeightFile(msgspec.Struct, kw_only=True):
    """One file of a filesystem broadcast, relative to `location`."""

    name: FileName
    size: NonNegative
    sha256: str


class WeightsPublished(Message, kw_only=True, tag="weights_published"):
    """Weights version `version` (= trainer step) is ready."""

    version: NonNegative
    transport: Literal["filesystem", "nccl"]
    location: str
    """filesystem: the broadcast directory; nccl: the rendezvous address `host:port` of the
    group generation (a new one whenever the group is re-formed)."""
    files: list[WeightFile] = []
    dtype: str = "float32"
    lora_name: str | None = None
    """Set when only a LoRA adapter is published."""
    ranks: dict[str, int] = {}
    """nccl: replica id -> the group rank of its worker 0 (its worker k joins as that + k)."""
    world_size: NonNegative = 0
    """nccl: ranks in the group (1 trainer + every replica worker); 0: an older trainer's
    two-rank group (one replica, rank 1)."""
    published_at: float = msgspec.field(default_factory=now)


class WeightsApplied(Message, kw_only=True, tag="weights_applied"):
    """A replica now serves `version`."""

    version: NonNegative
    replica_id: str
    duration_s: float = 0.0
    applied_at: float = msgspec.field(default_factory=now)


class WeightsFailed(Message, kw_only=True, tag="weights_failed"):
    """A replica could not apply `version` (it keeps serving its previous version)."""

    version: NonNegative
    replica_id: str
    reason: str
    failed_at: float = msgspec.field(default_factory=now)


WeightsMessage = WeightsPublished | WeightsApplied | WeightsFailed

encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(WeightsMessage)
published_decoder = msgspec.msgpack.Decoder(WeightsPublished)
