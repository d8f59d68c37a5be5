"""Replica registry entries.

Sender: each inference replica, as a lease (per-key TTL, heartbeated) in the KV bucket
`subjects.replicas_bucket`, key = `replica_id`. Receivers: orchestrator rollout workers
(discovery), the launcher and users.
"""

import msgspec

from rlbus.wire.base import Message, now


class ReplicaInfo(Message, kw_only=True):
    """Where a replica serves, what, and how much it can take."""

    replica_id: str
    base_url: str
    """OpenAI-compatible API root (e.g. http://host:8000/v1)."""
    admin_url: str | None = None
    model: str
    weights_version: int = 0
    capacity: int = 1
    """Concurrent requests this replica is sized for."""
    status: str = "ready"
    """`starting`, `ready`, `updating_weights`, `draining`."""
    tensor_parallel_size: int = 1
    """Worker processes of the engine: the ranks it takes in an nccl weight broadcast group."""
    started_at: float = msgspec.field(default_factory=now)
    """When the replica process started (Unix time): the same in every update of its entry, so
    a new value under the same id means a restarted replica (new workers, fresh backoff)."""
    updated_at: float = msgspec.field(default_factory=now)


encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(ReplicaInfo)
