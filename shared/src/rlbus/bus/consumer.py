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

from rlbus.bus import claimcheck
from rlbus.bus.core import MSG_ID_HEADER, BusCore
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

    def __init__(self, data: T, msg, consumer: "Consumer", claim: ClaimCheck | None = None):
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
    ):
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
        self._sub = None
        self._queue: asyncio.Queue = asyncio.Queue()
        self._workers: list[asyncio.Task] = []
        self._num_in_flight = 0  # fetched and not yet finished (queued or running)
        self._slot_freed = asyncio.Event()
        self._unsettled: set[Delivery] = set()
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
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass
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
                    await self._settle_quietly(msg.nak())
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

    async def _fetch(self, count: int) -> list:
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

    async def _handle(self, msg) -> None:
        headers = msg.headers
        max_deliver = self.bus.config.max_deliver
        try:
            claim = self.bus.claim_of(msg.data, headers)
            payload = msg.data if claim is None else claimcheck.load(self.bus.storage_dir, claim)
            data = self.decoder.decode(payload)
        except (msgspec.DecodeError, ClaimCheckError) as error:
            await self._dead_letter(msg, f"{type(error).__name__}: {error}")
            return
        delivery = Delivery(data, msg, self, claim)
        self._unsettled.add(delivery)
        try:
            if tracing.enabled():
                with tracing.consumer_span(
                    f"process {self.bus.subjects.family(msg.subject)}",
                    headers=headers,
                    subject=msg.subject,
                ):
                    await self.handler(delivery)
            else:
                await self.handler(delivery)
        except Exception as error:
            num_delivered = delivery.num_delivered
            log.exception(
                "handler_failed",
                stream=self.stream,
                msg_id=delivery.msg_id,
                num_delivered=num_delivered,
                error=repr(error),
            )
            if not delivery.settled:
                if num_delivered >= max_deliver:
                    delivery._settle()
                    await self._dead_letter(
                        msg,
                        f"handler failed on {num_delivered} deliveries "
                        f"(bus.max_deliver={max_deliver}): {type(error).__name__}: {error}",
                    )
                else:
                    delay = nak_delay(self.nak_delay_s, num_delivered)
                    await self._settle_quietly(delivery.nak(delay))
        else:
            if self.auto_ack and not delivery.settled:
                await self._settle_quietly(delivery.ack())
        self.num_handled += 1

    async def _dead_letter(self, msg, reason: str) -> None:
        """Quarantine `msg` (copy to the dead-letter stream), then terminate it. A failed copy
        leaves the message unsettled: it comes back after AckWait and is tried again."""
        self.num_dead += 1
        metadata = msg.metadata
        log.error(
            "message_dead_lettered",
            stream=self.stream,
            subject=msg.subject,
            msg_id=(msg.headers or {}).get(MSG_ID_HEADER),
            num_delivered=metadata.num_delivered,
            reason=reason,
        )
        await self.bus.dead_letter(
            self.stream,
            msg.subject,
            msg.data,
            msg.headers,
            reason,
            num_delivered=metadata.num_delivered,
            stream_seq=metadata.sequence.stream,
        )
        await self._settle_quietly(msg.term())

    @staticmethod
    async def _settle_quietly(coro) -> None:
        try:
            await coro
        except Exception as error:  # disconnected: the server redelivers after AckWait anyway
            log.warning("settle_failed", error=repr(error))

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
                await self._settle_quietly(msg.nak())
        for _ in self._workers:
            self._queue.put_nowait(None)
        if self._workers:
            done, pending = await asyncio.wait(self._workers, timeout=timeout_s)
            for worker in pending:
                worker.cancel()
            if pending:
                log.warning(
                    "consumer_handlers_cancelled", stream=self.stream, num_cancelled=len(pending)
                )
                await asyncio.gather(*pending, return_exceptions=True)
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass
        log.info(
            "consumer_stopped",
            stream=self.stream,
            durable=self.durable,
            num_handled=self.num_handled,
        )

    async def __aenter__(self) -> "Consumer[T]":
        await self.subscribe()
        self._task = asyncio.create_task(self.run())
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()
