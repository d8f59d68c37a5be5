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
control request/reply (`control.py`), the run's KV records: the inference replica registry and the
run's end (`records.py`), and stream statistics (`stats.py`). Those modules hold the logic; the
methods here are the one door services use.
"""

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from rlbus.bus import control as bus_control
from rlbus.bus import records
from rlbus.bus.connection import open_connection
from rlbus.bus.consumer import Consumer, Delivery
from rlbus.bus.core import BusCore, unsubscribe_quietly
from rlbus.bus.errors import ClaimCheckError
from rlbus.bus.kv import KV, Lease
from rlbus.bus.stats import StreamStats, read_stream_stats
from rlbus.bus.steplog import StepLog
from rlbus.configs.bus import BusConfig
from rlbus.obs import tracing
from rlbus.wire import control, replicas, run
from rlbus.wire.subjects import RunSubjects

log = structlog.get_logger()


class Bus(BusCore):
    """A connected NATS client scoped to one run (see module docstring)."""

    def __init__(
        self,
        nc: NATS,
        config: BusConfig,
        subjects: RunSubjects,
        storage_dir: Path | None,
        name: str,
    ) -> None:
        super().__init__(nc, config, subjects, storage_dir, name)
        self.step_log = StepLog(self)
        self._consumers: list[Consumer] = []
        self._leases: list[Lease] = []
        self._subscriptions: list[Subscription] = []

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
    ) -> Subscription:
        """Live (core NATS) subscription: `handler(message, headers)` for each message published to
        `subject` from now on, stream-backed or not. Nothing is replayed or redelivered: use it for
        notifications (e.g. `subjects.weights_applied`), and a durable `consumer` for work.
        Undecodable messages are logged and skipped. Unsubscribed by `close()`."""

        async def on_msg(msg: Msg) -> None:
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

    # ---- KV, leases, records, control --------------------------------------------------------

    def kv(self, bucket: str) -> KV:
        """Wrapper of KV bucket `bucket` (e.g. `bus.subjects.weights_bucket`)."""
        return KV(self, bucket)

    async def read_replicas(self) -> list[replicas.ReplicaInfo]:
        """Every inference replica registered now; undecodable entries are quarantined and
        skipped (`records.read_replicas`)."""
        return await records.read_replicas(self)

    async def mark_finished(self, last_step: int) -> None:
        """Record that the run is finished (trainer rank 0, after its last step)."""
        await records.mark_finished(self, last_step)

    async def clear_finished(self) -> None:
        """Forget a finished record (a resumed run with steps left is not finished)."""
        await records.clear_finished(self)

    async def run_finished(self) -> run.RunFinished | None:
        """The run's `RunFinished` record, or None while the run goes on."""
        return await records.run_finished(self)

    async def wait_finished(self, poll_s: float = 2.0) -> run.RunFinished:
        """Return once the run is finished (polled every `poll_s`, through bus outages)."""
        return await records.wait_finished(self, poll_s)

    async def stream_stats(self, stream: str) -> StreamStats:
        """A snapshot of `stream`: its message count and sequences, and the pending and
        ack-pending counts of its durable consumers (queue depth and consumer lag)."""
        return await read_stream_stats(self.js, stream)

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
        return await bus_control.request(self, service, request, timeout_s)

    async def serve_control(self, service: str, handler: bus_control.ControlHandler) -> None:
        """Answer control requests for `service` with `handler` until the bus closes."""
        self._subscriptions.append(await bus_control.serve(self, service, handler))

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
            await unsubscribe_quietly(sub)
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
