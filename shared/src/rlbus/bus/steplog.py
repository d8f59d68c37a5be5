"""Step-keyed log of train batches: one message per step subject in a limits-retention stream.

The orchestrator calls `publish(batch)` once per step (`batch-<step>` message id, and a direct
get before publishing, so repeats are no-ops even after the dedup window). The trainer calls
`get(step)`, which reads `rlbus.<run>.batches.<step>` by direct get and, while it is absent,
waits for a core-NATS notification of that subject (polling as a fallback across reconnects).
Nothing is consumed, so a trainer restarted from checkpoint K simply reads K+1, K+2, ...

A stored entry that cannot be decoded (garbage bytes, a claim check whose file is missing or
corrupt) raises `PoisonBatch` with the stored bytes and headers, never a bare decode error: the
trainer quarantines it on the dead-letter stream and skips the step (docs/trainer.md).
"""

import asyncio
import time

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api

from rlbus.bus import claimcheck
from rlbus.bus.core import BusCore, unsubscribe_quietly
from rlbus.bus.errors import ClaimCheckError, PoisonBatch, StepNotFound
from rlbus.wire import batches

log = structlog.get_logger()

TRANSIENT_READ_ERRORS = (
    TimeoutError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.js.errors.ServiceUnavailableError,
)
"""A read that got no answer (server restarting, reconnecting): the step may well be stored."""


class StepLog:
    """Read/write access to the run's batches stream (see module docstring)."""

    def __init__(self, bus: BusCore, poll_s: float = 0.5) -> None:
        self.bus = bus
        self.poll_s = poll_s
        self._arrived = asyncio.Event()
        self._sub: Subscription | None = None

    async def publish(self, batch: batches.TrainBatch) -> bool:
        """Store `batch` as step `batch.step`; False when that step was already stored."""
        if await self._raw(batch.step) is not None:
            log.info("batch_already_stored", step=batch.step)
            return False
        subjects = self.bus.subjects
        ack = await self.bus.publish(
            subjects.batch(batch.step), batch, msg_id=subjects.batch_msg_id(batch.step)
        )
        return not ack.duplicate

    async def get(self, step: int, *, timeout_s: float | None = None) -> batches.TrainBatch:
        """Step `step`'s batch, waiting up to `timeout_s` (forever: None) for it to be published."""
        batch, _ = await self.get_with_headers(step, timeout_s=timeout_s)
        return batch

    async def get_with_headers(
        self, step: int, *, timeout_s: float | None = None
    ) -> tuple[batches.TrainBatch, dict[str, str]]:
        """Like `get`, plus the message headers (trace context for a span link/parent)."""
        await self._subscribe()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._arrived.clear()
            try:
                raw = await self._raw(step)
            except TRANSIENT_READ_ERRORS as error:  # waiting anyway: try again next round
                log.warning("step_log_read_retry", step=step, error=type(error).__name__)
                raw = None
            if raw is not None:
                headers = dict(raw.headers or {})
                return self.decode(step, raw.data or b"", headers), headers
            wait = self.poll_s
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    raise StepNotFound(f"no batch for step {step} within {timeout_s}s")
            try:
                await asyncio.wait_for(self._arrived.wait(), wait)
            except TimeoutError:
                pass

    async def read(self, step: int) -> batches.TrainBatch | None:
        """Step `step`'s batch if stored, else None (no waiting). A read that gets no answer
        raises (a timeout is not "absent": the coordinator would rebuild a stored step)."""
        raw = await self._raw(step)
        if raw is None:
            return None
        return self.decode(step, raw.data or b"", dict(raw.headers or {}))

    def decode(self, step: int, data: bytes, headers: dict[str, str]) -> batches.TrainBatch:
        """The `TrainBatch` of a stored entry; `PoisonBatch` (with the stored bytes) when it
        cannot be one. A retry would meet the same bytes, so this is never transient."""
        try:
            return batches.decoder.decode(self.bus.decode_payload(data, headers))
        except (msgspec.DecodeError, ClaimCheckError) as error:
            reason = f"{type(error).__name__}: {error}"
            raise PoisonBatch(step, self.bus.subjects.batch(step), data, headers, reason) from None

    async def stored(self, step: int) -> tuple[bytes, dict[str, str]] | None:
        """The stored bytes and headers of step `step` as they are on the stream (a claim check
        stays a reference), for dead-lettering an entry that decodes but is unusable."""
        raw = await self._raw(step)
        return None if raw is None else (raw.data or b"", dict(raw.headers or {}))

    async def exists(self, step: int) -> bool:
        """Whether step `step`'s batch is stored."""
        return await self._raw(step) is not None

    async def last_step(self) -> int | None:
        """Highest step stored in the log (None when empty)."""
        subjects = self.bus.subjects
        info = await self.bus.js.stream_info(
            subjects.batches_stream, subjects_filter=subjects.batches_all
        )
        steps = [int(subject.rsplit(".", 1)[1]) for subject in (info.state.subjects or {})]
        return max(steps) if steps else None

    def discard_claims(self, through_step: int) -> list[str]:
        """Delete the claim-check files of the batches of steps <= `through_step`: the trainer
        calls it once no checkpoint it may resume from precedes them. Returns their subjects."""
        prefix = self.bus.subjects.batch(0).removesuffix("0")

        def doomed(subject: str) -> bool:
            step = subject.removeprefix(prefix)
            return subject.startswith(prefix) and step.isdigit() and int(step) <= through_step

        removed = claimcheck.discard_subjects(self.bus.storage_dir, doomed)
        if removed:
            log.info("batch_claims_deleted", through_step=through_step, subjects=len(removed))
        return removed

    async def _raw(self, step: int) -> api.RawStreamMsg | None:
        subjects = self.bus.subjects
        return await self.bus.last_stored(subjects.batches_stream, subjects.batch(step))

    async def _subscribe(self) -> None:
        if self._sub is None:

            async def on_batch(msg: Msg) -> None:
                self._arrived.set()

            self._sub = await self.bus.nc.subscribe(self.bus.subjects.batches_all, cb=on_batch)

    async def close(self) -> None:
        if self._sub is not None:
            await unsubscribe_quietly(self._sub)
            self._sub = None
