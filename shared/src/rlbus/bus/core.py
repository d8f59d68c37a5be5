"""`BusCore`: the connection-level operations every part of the bus builds on.

Publishing (message id, trace headers, claim check, retry with the same id), decoding received
payloads (claim checks resolved and verified), dead letters, and ensuring the run's streams,
durable consumers and KV buckets. What each of those is lives below core: the server-side
configs in topology.py, the claim-check files in claimcheck.py, the dead-letter headers and
records in quarantine.py; `BusCore` holds the connection and the state they share (the ensure
lock, the ids already quarantined). `Consumer`, `StepLog`, `KV` and `Lease` take a `BusCore`;
`Bus` (client.py) is a `BusCore` that also builds them. This module imports none of those, so
imports run one way: core <- consumer / kv / steplog <- client (tests/unit/bus/test_layers.py).
"""

import asyncio
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.js import api

from rlbus.bus import claimcheck, topology
from rlbus.bus.quarantine import (
    DeadLetter,
    dead_letter_headers,
    dead_letter_id,
    read_dead_letters,
)
from rlbus.configs.bus import BusConfig
from rlbus.obs import tracing
from rlbus.obs.metrics import count_dead_letter
from rlbus.wire.claims import ClaimCheck
from rlbus.wire.subjects import ConsumerSpec, RunSubjects

log = structlog.get_logger()

T = TypeVar("T")

MSG_ID_HEADER = "Nats-Msg-Id"
CLAIM_CHECK_MARGIN = 256 * 1024
# Errors after which a publish may or may not have been stored: retry with the same msg id.
RETRYABLE_PUBLISH_ERRORS = (
    nats.errors.TimeoutError,
    asyncio.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.ServiceUnavailableError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
)


async def retry_transient(
    what: str,
    call: Callable[[], Awaitable[T]],
    *,
    within_s: float,
    event: str = "bus_retry",
    max_delay_s: float = 1.0,
    **fields: Any,
) -> T:
    """`await call()`, retried on transient bus errors (`RETRYABLE_PUBLISH_ERRORS`: a NATS
    outage, a reconnect) for up to `within_s`, backing off from 0.1 s to `max_delay_s`, with one
    `event` log line per retry naming `what` waits and for how long; then the error is raised.
    Only for calls that are safe to repeat (a read, a put of the same value)."""
    started = time.monotonic()
    delay = 0.1
    while True:
        try:
            return await call()
        except RETRYABLE_PUBLISH_ERRORS as error:
            waited = time.monotonic() - started
            if waited + delay > within_s:
                raise
            log.warning(
                event, what=what, waited_s=round(waited, 1), error=type(error).__name__, **fields
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay_s)


_encoder = msgspec.msgpack.Encoder()


UNSUBSCRIBE_TIMEOUT_S = 5.0
"""Longest wait for an UNSUB to be flushed at shutdown."""


async def unsubscribe_quietly(subscription: Any) -> None:
    """Drop a core-NATS subscription at shutdown, whatever the connection's state: a closed or
    draining connection has dropped it already, and a flush that does not come back within
    UNSUBSCRIBE_TIMEOUT_S is given up (the server forgets the interest with the connection)."""
    try:
        await asyncio.wait_for(subscription.unsubscribe(), UNSUBSCRIBE_TIMEOUT_S)
    except Exception as error:  # TimeoutError included
        log.debug("unsubscribe_skipped", error=repr(error))


def encode(message: msgspec.Struct | bytes) -> bytes:
    """msgpack bytes of a wire struct (bytes pass through)."""
    return (
        message if isinstance(message, bytes | bytearray | memoryview) else _encoder.encode(message)
    )


class BusCore:
    """A connection scoped to one run: topology, publishing, payload decoding (module docstring)."""

    def __init__(
        self,
        nc: NATS,
        config: BusConfig,
        subjects: RunSubjects,
        storage_dir: Path | None,
        name: str,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=config.publish_timeout_s)
        self.config = config
        self.subjects = subjects
        self.storage_dir = storage_dir
        self.name = name
        server_max = nc.max_payload or config.max_payload_mb * 1024 * 1024
        self.claim_check_bytes = min(
            config.claim_check_bytes or server_max, server_max - CLAIM_CHECK_MARGIN
        )
        self._ensure_lock = asyncio.Lock()
        self._background: set[asyncio.Task] = set()
        self._quarantined: set[str] = set()
        """Dead-letter msg ids this client already stored (a re-read garbage KV entry is
        quarantined and logged once, not on every poll)."""

    # ---- topology -------------------------------------------------------------------------

    async def ensure(self) -> None:
        """Create (or update) every stream, durable consumer and KV bucket of the run. Idempotent."""
        async with self._ensure_lock:
            for stream in self.subjects.streams():
                await topology.ensure_stream(self.js, stream, self.config)
            for consumer in self.subjects.consumers():
                await topology.ensure_consumer(self.js, consumer, self.config)
            for bucket in self.subjects.buckets():
                await topology.ensure_bucket(self.js, bucket)

    def ensure_soon(self) -> None:
        """Re-run `ensure()` in the background (after a reconnect), logging failures."""

        async def ensure_logged() -> None:
            try:
                await self.ensure()
                log.info("bus_topology_ensured", run_id=self.subjects.run_id)
            except Exception as error:
                log.warning("bus_ensure_failed", error=repr(error))

        self._background.add(task := asyncio.create_task(ensure_logged()))
        task.add_done_callback(self._background.discard)

    async def ensure_consumer(self, spec: ConsumerSpec) -> None:
        """Create durable `spec`, or update it to today's settings (`topology.ensure_consumer`)."""
        await topology.ensure_consumer(self.js, spec, self.config)

    # ---- publishing -----------------------------------------------------------------------

    async def publish(
        self,
        subject: str,
        message: msgspec.Struct | bytes,
        *,
        msg_id: str | None = None,
        headers: dict[str, str] | None = None,
        msg_ttl: float | None = None,
    ) -> api.PubAck:
        """Store `message` in the stream of `subject`; returns the ack (`ack.duplicate` for a repeat).

        `msg_id` should be deterministic (derived from what the message is) so a re-publish after a
        crash is deduplicated; without one a random id still makes internal retries safe.
        """
        payload, headers = self._prepare(subject, message, msg_id, headers)
        if not tracing.enabled():  # hot path: no span bookkeeping when nothing records spans
            return await self._publish_with_retry(subject, payload, headers, msg_ttl)
        with tracing.producer_span(
            f"publish {self.subjects.family(subject)}",
            subject=subject,
            headers=headers,
            msg_id=headers[MSG_ID_HEADER],
        ):
            return await self._publish_with_retry(subject, payload, headers, msg_ttl)

    async def publish_many(
        self, items: Iterable[tuple[str, msgspec.Struct | bytes, str | None]]
    ) -> list[api.PubAck]:
        """Pipelined publish of `(subject, message, msg_id)` items: send all, then collect the acks.

        Several times the rate of one-by-one `publish` for small messages (no round trip per
        message). An item whose ack does not come is re-published alone with the same id (so it is
        never duplicated). Acks are returned in item order. All items share one producer span.
        """
        prepared = [
            (subject, *self._prepare(subject, message, msg_id, None))
            for subject, message, msg_id in items
        ]
        if prepared and tracing.enabled() and tracing.in_trace():
            with tracing.producer_span(
                f"publish {self.subjects.family(prepared[0][0])}",
                subject=prepared[0][0],
                headers={},
            ) as span:
                span.set_attribute("messaging.batch.message_count", len(prepared))
                for _, _, headers in prepared:
                    tracing.inject_headers(headers)
        futures: list[asyncio.Future[api.PubAck] | None] = []
        for subject, payload, headers in prepared:
            try:
                futures.append(await self.js.publish_async(subject, payload, headers=headers))
            except RETRYABLE_PUBLISH_ERRORS + (nats.js.errors.TooManyStalledMsgsError,):
                futures.append(None)
        acks = []
        for (subject, payload, headers), future in zip(prepared, futures, strict=True):
            try:
                if future is None:
                    raise nats.errors.TimeoutError
                acks.append(await asyncio.wait_for(future, self.config.publish_timeout_s))
            except RETRYABLE_PUBLISH_ERRORS + (nats.js.errors.NoStreamResponseError,):
                acks.append(await self._publish_with_retry(subject, payload, headers, None))
        return acks

    def _prepare(
        self,
        subject: str,
        message: msgspec.Struct | bytes,
        msg_id: str | None,
        headers: dict[str, str] | None,
    ) -> tuple[bytes, dict[str, str]]:
        """Encoded payload (claim-checked if too big) and headers with the message id."""
        payload = encode(message)
        headers = dict(headers) if headers else {}
        headers[MSG_ID_HEADER] = msg_id or uuid.uuid4().hex
        if len(payload) > self.claim_check_bytes:
            payload = claimcheck.check_in(
                self.storage_dir, subject, payload, headers[MSG_ID_HEADER], self.claim_check_bytes
            )
            headers[claimcheck.CLAIM_HEADER] = "1"
        return payload, headers

    async def _publish_with_retry(
        self, subject: str, payload: bytes, headers: dict[str, str], msg_ttl: float | None
    ) -> api.PubAck:
        """Publish, retrying with the same msg id until `bus.publish_retry_s` (a NATS outage is
        waited out; each retry logs what waits and for how long)."""
        started = time.monotonic()
        deadline = started + self.config.publish_retry_s
        delay = 0.05
        while True:
            try:
                return await self.js.publish(subject, payload, headers=headers, msg_ttl=msg_ttl)
            except nats.js.errors.NoStreamResponseError:
                # No stream listens (yet/any more): e.g. a server restarted on an empty store.
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("publish_no_stream", subject=subject)
                try:
                    await self.ensure()
                except Exception as error:  # the server may still be starting: next round
                    log.warning("bus_ensure_failed", error=repr(error))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
            except RETRYABLE_PUBLISH_ERRORS as error:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning(
                    "publish_retry",
                    subject=subject,
                    msg_id=headers[MSG_ID_HEADER],
                    waited_s=round(time.monotonic() - started, 1),
                    deadline_s=self.config.publish_retry_s,
                    error=type(error).__name__,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    def decode_payload(self, data: bytes, headers: dict[str, str] | None) -> bytes:
        """The real payload of a received message (resolves claim checks, verifying them)."""
        if (claim := self.claim_of(data, headers)) is not None:
            return claimcheck.load(self.storage_dir, claim)
        return data

    @staticmethod
    def claim_of(data: bytes, headers: dict[str, str] | None) -> ClaimCheck | None:
        """The claim check a received message carries instead of its payload (None: inline);
        `ClaimCheckError` when it does not decode (`claimcheck.claim_of`)."""
        return claimcheck.claim_of(data, headers)

    def origin(self) -> str:
        """`<client name>@<host>:<pid>`: who quarantined a message (the `Rlbus-Dead-Origin` header)."""
        return f"{self.name}@{socket.gethostname()}:{os.getpid()}"

    async def dead_letter(
        self,
        stream: str,
        subject: str,
        data: bytes,
        headers: dict | None,
        reason: str,
        *,
        kind: str | None = None,
        num_delivered: int | None = None,
        stream_seq: int | None = None,
    ) -> bool:
        """Copy an unprocessable message of `stream` (or KV bucket) to `subjects.dead(stream)`.

        The copy keeps the payload and carries the reason, original subject, stream, kind
        (default: `subjects.dead_kind(stream)`), origin, delivery count and original sequence as
        `Rlbus-Dead-*` headers. Its Nats-Msg-Id is `dead-<original msg id>` (else
        `dead-<kind>-<stream_seq>`), so quarantining the same message twice within
        `bus.duplicate_window_s` (a restarted service meeting it again) stores it once, and this
        client skips one it already stored. Returns False for such a skip (nothing was sent)."""
        kind = kind or self.subjects.dead_kind(stream)
        original_id = headers.get(MSG_ID_HEADER) if headers else None
        dead_id = dead_letter_id(kind, original_id, stream_seq, fallback=uuid.uuid4().hex)
        if dead_id in self._quarantined:
            return False
        dead_headers = dead_letter_headers(
            stream=stream,
            subject=subject,
            kind=kind,
            origin=self.origin(),
            reason=reason,
            original=headers,
            original_id=original_id,
            num_delivered=num_delivered,
            stream_seq=stream_seq,
        )
        dead_headers[MSG_ID_HEADER] = dead_id
        await self._publish_with_retry(self.subjects.dead(stream), data, dead_headers, None)
        self._quarantined.add(dead_id)
        count_dead_letter(self.subjects, stream, reason)  # Prometheus (rlbus.obs.metrics)
        return True

    async def last_stored(self, stream: str, subject: str) -> api.RawStreamMsg | None:
        """The newest message stored on `stream` under `subject` (None when there is none)."""
        try:
            return await self.js.get_last_msg(stream, subject, direct=True)
        except nats.js.errors.NotFoundError:
            return None

    async def dead_letters(self, *, limit: int | None = None) -> list[DeadLetter]:
        """The run's quarantined messages, oldest first (at most `limit`, the newest ones); none
        when the run never quarantined anything (no dead-letter stream yet)."""
        return await read_dead_letters(self.js, self.subjects.dead_stream, limit=limit)

    async def dead_letter_count(self) -> int:
        """How many messages the run's dead-letter stream holds."""
        return (await self.js.stream_info(self.subjects.dead_stream)).state.messages
