"""`Bus`: the one object a service uses to talk over NATS JetStream.

    bus = await Bus.connect(config.bus, run_id=run_id, storage_dir=run_dir, name="trainer")
    await bus.publish(bus.subjects.tasks, task, msg_id=task.task_id)
    async with bus.consumer(bus.subjects.tasks_stream, bus.subjects.tasks_durable, tasks.decoder, handle):
        ...
    batch = await bus.step_log.get(step, timeout=60)
    await bus.close()

`connect` opens the connection (reconnect forever) and ensures every stream, durable consumer and
KV bucket named by `RunSubjects` (idempotent; re-run after a reconnect). Publishing adds a
`Nats-Msg-Id` (caller-given, else random), W3C trace headers, and moves big payloads to the claim
check; a publish that gets no acknowledgement is retried with the same id, so retries never
duplicate. Consumers (`consumer.py`), the step log (`steplog.py`) and KV/leases (`kv.py`) hang off
this object.
"""

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.js import api

from rlbus.bus import claimcheck
from rlbus.bus.connection import open_connection
from rlbus.bus.consumer import Consumer, Delivery
from rlbus.bus.errors import BusError, ClaimCheckError
from rlbus.bus.kv import KV, Lease
from rlbus.bus.steplog import StepLog
from rlbus.configs.bus import BusConfig
from rlbus.obs import tracing
from rlbus.wire import claims, control
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


class Bus:
    """A connected NATS client scoped to one run (see module docstring)."""

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
        self.step_log = StepLog(self)
        self._consumers: list[Consumer] = []
        self._leases: list[Lease] = []
        self._subscriptions: list = []
        self._ensure_lock = asyncio.Lock()
        self._background: set[asyncio.Task] = set()

    @classmethod
    async def connect(
        cls,
        config: BusConfig,
        *,
        run_id: str | None = None,
        storage_dir: str | Path | None = None,
        name: str = "rlbus",
        ensure: bool = True,
    ) -> "Bus":
        """Connect to `config.url` and ensure the run's streams, consumers and buckets.

        `run_id` defaults to `config.run_id`; `storage_dir` (the run directory, shared by all
        services) is where claim-check payloads go.
        """
        run_id = run_id or config.run_id
        if not run_id:
            raise ValueError("no run id: pass run_id= or set --bus.run-id")
        holder: list[Bus] = []

        async def on_reconnected() -> None:
            if holder and ensure:
                holder[0].ensure_soon()

        nc = await open_connection(config, name=name, on_reconnected=on_reconnected)
        bus = cls(nc, config, RunSubjects(run_id), Path(storage_dir) if storage_dir else None, name)
        holder.append(bus)
        if ensure:
            await bus.ensure()
        return bus

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

    # ---- consuming ------------------------------------------------------------------------

    def consumer(
        self,
        stream: str,
        durable: str,
        decoder: msgspec.msgpack.Decoder,
        handler: Callable[[Delivery], Awaitable[Any]],
        *,
        concurrency: int = 1,
        batch: int | None = None,
        auto_ack: bool = True,
        nak_delay_s: float = 1.0,
        fetch_timeout_s: float = 0.5,
        filter_subject: str | None = None,
    ) -> Consumer:
        """A pull-consumer runner on durable `durable` of `stream` (see `Consumer`).

        Use as `async with bus.consumer(...) as c:` (runs in the background until exit), or
        `await c.run()` (runs until `await c.stop()`).
        """
        consumer = Consumer(
            self,
            stream,
            durable,
            decoder,
            handler,
            concurrency=concurrency,
            batch=batch,
            auto_ack=auto_ack,
            nak_delay_s=nak_delay_s,
            fetch_timeout_s=fetch_timeout_s,
            filter_subject=filter_subject,
        )
        self._consumers.append(consumer)
        return consumer

    async def subscribe(
        self,
        subject: str,
        decoder: msgspec.msgpack.Decoder,
        handler: Callable[[Any, dict[str, str]], Awaitable[Any]],
    ):
        """Live (core NATS) subscription: `handler(message, headers)` for each message published to
        `subject` from now on, stream-backed or not. Nothing is replayed or redelivered: use it for
        notifications (e.g. `subjects.weights_applied`), and a durable `consumer` for work.
        Undecodable messages are logged and skipped. Unsubscribed by `close()`."""

        async def on_msg(msg) -> None:
            headers = msg.headers or {}
            try:
                message = decoder.decode(self.decode_payload(msg.data, headers))
            except (msgspec.DecodeError, ClaimCheckError) as error:
                log.error("notification_undecodable", subject=msg.subject, error=str(error))
                return
            try:
                if tracing.enabled():
                    with tracing.consumer_span(
                        f"notify {msg.subject}", headers=headers, subject=msg.subject
                    ):
                        await handler(message, headers)
                else:
                    await handler(message, headers)
            except Exception as error:
                log.exception("notification_handler_failed", subject=msg.subject, error=repr(error))

        sub = await self.nc.subscribe(subject, cb=on_msg)
        await self.nc.flush()
        self._subscriptions.append(sub)
        return sub

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

    # ---- KV, leases, control ----------------------------------------------------------------

    def kv(self, bucket: str) -> KV:
        """Wrapper of KV bucket `bucket` (e.g. `bus.subjects.weights_bucket`)."""
        return KV(self, bucket)

    def lease(
        self,
        bucket: str,
        key: str,
        value: msgspec.Struct | bytes,
        *,
        ttl_s: int,
        heartbeat_s: float | None = None,
        on_lost: Callable[[], Any] | None = None,
        wait_s: float = 0.0,
    ) -> Lease:
        """A TTL lease on `key` of `bucket`, heartbeated while held (`async with bus.lease(...)`)."""
        lease = Lease(
            self,
            bucket,
            key,
            value,
            ttl_s=ttl_s,
            heartbeat_s=heartbeat_s,
            on_lost=on_lost,
            wait_s=wait_s,
        )
        self._leases.append(lease)
        return lease

    async def request(
        self, service: str, request: control.ControlRequest, *, timeout_s: float = 5.0
    ) -> control.ControlReply:
        """Send a control request to `service` and wait for its reply."""
        headers = tracing.inject_headers({})
        deadline = time.monotonic() + timeout_s
        while (
            True
        ):  # a service that is starting may not listen yet: retry "no responders" until the timeout
            try:
                reply = await self.nc.request(
                    self.subjects.control(service),
                    encode(request),
                    timeout=max(deadline - time.monotonic(), 0.01),
                    headers=headers,
                )
                return control.reply_decoder.decode(reply.data)
            except nats.errors.NoRespondersError:
                if time.monotonic() + 0.1 > deadline:
                    raise
                await asyncio.sleep(0.1)

    async def serve_control(
        self,
        service: str,
        handler: Callable[[control.ControlRequest], Awaitable[control.ControlReply]],
    ) -> None:
        """Answer control requests for `service` with `handler` until the bus closes."""

        async def on_request(msg) -> None:
            try:
                request = control.decoder.decode(msg.data)
            except msgspec.DecodeError as error:
                reply = control.ControlReply(
                    ok=False, service=service, message=f"undecodable request: {error}"
                )
            else:
                with tracing.consumer_span(f"control {service}", headers=msg.headers):
                    reply = await handler(request)
            await msg.respond(encode(reply))

        self._subscriptions.append(
            await self.nc.subscribe(self.subjects.control(service), cb=on_request)
        )
        await self.nc.flush()  # the subscription is live on the server before we return

    async def close(self) -> None:
        """Stop consumers and leases (releasing them), then drain and close the connection."""
        for consumer in self._consumers:
            await consumer.stop()
        for lease in self._leases:
            await lease.release()
        await self.step_log.close()
        for task in list(self._background):
            task.cancel()
        for sub in self._subscriptions:
            try:
                await sub.unsubscribe()
            except Exception:
                pass
        self._subscriptions.clear()
        if self.nc.is_closed:
            return
        if not self.nc.is_connected:  # a dead server must not block shutdown
            await self.nc.close()
            return
        try:
            await asyncio.wait_for(self.nc.drain(), 5.0)
        except Exception as error:
            log.warning("nats_drain_failed", error=repr(error))
            await self.nc.close()
