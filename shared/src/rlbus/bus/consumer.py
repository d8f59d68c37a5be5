"""Pull-consumer runner: fetch in batches, hand each message to a handler, settle it.

    async def handle(delivery: Delivery[Task]) -> None:
        ...                         # return: acked (auto_ack); raise: nak(nak_delay_s)
    async with bus.consumer(s.tasks_stream, s.tasks_durable, tasks.decoder, handle, concurrency=8):
        await stop_event.wait()

How it behaves:
- at most `concurrency` handlers run at once; each fetch asks only for free slots;
- fetch timeouts (both `nats.errors.TimeoutError` and the builtin `asyncio.TimeoutError`, see
  docs/facts.md) just loop; connection trouble is logged and retried; a vanished
  consumer is re-ensured;
- every delivered but unsettled message (running, or kept by a handler with `auto_ack=False`, e.g.
  rollouts acked only once their batch is stored) gets `in_progress()` every third of AckWait, so
  JetStream does not redeliver work that is still being done;
- a message that cannot be decoded (or whose claim check is corrupt) is copied to the dead-letter
  subject with the reason, terminated, logged, and the loop goes on;
- a handler that raises naks its message with a backoff (`nak_delay_s * 2^(n-1)`, at most
  `MAX_NAK_DELAY_S`); when it raises on delivery `bus.max_deliver` or later (JetStream's count:
  deliveries the handler deferred with `nak()` count too), the message is quarantined the same
  way with the handler's error as reason;
- `stop()` stops fetching, waits for running handlers, and naks messages fetched but not started
  so they are redelivered at once elsewhere.
"""

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from rlbus.bus import claimcheck
from rlbus.bus.core import MSG_ID_HEADER, BusCore, unsubscribe_quietly
from rlbus.bus.errors import ClaimCheckError
from rlbus.obs import tracing
from rlbus.wire.claims import ClaimCheck
from rlbus.wire.subjects import ConsumerSpec

log = structlog.get_logger()

T = TypeVar("T")
FETCH_TIMEOUTS = (nats.errors.TimeoutError, asyncio.TimeoutError, nats.js.errors.FetchTimeoutError)
MAX_NAK_DELAY_S = 30.0
"""Cap of the redelivery backoff of a message whose handler raised."""


def nak_delay(base_s: float, num_delivered: int) -> float:
    """Redelivery delay after the handler raised on delivery `num_delivered` (1-based)."""
    return min(base_s * 2 ** max(num_delivered - 1, 0), MAX_NAK_DELAY_S)


class Delivery(Generic[T]):
    """One delivered message: decoded `data` plus ack/nak/term/in_progress."""

    __slots__ = ("data", "msg", "_consumer", "settled", "claim")

    def __init__(
        self, data: T, msg: Msg, consumer: "Consumer[T]", claim: ClaimCheck | None = None
    ) -> None:
        self.data = data
        self.msg = msg
        self._consumer = consumer
        self.settled = False
        self.claim = claim
        """The claim check the payload came through (its file is deleted once acked)."""

    @property
    def subject(self) -> str:
        return self.msg.subject

    @property
    def headers(self) -> dict[str, str]:
        return self.msg.headers or {}

    @property
    def msg_id(self) -> str | None:
        return self.headers.get(MSG_ID_HEADER)

    @property
    def num_delivered(self) -> int:
        """1 on first delivery, more on redeliveries."""
        return self.msg.metadata.num_delivered

    @property
    def stream_seq(self) -> int:
        """The message's sequence in its stream."""
        return self.msg.metadata.sequence.stream

    def _settle(self) -> None:
        self.settled = True
        self._consumer._unsettled.discard(self)

    async def ack(self, *, sync: bool = False) -> None:
        """Done; never redelivered. `sync=True` waits for the server to confirm. A claim-checked
        message is always acked synchronously, and its file deleted once the server confirmed
        (a lost ack would redeliver it with the file gone)."""
        self._settle()
        if sync or self.claim is not None:
            await self.msg.ack_sync()
        else:
            await self.msg.ack()
        if self.claim is not None:
            claimcheck.discard(self._consumer.bus.storage_dir, self.claim)

    async def nak(self, delay_s: float | None = None) -> None:
        """Not done; redeliver (after `delay_s`)."""
        self._settle()
        await self.msg.nak(delay=delay_s)

    async def term(self, reason: str | None = None) -> None:
        """Never redeliver (a poison message)."""
        self._settle()
        log.warning("message_terminated", subject=self.subject, msg_id=self.msg_id, reason=reason)
        await self.msg.term()

    async def in_progress(self) -> None:
        """Still working: restart the AckWait timer (the consumer also does this periodically)."""
        await self.msg.in_progress()


async def settle_quietly(settling: Awaitable[Any]) -> None:
    """Await an ack/nak/term, logging a failure: a disconnected client cannot settle, and the
    server redelivers after AckWait anyway."""
    try:
        await settling
    except Exception as error:
        log.warning("settle_failed", error=repr(error))


async def run_handler(
    handler: Callable[[Delivery[T]], Awaitable[Any]], delivery: Delivery[T], family: str
) -> None:
    """`handler(delivery)`, inside a CONSUMER span `process <family>` when spans are recorded
    (hot path: no span bookkeeping otherwise)."""
    if not tracing.enabled():
        await handler(delivery)
        return
    with tracing.consumer_span(
        f"process {family}", headers=delivery.msg.headers, subject=delivery.subject
    ):
        await handler(delivery)


async def quarantine(bus: BusCore, stream: str, msg: Msg, reason: str) -> None:
    """Copy `msg` to the dead-letter stream, then terminate it. A failed copy raises and leaves
    the message unsettled: it comes back after AckWait and is tried again."""
    metadata = msg.metadata
    log.error(
        "message_dead_lettered",
        stream=stream,
        subject=msg.subject,
        msg_id=(msg.headers or {}).get(MSG_ID_HEADER),
        num_delivered=metadata.num_delivered,
        reason=reason,
    )
    await bus.dead_letter(
        stream,
        msg.subject,
        msg.data,
        msg.headers,
        reason,
        num_delivered=metadata.num_delivered,
        stream_seq=metadata.sequence.stream,
    )
    await settle_quietly(msg.term())


class Consumer(Generic[T]):
    """Runs `handler` on messages of a durable pull consumer (see module docstring)."""

    def __init__(
        self,
        bus: BusCore,
        stream: str,
        durable: str,
        decoder: msgspec.msgpack.Decoder,
        handler: Callable[[Delivery[T]], Awaitable[Any]],
        *,
        concurrency: int = 1,
        batch: int | None = None,
        auto_ack: bool = True,
        nak_delay_s: float = 1.0,
        fetch_timeout_s: float = 0.5,
        filter_subject: str | None = None,
    ) -> None:
        assert concurrency >= 1
        self.bus = bus
        self.stream = stream
        self.durable = durable
        self.decoder = decoder
        self.handler = handler
        self.concurrency = concurrency
        self.batch = batch or concurrency
        self.auto_ack = auto_ack
        self.nak_delay_s = nak_delay_s
        self.fetch_timeout_s = fetch_timeout_s
        self.filter_subject = filter_subject
        self.num_handled = 0
        self.num_dead = 0
        self._sub: JetStreamContext.PullSubscription | None = None
        self._queue: asyncio.Queue[Msg | None] = asyncio.Queue()
        self._workers: list[asyncio.Task] = []
        self._num_in_flight = 0  # fetched and not yet finished (queued or running)
        self._slot_freed = asyncio.Event()
        self._unsettled: set[Delivery[T]] = set()
        self._stopping = False
        self._task: asyncio.Task | None = None
        self._heartbeat_task: asyncio.Task | None = None

    def _spec(self) -> ConsumerSpec:
        for spec in self.bus.subjects.consumers():
            if (spec.stream, spec.durable) == (self.stream, self.durable):
                return spec
        return ConsumerSpec(self.stream, self.durable, self.filter_subject)

    async def subscribe(self) -> None:
        """Ensure the durable exists and bind a pull subscription to it."""
        await self.bus.ensure_consumer(self._spec())
        if self._sub is not None:  # re-binding after a recovery: drop the old inbox subscription
            await self._unsubscribe()
        self._sub = await self.bus.js.pull_subscribe_bind(durable=self.durable, stream=self.stream)

    async def run(self) -> None:
        """Fetch and dispatch until `stop()`.

        `concurrency` worker tasks take messages from a local queue; a worker whose handler never
        suspends runs a whole fetched batch without a task switch per message (hot path).
        """
        if self._task is None:
            self._task = asyncio.current_task()  # so stop() from elsewhere waits for this loop
        if self._sub is None:
            await self.subscribe()
        self._heartbeat_task = asyncio.create_task(self._heartbeat())
        self._workers = [asyncio.create_task(self._worker()) for _ in range(self.concurrency)]
        log.info(
            "consumer_started",
            stream=self.stream,
            durable=self.durable,
            concurrency=self.concurrency,
        )
        # Fetch only when at least half a batch of handler slots is free (fewer, bigger fetches).
        min_free = max(1, min(self.batch, self.concurrency) // 2)
        while not self._stopping:
            free = self.concurrency - self._num_in_flight
            if free < min_free:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            for msg in await self._fetch(min(self.batch, free)):
                if self._stopping:  # fetched during stop: hand back at once
                    await settle_quietly(msg.nak())
                    continue
                self._num_in_flight += 1
                self._queue.put_nowait(msg)

    async def _worker(self) -> None:
        while True:
            msg = await self._queue.get()
            if msg is None:
                return
            try:
                await self._handle(msg)
            except Exception as error:  # _handle settles; this is a bug or a dead connection
                log.exception("consumer_worker_error", stream=self.stream, error=repr(error))
            finally:
                self._num_in_flight -= 1
                self._slot_freed.set()

    async def _fetch(self, count: int) -> list[Msg]:
        assert self._sub is not None
        try:
            return await self._sub.fetch(count, timeout=self.fetch_timeout_s)
        except FETCH_TIMEOUTS:
            return []
        except nats.js.errors.NotFoundError:
            log.warning("consumer_missing", stream=self.stream, durable=self.durable)
            await self._recover()
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError):
            if not self._stopping:
                log.warning("consumer_connection_closed", stream=self.stream, durable=self.durable)
                await asyncio.sleep(self.fetch_timeout_s)
        except Exception as error:  # server restart, JetStream briefly unavailable, ...
            log.warning(
                "consumer_fetch_failed", stream=self.stream, durable=self.durable, error=repr(error)
            )
            await asyncio.sleep(min(self.fetch_timeout_s, 0.5))
            if isinstance(error, nats.js.errors.ServiceUnavailableError | nats.js.errors.APIError):
                await self._recover()
        return []

    async def _recover(self) -> None:
        try:
            await self.bus.ensure()
            await self.subscribe()
        except Exception as error:
            log.warning("consumer_recover_failed", stream=self.stream, error=repr(error))
            await asyncio.sleep(0.5)

    async def _handle(self, msg: Msg) -> None:
        """Decode `msg` (undecodable: quarantined), run the handler, settle what it left."""
        try:
            claim = self.bus.claim_of(msg.data, msg.headers)
            payload = msg.data if claim is None else claimcheck.load(self.bus.storage_dir, claim)
            data = self.decoder.decode(payload)
        except (msgspec.DecodeError, ClaimCheckError) as error:
            self.num_dead += 1
            await quarantine(self.bus, self.stream, msg, f"{type(error).__name__}: {error}")
            return
        delivery = Delivery(data, msg, self, claim)
        self._unsettled.add(delivery)
        try:
            await run_handler(self.handler, delivery, self.bus.subjects.family(msg.subject))
        except Exception as error:
            await self._after_failure(delivery, error)
        else:
            if self.auto_ack and not delivery.settled:
                await settle_quietly(delivery.ack())
        self.num_handled += 1

    async def _after_failure(self, delivery: Delivery[T], error: Exception) -> None:
        """The handler raised: nak with a backoff, or quarantine from `bus.max_deliver` on."""
        num_delivered = delivery.num_delivered
        max_deliver = self.bus.config.max_deliver
        log.exception(
            "handler_failed",
            stream=self.stream,
            msg_id=delivery.msg_id,
            num_delivered=num_delivered,
            error=repr(error),
        )
        if delivery.settled:
            return
        if num_delivered < max_deliver:
            await settle_quietly(delivery.nak(nak_delay(self.nak_delay_s, num_delivered)))
            return
        delivery._settle()
        self.num_dead += 1
        reason = (
            f"handler failed on {num_delivered} deliveries "
            f"(bus.max_deliver={max_deliver}): {type(error).__name__}: {error}"
        )
        await quarantine(self.bus, self.stream, delivery.msg, reason)

    async def _heartbeat(self) -> None:
        interval = max(self.bus.config.ack_wait_s / 3, 0.2)
        while True:
            await asyncio.sleep(interval)
            for delivery in list(self._unsettled):
                try:
                    await delivery.in_progress()
                except Exception as error:
                    log.debug("in_progress_failed", error=repr(error))

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Stop fetching, nak what was fetched but not started, let running handlers finish
        (cancelled after `timeout_s`; their messages are redelivered after AckWait)."""
        if self._stopping:
            return
        self._stopping = True
        self._slot_freed.set()
        if self._task is not None:
            await self._task
        while not self._queue.empty():  # fetched, never started: redeliver elsewhere at once
            msg = self._queue.get_nowait()
            if msg is not None:
                self._num_in_flight -= 1
                await settle_quietly(msg.nak())
        await self._stop_workers(timeout_s)
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        if self._sub is not None:
            await self._unsubscribe()
        log.info(
            "consumer_stopped",
            stream=self.stream,
            durable=self.durable,
            num_handled=self.num_handled,
        )

    async def _stop_workers(self, timeout_s: float) -> None:
        """Let each worker finish its handler, cancelling those still running after `timeout_s`."""
        for _ in self._workers:
            self._queue.put_nowait(None)
        if not self._workers:
            return
        _, pending = await asyncio.wait(self._workers, timeout=timeout_s)
        for worker in pending:
            worker.cancel()
        if pending:
            log.warning(
                "consumer_handlers_cancelled", stream=self.stream, num_cancelled=len(pending)
            )
            await asyncio.gather(*pending, return_exceptions=True)

    async def _unsubscribe(self) -> None:
        assert self._sub is not None
        await unsubscribe_quietly(self._sub)  # a gone connection took the subscription along

    async def __aenter__(self) -> "Consumer[T]":
        await self.subscribe()
        self._task = asyncio.create_task(self.run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
