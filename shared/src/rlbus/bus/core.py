"""`BusCore`: the connection-level operations every part of the bus builds on.

Publishing (message id, trace headers, claim check, retry with the same id), decoding received
payloads (claim checks resolved and verified), dead letters, and ensuring the run's streams,
durable consumers and KV buckets. `Consumer`, `StepLog`, `KV` and `Lease` take a `BusCore`;
`Bus` (client.py) is a `BusCore` that also builds them. This module imports none of those, so
imports run one way: core <- consumer / kv / steplog <- client (tests/unit/bus/test_layers.py).
"""

import asyncio
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.js import api

from rlbus.bus import claimcheck
from rlbus.bus.errors import BusError
from rlbus.configs.bus import BusConfig
from rlbus.obs import tracing
from rlbus.wire import claims
from rlbus.wire.subjects import BucketSpec, ConsumerSpec, RunSubjects, StreamSpec

log = structlog.get_logger()

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

_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct | bytes) -> bytes:
    """msgpack bytes of a wire struct (bytes pass through)."""
    return (
        message if isinstance(message, bytes | bytearray | memoryview) else _encoder.encode(message)
    )


class BusCore:
    """A connection scoped to one run: topology, publishing, payload decoding (module docstring)."""

    def __init__(
        self, nc, config: BusConfig, subjects: RunSubjects, storage_dir: Path | None, name: str
    ):
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

    # ---- topology -------------------------------------------------------------------------

    async def ensure(self) -> None:
        """Create (or update) every stream, durable consumer and KV bucket of the run. Idempotent."""
        async with self._ensure_lock:
            for spec in self.subjects.streams():
                await self.ensure_stream(spec)
            for spec in self.subjects.consumers():
                await self.ensure_consumer(spec)
            for spec in self.subjects.buckets():
                await self.ensure_bucket(spec)

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

    def stream_config(self, spec: StreamSpec) -> api.StreamConfig:
        retention = (
            api.RetentionPolicy.WORK_QUEUE
            if spec.retention == "workqueue"
            else api.RetentionPolicy.LIMITS
        )
        return api.StreamConfig(
            name=spec.name,
            subjects=list(spec.subjects),
            retention=retention,
            storage=api.StorageType.FILE,
            max_age=self.config.stream_max_age_s,
            max_bytes=self.config.stream_max_bytes,
            max_msgs_per_subject=spec.max_msgs_per_subject,
            max_msg_size=-1,
            duplicate_window=self.config.duplicate_window_s,
            allow_direct=True,
        )

    async def ensure_stream(self, spec: StreamSpec) -> None:
        config = self.stream_config(spec)
        try:
            await self.js.add_stream(config)
        except nats.js.errors.BadRequestError as error:
            if error.err_code != 10058:  # stream name in use with a different config
                raise
            await self.js.update_stream(config)
            log.info("stream_updated", stream=spec.name)

    async def ensure_consumer(self, spec: ConsumerSpec) -> None:
        config = api.ConsumerConfig(
            durable_name=spec.durable,
            name=spec.durable,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=self.config.ack_wait_s,
            max_deliver=self.config.max_deliver,
            max_ack_pending=self.config.max_ack_pending,
            filter_subject=spec.filter_subject,
            deliver_policy=api.DeliverPolicy.ALL,
        )
        await self.js.add_consumer(spec.stream, config)

    async def ensure_bucket(self, spec: BucketSpec) -> None:
        await self.js.create_key_value(
            api.KeyValueConfig(
                bucket=spec.name, history=spec.history, direct=True, storage=api.StorageType.FILE
            )
        )

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
            f"publish {subject}", subject=subject, headers=headers, msg_id=headers[MSG_ID_HEADER]
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
        if tracing.enabled():
            with tracing.producer_span(
                f"publish_many {len(prepared)}",
                subject=prepared[0][0] if prepared else "",
                headers={},
            ):
                for _, _, headers in prepared:
                    tracing.inject_headers(headers)
        futures = []
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
            payload = self._claim(subject, payload)
            headers[claimcheck.CLAIM_HEADER] = "1"
        return payload, headers

    def _claim(self, subject: str, payload: bytes) -> bytes:
        if self.storage_dir is None:
            raise BusError(
                f"a {len(payload)}-byte message to {subject} exceeds the claim-check threshold "
                f"({self.claim_check_bytes} bytes) but this Bus has no storage_dir: pass storage_dir=<run_dir>"
            )
        claim = claimcheck.store(self.storage_dir, subject, payload)
        log.debug("claim_check_stored", subject=subject, size=claim.size, path=claim.path)
        return claims.encoder.encode(claim)

    async def _publish_with_retry(
        self, subject: str, payload: bytes, headers: dict, msg_ttl: float | None
    ):
        deadline = time.monotonic() + self.config.publish_retry_s
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
                    error=type(error).__name__,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    def decode_payload(self, data: bytes, headers: dict[str, str] | None) -> bytes:
        """The real payload of a received message (resolves claim checks, verifying them)."""
        if headers and headers.get(claimcheck.CLAIM_HEADER):
            return claimcheck.load(self.storage_dir, claims.decoder.decode(data))
        return data

    async def dead_letter(
        self, stream: str, subject: str, data: bytes, headers: dict | None, reason: str
    ) -> None:
        """Copy an unprocessable message to `subjects.dead(stream)` with the reason."""
        dead_headers = {
            "Rlbus-Dead-Reason": reason[:1000],
            "Rlbus-Dead-Subject": subject,
        }
        if headers and headers.get(MSG_ID_HEADER):
            dead_headers["Rlbus-Dead-Msg-Id"] = headers[MSG_ID_HEADER]
        if headers and headers.get(claimcheck.CLAIM_HEADER):
            dead_headers[claimcheck.CLAIM_HEADER] = "1"
        await self._publish_with_retry(self.subjects.dead(stream), data, dead_headers, None)
