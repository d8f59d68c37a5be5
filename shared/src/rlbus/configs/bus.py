"""NATS connection settings shared by every service."""

from pydantic import Field, model_validator

from rlbus.configs.base import BaseConfig


class BusConfig(BaseConfig):
    """The NATS JetStream bus. Without `url`, the `rl` launcher starts an embedded nats-server
    whose store lives in the run directory."""

    url: str | None = None
    """External NATS URL (e.g. nats://nats:4222). Unset: embedded server (launcher only)."""

    run_id: str | None = None
    """Subject prefix of this run (`rlbus.<run_id>.`); defaults to the run name."""

    token: str | None = None
    """Auth token."""

    user: str | None = None
    """User name (with `password`)."""

    password: str | None = None
    """Password (with `user`)."""

    creds_file: str | None = None
    """NATS credentials file (JWT + nkey seed)."""

    tls_ca: str | None = None
    """CA certificate used to verify the server."""

    tls_cert: str | None = None
    """Client certificate (mutual TLS)."""

    tls_key: str | None = None
    """Client key (mutual TLS)."""

    connect_timeout_s: float = Field(5.0, gt=0)
    """Timeout of one connection attempt."""

    max_payload_mb: int = Field(8, ge=1, le=64)
    """max_payload of the embedded server; bigger payloads go through the claim check."""

    stream_max_age_s: float = Field(7 * 24 * 3600, gt=0)
    """Retention of the limits streams (batches, events)."""

    stream_max_bytes: int = Field(-1)
    """Byte limit of each stream (-1: unlimited)."""

    duplicate_window_s: float = Field(120.0, gt=0)
    """JetStream dedup window for Nats-Msg-Id."""

    connect_retry_s: float = Field(30.0, ge=0)
    """How long the first connection is retried while no server answers (bad credentials fail at once)."""

    reconnect_wait_s: float = Field(0.5, gt=0)
    """Pause between reconnect attempts (the client reconnects forever)."""

    ping_interval_s: float = Field(10.0, gt=0)
    """Client ping interval; a dead server is noticed after ~3 missed pings."""

    publish_timeout_s: float = Field(5.0, gt=0)
    """Timeout of one JetStream publish acknowledgement."""

    publish_retry_s: float = Field(120.0, gt=0)
    """Total time a publish is retried (same Nats-Msg-Id, so never duplicated) before it fails."""

    ack_wait_s: float = Field(30.0, gt=0)
    """AckWait of the durable consumers; the bus sends in_progress() every third of it while a
    message is held, so long handlers are not redelivered."""

    max_deliver: int = Field(5, ge=1)
    """A message whose handler raises on its delivery number `max_deliver` (or later) is quarantined:
    the consumer copies it to the run's dead-letter stream with the handler's error and terminates
    it. Naks in between back off (`nak_delay_s * 2^(n-1)`, capped). Deliveries a handler deferred
    with `nak()` count too; JetStream itself never stops delivering, so nothing is dropped without
    a dead letter (docs/bus.md, "Dead letters")."""

    lease_grace_s: float = Field(30.0, ge=0)
    """A lease whose heartbeat finds its key expired or rewritten keeps it when its last good
    heartbeat is at most this old (a NATS outage): it re-creates the expired key, or adopts a
    revision that holds its own value (a heartbeat stored whose ack was lost). A key another holder
    took, or an older last heartbeat, means the lease is lost (docs/bus.md, "Lease")."""

    max_ack_pending: int = Field(1000, ge=1)
    """Unacknowledged messages a durable consumer may have outstanding."""

    claim_check_bytes: int | None = Field(None, ge=1024)
    """Payloads above this size go through the claim check (shared storage). Default: the server's
    max_payload minus 256 KiB."""

    fsync_always: bool = False
    """Embedded server: fsync every write (safe against power loss, ~3-8x slower publishes)."""

    @model_validator(mode="after")
    def _check_windows(self) -> "BusConfig":
        if self.duplicate_window_s > self.stream_max_age_s:
            raise ValueError(
                f"bus.duplicate_window_s ({self.duplicate_window_s}) must not exceed bus.stream_max_age_s "
                f"({self.stream_max_age_s}): JetStream rejects such streams"
            )
        if (self.user is None) != (self.password is None):
            raise ValueError("set both bus.user and bus.password (or neither)")
        if self.tls_key and not self.tls_cert:
            raise ValueError("bus.tls_key needs bus.tls_cert")
        return self
