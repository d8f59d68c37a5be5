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
duplicate. That connection-level part is `BusCore` (core.py); `Bus` adds what is built on it:
consumers (`consumer.py`), the step log (`steplog.py`), KV/leases (`kv.py`), live subscriptions,
control request/reply and the inference replica registry (`read_replicas`).
"""

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import structlog

from rlbus.bus.connection import open_connection
from rlbus.bus.consumer import Consumer, Delivery
from rlbus.bus.core import BusCore, encode
from rlbus.bus.errors import BusError, ClaimCheckError
from rlbus.bus.kv import KV, Lease
from rlbus.bus.steplog import StepLog
from rlbus.configs.bus import BusConfig
from rlbus.obs import tracing
from rlbus.wire import control, replicas, run
from rlbus.wire.subjects import RUN_FINISHED_KEY, RunSubjects

log = structlog.get_logger()


class Bus(BusCore):
    """A connected NATS client scoped to one run (see module docstring)."""

    def __init__(
        self, nc, config: BusConfig, subjects: RunSubjects, storage_dir: Path | None, name: str
    ):
        super().__init__(nc, config, subjects, storage_dir, name)
        self.step_log = StepLog(self)
        self._consumers: list[Consumer] = []
        self._leases: list[Lease] = []
        self._subscriptions: list = []

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
                        f"notify {self.subjects.family(msg.subject)}",
                        headers=headers,
                        subject=msg.subject,
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

    # ---- KV, leases, control ----------------------------------------------------------------

    def kv(self, bucket: str) -> KV:
        """Wrapper of KV bucket `bucket` (e.g. `bus.subjects.weights_bucket`)."""
        return KV(self, bucket)

    async def read_replicas(self) -> list[replicas.ReplicaInfo]:
        """Every inference replica registered now (the leases in `subjects.replicas_bucket`).

        An entry that does not decode is skipped and quarantined (once per key and revision, kind
        `replica-entry`), so one bad writer cannot hide the other replicas from the rollout
        workers and the trainer."""
        kv = self.kv(self.subjects.replicas_bucket)
        infos = []
        for key in await kv.keys():
            entry = await kv.get(key, replicas.decoder)
            if entry is None or entry.value is None:  # expired between keys() and get(), or garbage
                continue
            infos.append(entry.value)
        return infos

    async def mark_finished(self, last_step: int) -> None:
        """Record that the run is finished (trainer rank 0, after its last step)."""
        kv = self.kv(self.subjects.state_bucket)
        await kv.put(RUN_FINISHED_KEY, run.RunFinished(last_step=last_step))
        log.info("run_marked_finished", last_step=last_step)

    async def clear_finished(self) -> None:
        """Forget a finished record (a resumed run with steps left is not finished)."""
        kv = self.kv(self.subjects.state_bucket)
        if await kv.get(RUN_FINISHED_KEY) is not None:
            await kv.delete(RUN_FINISHED_KEY)
            log.info("run_finished_cleared")

    async def run_finished(self) -> run.RunFinished | None:
        """The run's `RunFinished` record, or None while the run goes on."""
        entry = await self.kv(self.subjects.state_bucket).get(RUN_FINISHED_KEY, run.decoder)
        return entry.value if entry is not None else None

    async def wait_finished(self, poll_s: float = 2.0) -> run.RunFinished:
        """Return once the run is finished. Polled (one direct get per `poll_s`): a bus outage
        only delays the answer (each failed read is logged once per outage)."""
        failing = False
        while True:
            try:
                record = await self.run_finished()
                failing = False
            except Exception as error:  # an outage: keep asking
                if not failing:
                    log.warning("run_finished_unreadable", error=repr(error))
                failing = True
                record = None
            if record is not None:
                return record
            await asyncio.sleep(poll_s)

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
        grace_s: float | None = None,
    ) -> Lease:
        """A TTL lease on `key` of `bucket`, heartbeated while held (`async with bus.lease(...)`);
        it survives a NATS outage shorter than `grace_s` (default `bus.lease_grace_s`)."""
        lease = Lease(
            self,
            bucket,
            key,
            value,
            ttl_s=ttl_s,
            heartbeat_s=heartbeat_s,
            on_lost=on_lost,
            wait_s=wait_s,
            grace_s=grace_s,
        )
        self._leases.append(lease)
        return lease

    async def request(
        self, service: str, request: control.ControlRequest, *, timeout_s: float = 5.0
    ) -> control.ControlReply:
        """Send a control request to `service` and wait at most `timeout_s` for its reply.

        A service that is not listening yet ("no responders") or a connection that is
        reconnecting is retried until the deadline; then the error is raised with a log line
        naming the service and how long it waited."""
        headers = tracing.inject_headers({})
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            try:
                reply = await self.nc.request(
                    self.subjects.control(service),
                    encode(request),
                    timeout=max(deadline - time.monotonic(), 0.01),
                    headers=headers,
                )
            except (
                nats.errors.NoRespondersError,
                nats.errors.ConnectionReconnectingError,
                nats.errors.TimeoutError,
            ) as error:
                if time.monotonic() + 0.1 > deadline:
                    log.warning(
                        "control_request_timeout",
                        service=service,
                        waited_s=round(time.monotonic() - started, 1),
                        error=type(error).__name__,
                    )
                    raise
                await asyncio.sleep(0.1)
                continue
            try:
                return control.reply_decoder.decode(reply.data)
            except msgspec.DecodeError as error:  # a garbage reply is the replier's bug: say so
                raise BusError(f"the control reply of {service} does not decode: {error}") from None

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
                with tracing.consumer_span("control", headers=msg.headers, subject=msg.subject):
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
