"""Control: request/reply commands to a service (core NATS request on `subjects.control(service)`).

Sender: the launcher or a user tool. Receiver: `rlbus.lifecycle.control_handler` in the service,
which answers with `ControlReply`. What each request does per service: docs/launcher.md.
"""

import msgspec

from rlbus.wire.base import Message, now


class Drain(Message, kw_only=True, tag="drain"):
    """Finish in-flight work, take no new work, then exit 0 (like the first SIGTERM/SIGINT)."""

    reason: str | None = None
    requested_at: float = msgspec.field(default_factory=now)


class Stop(Message, kw_only=True, tag="stop"):
    """Stop now (in-flight work is redelivered elsewhere; nothing half-written is marked ready)."""

    reason: str | None = None
    requested_at: float = msgspec.field(default_factory=now)


class Pause(Message, kw_only=True, tag="pause"):
    """Stop taking new work until `Resume` (the orchestrator's coordinator; others refuse it)."""

    reason: str | None = None
    requested_at: float = msgspec.field(default_factory=now)


class Resume(Message, kw_only=True, tag="resume"):
    """Undo `Pause`."""

    requested_at: float = msgspec.field(default_factory=now)


class ControlReply(Message, kw_only=True, tag="control_reply"):
    """Answer of a service to a control request."""

    ok: bool
    service: str
    state: str | None = None
    """The service's state after handling the request (e.g. `draining`, `paused`)."""
    message: str | None = None


ControlRequest = Drain | Stop | Pause | Resume

encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(ControlRequest)
reply_decoder = msgspec.msgpack.Decoder(ControlReply)
