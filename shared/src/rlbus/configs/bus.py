"""NATS connection settings shared by every service.

Secrets (the token, the password) never live in a config: a config file or a command line is
readable by others (`ps`, the run directory), so `bus.token` / `bus.password` refuse any value and
the secret comes from a 0600 file (`token_file`, `password_file`) or an environment variable
(RLBUS_BUS_TOKEN, RLBUS_BUS_PASSWORD). Code that already holds one uses `with_secrets()`, which
keeps it out of every dump (docs/security.md, "The bus: authentication, TLS and permissions").
"""

from typing import Any

from pydantic import Field, PrivateAttr, model_validator

from rlbus.configs.base import BaseConfig
from rlbus.secrets import resolve_secret

TOKEN_ENV = "RLBUS_BUS_TOKEN"
PASSWORD_ENV = "RLBUS_BUS_PASSWORD"


class BusConfig(BaseConfig):
    """The NATS JetStream bus. Without `url`, the `rl` launcher starts an embedded nats-server
    whose store lives in the run directory."""

    url: str | None = None
    """External NATS URL (e.g. nats://nats:4222). Unset: embedded server (launcher only)."""

    run_id: str | None = None
    """Subject prefix of this run (`rlbus.<run_id>.`); defaults to the run name."""

    token: str | None = None
    """Not accepted (a command line or config file shows it to others): put the token in a 0600
    file and set `token_file`, or export RLBUS_BUS_TOKEN."""

    token_file: str | None = None
    """File holding the auth token (mode 0600). Unset: RLBUS_BUS_TOKEN, if set."""

    user: str | None = None
    """User name; its password comes from `password_file` or RLBUS_BUS_PASSWORD."""

    password: str | None = None
    """Not accepted (a command line or config file shows it to others): put the password in a
    0600 file and set `password_file`, or export RLBUS_BUS_PASSWORD."""

    password_file: str | None = None
    """File holding the password of `user` (mode 0600). Unset: RLBUS_BUS_PASSWORD, if set."""

    creds_file: str | None = None
    """NATS credentials file (user JWT + nkey seed, mode 0600)."""

    nkey_seed_file: str | None = None
    """File holding an nkey seed (`SU...`, mode 0600): nkey authentication without a JWT."""

    tls_ca: str | None = None
    """CA certificate used to verify the server. Set (or a tls:// URL): the connection is TLS or
    nothing, never plaintext."""

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

    _token: str | None = PrivateAttr(None)
    _password: str | None = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _refuse_plain_secrets(cls, data: Any) -> Any:
        """A before-validator, so the error's input is the whole block and the secret itself is
        never echoed back in the message."""
        for name, env in (("token", TOKEN_ENV), ("password", PASSWORD_ENV)):
            if isinstance(data, dict) and data.get(name) not in (None, "None"):
                raise ValueError(
                    f"bus.{name}: a plain secret is not accepted (a command line or config file "
                    f"shows it to others): export {env}=... or write it to a file with mode 0600 "
                    f"and pass --bus.{name}-file PATH"
                )
        return data

    def with_secrets(self, *, token: str | None = None, password: str | None = None) -> "BusConfig":
        """A copy that carries `token` / `password` in memory only (never dumped or logged)."""
        copy = self.model_copy(deep=True)
        copy._token = token if token is not None else self._token
        copy._password = password if password is not None else self._password
        return copy

    def secret_token(self) -> str | None:
        """The token: `with_secrets`, else `token_file`, else RLBUS_BUS_TOKEN, else None."""
        if self._token is not None:
            return self._token
        return resolve_secret(field="bus.token_file", file=self.token_file, env=TOKEN_ENV)

    def secret_password(self) -> str | None:
        """The password: `with_secrets`, else `password_file`, else RLBUS_BUS_PASSWORD, else None."""
        if self._password is not None:
            return self._password
        return resolve_secret(field="bus.password_file", file=self.password_file, env=PASSWORD_ENV)

    @property
    def wants_tls(self) -> bool:
        """TLS is configured: a tls:// URL or a CA / client certificate."""
        return bool(self.tls_ca or self.tls_cert or (self.url or "").startswith("tls://"))

    @model_validator(mode="after")
    def _check_windows(self) -> "BusConfig":
        if self.duplicate_window_s > self.stream_max_age_s:
            raise ValueError(
                f"bus.duplicate_window_s ({self.duplicate_window_s}) must not exceed bus.stream_max_age_s "
                f"({self.stream_max_age_s}): JetStream rejects such streams"
            )
        if self.password_file and not self.user:
            raise ValueError("bus.password_file needs bus.user (the user that password belongs to)")
        if self.tls_key and not self.tls_cert:
            raise ValueError("bus.tls_key needs bus.tls_cert")
        return self
