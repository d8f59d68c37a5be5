"""KV buckets and TTL leases.

`KV` wraps a JetStream KV bucket: get / put / create / compare-and-set update / delete / keys /
watch, with optional msgspec decoding. `Lease` holds a key with a per-key TTL (e.g. an inference
replica's registry entry): `create(msg_ttl)` acquires it, and a heartbeat republishes the value
with the TTL header and `Nats-Expected-Last-Subject-Sequence` (docs/facts.md:
`kv.update()` drops the TTL). When a heartbeat finds another revision (the key expired, or
someone else took it), the lease is lost: `lease.lost` is set and `on_lost` runs. Observers learn
about expiry with `KV.watch_presence()` (polling: TTL expiry writes no marker unless limit markers
are on, which we keep off for lease buckets).

An entry that does not decode (a garbage writer) never ends a `watch` or fails a `get`: it is
quarantined once per revision (`BusCore.dead_letter`, kind from the bucket, e.g.
`weights-record`) with one error line, and treated as absent; the watch goes on.
"""

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

import msgspec
import nats.errors
import nats.js.errors
import structlog

from rlbus.bus.core import BusCore, encode
from rlbus.bus.errors import CasMismatch, LeaseHeld

log = structlog.get_logger()

EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
WRONG_LAST_SEQUENCE_CODES = (10071, 10164)


class Entry(NamedTuple):
    """A KV entry; `value` is None for a delete/purge marker."""

    key: str
    value: Any
    revision: int
    operation: str | None = None


class KV:
    """One KV bucket of the run (see module docstring)."""

    def __init__(self, bus: BusCore, bucket: str):
        self.bus = bus
        self.bucket = bucket
        self._kv = None

    async def handle(self):
        """The underlying nats-py KeyValue (created lazily)."""
        if self._kv is None:
            self._kv = await self.bus.js.key_value(self.bucket)
        return self._kv

    def _decode(self, data: bytes | None, decoder: msgspec.msgpack.Decoder | None) -> Any:
        if data is None or decoder is None:
            return data
        if not data:  # an empty value (e.g. written by a TTL expiry): no value, not garbage
            return None
        return decoder.decode(data)

    async def quarantine(self, key: str, revision: int, data: bytes, error: Exception) -> None:
        """Dead-letter revision `revision` of `key` (undecodable), logging it once per revision.
        A failed copy is logged, never raised: the caller goes on without the entry."""
        reason = f"{type(error).__name__}: {error}"
        try:
            first = await self.bus.dead_letter(
                self.bucket, f"$KV.{self.bucket}.{key}", data, None, reason, stream_seq=revision
            )
        except Exception as dead_error:
            log.error(
                "kv_entry_undecodable",
                bucket=self.bucket,
                key=key,
                revision=revision,
                reason=reason,
                dead_letter_error=repr(dead_error),
            )
            return
        if first:
            log.error(
                "kv_entry_quarantined",
                bucket=self.bucket,
                key=key,
                revision=revision,
                reason=reason,
            )

    async def decode_or_quarantine(
        self, key: str, revision: int, data: bytes, decoder: msgspec.msgpack.Decoder | None
    ) -> tuple[bool, Any]:
        """`(True, value)`, or `(False, None)` for an entry that does not decode (quarantined)."""
        try:
            return True, self._decode(data, decoder)
        except msgspec.DecodeError as error:  # ValidationError is a DecodeError too
            await self.quarantine(key, revision, data, error)
            return False, None

    async def get(self, key: str, decoder: msgspec.msgpack.Decoder | None = None) -> Entry | None:
        """The current entry of `key`, or None when absent/deleted (or undecodable: quarantined)."""
        kv = await self.handle()
        try:
            entry = await kv.get(key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        ok, value = await self.decode_or_quarantine(key, entry.revision, entry.value, decoder)
        return Entry(key, value, entry.revision, entry.operation) if ok else None

    async def put(self, key: str, value: msgspec.Struct | bytes) -> int:
        """Write unconditionally; returns the new revision."""
        return await (await self.handle()).put(key, encode(value))

    async def create(
        self, key: str, value: msgspec.Struct | bytes, *, ttl_s: int | None = None
    ) -> int:
        """Write only if `key` is absent (optionally with a per-key TTL); `CasMismatch` otherwise."""
        try:
            return await (await self.handle()).create(key, encode(value), msg_ttl=ttl_s)
        except nats.js.errors.KeyWrongLastSequenceError as error:
            raise CasMismatch(f"{self.bucket}/{key} already exists") from error

    async def update(self, key: str, value: msgspec.Struct | bytes, *, revision: int) -> int:
        """Compare-and-set: write only if the key is still at `revision`; `CasMismatch` otherwise."""
        try:
            return await (await self.handle()).update(key, encode(value), last=revision)
        except nats.js.errors.KeyWrongLastSequenceError as error:
            raise CasMismatch(f"{self.bucket}/{key} is no longer at revision {revision}") from error

    async def delete(self, key: str, *, revision: int | None = None) -> None:
        await (await self.handle()).delete(key, last=revision)

    async def keys(self) -> list[str]:
        try:
            return await (await self.handle()).keys()
        except nats.js.errors.NoKeysError:
            return []

    async def watch(
        self,
        key: str = ">",
        decoder: msgspec.msgpack.Decoder | None = None,
        *,
        initial: bool = True,
    ) -> AsyncIterator[Entry]:
        """Yield entries as they change (current values first when `initial`); deletes have value
        None; an entry that does not decode is quarantined and skipped (module docstring)."""
        kv = await self.handle()
        watcher = await kv.watch(key)
        try:
            async for entry in watcher:
                if entry is None:  # end of the initial values
                    continue
                if not initial and entry.delta is not None and entry.delta > 0:
                    continue
                value = None
                if entry.operation not in ("DEL", "PURGE"):
                    ok, value = await self.decode_or_quarantine(
                        entry.key, entry.revision, entry.value, decoder
                    )
                    if not ok:
                        continue
                yield Entry(entry.key, value, entry.revision, entry.operation)
        finally:
            await watcher.stop()

    async def watch_presence(self, *, poll_s: float = 1.0) -> AsyncIterator[tuple[str, str]]:
        """Yield `("added", key)` / `("expired", key)` as keys appear and disappear (TTL leases)."""
        known: set[str] = set()
        while True:
            current = set(await self.keys())
            for key in sorted(current - known):
                yield "added", key
            for key in sorted(known - current):
                yield "expired", key
            known = current
            await asyncio.sleep(poll_s)


class Lease:
    """A key held with a TTL and kept alive by heartbeats (`async with bus.lease(...) as lease:`)."""

    def __init__(
        self,
        bus: BusCore,
        bucket: str,
        key: str,
        value: msgspec.Struct | bytes,
        *,
        ttl_s: int,
        heartbeat_s: float | None = None,
        on_lost: Callable[[], Any] | None = None,
        wait_s: float = 0.0,
    ):
        if int(ttl_s) != ttl_s or ttl_s < 1:
            raise ValueError(f"lease ttl_s must be a whole number of seconds >= 1 (got {ttl_s})")
        self.bus = bus
        self.kv = KV(bus, bucket)
        self.bucket = bucket
        self.key = key
        self.value = encode(value)
        self.ttl_s = int(ttl_s)
        self.heartbeat_s = heartbeat_s or self.ttl_s / 3
        self.on_lost = on_lost
        self.wait_s = wait_s
        self.revision: int | None = None
        self.lost = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._renew_lock = asyncio.Lock()
        """`update` and the heartbeat both write with the expected revision: one at a time, or
        the second one fails with 'wrong last sequence' and a live lease looks lost."""

    @property
    def held(self) -> bool:
        return self.revision is not None and not self.lost.is_set()

    async def acquire(self) -> "Lease":
        """Create the key (TTL `ttl_s`); retry for `wait_s` while held by someone else, then `LeaseHeld`."""
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                self.revision = await self.kv.create(self.key, self.value, ttl_s=self.ttl_s)
                break
            except CasMismatch as error:
                if time.monotonic() >= deadline:
                    raise LeaseHeld(
                        f"lease {self.bucket}/{self.key} is held by another holder"
                    ) from error
                await asyncio.sleep(min(0.5, self.ttl_s / 4))
        self.lost.clear()
        self._task = asyncio.create_task(self._heartbeat())
        log.info("lease_acquired", bucket=self.bucket, key=self.key, ttl_s=self.ttl_s)
        return self

    async def update(self, value: msgspec.Struct | bytes) -> None:
        """Replace the held value, keeping the TTL."""
        self.value = encode(value)
        await self._renew()

    async def _renew(self) -> None:
        async with self._renew_lock:
            assert self.revision is not None
            ack = await self.bus.js.publish(
                f"$KV.{self.bucket}.{self.key}",
                self.value,
                headers={EXPECTED_LAST_SUBJECT_SEQ: str(self.revision)},
                msg_ttl=self.ttl_s,
            )
            self.revision = ack.seq

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self._renew()
            except nats.js.errors.APIError as error:
                if error.err_code in WRONG_LAST_SEQUENCE_CODES:
                    await self._mark_lost("revision changed (expired or taken over)")
                    return
                log.warning(
                    "lease_heartbeat_failed", bucket=self.bucket, key=self.key, error=repr(error)
                )
            except (
                Exception
            ) as error:  # disconnected: keep trying; expiry shows up as a wrong revision
                log.warning(
                    "lease_heartbeat_failed", bucket=self.bucket, key=self.key, error=repr(error)
                )

    async def _mark_lost(self, reason: str) -> None:
        log.warning("lease_lost", bucket=self.bucket, key=self.key, reason=reason)
        self.lost.set()
        if self.on_lost is not None:
            result = self.on_lost()
            if asyncio.iscoroutine(result):
                await result

    async def release(self) -> None:
        """Stop heartbeating and delete the key if we still hold it."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self.held:
            try:
                await self.kv.delete(self.key, revision=self.revision)
            except Exception as error:
                log.debug("lease_release_failed", key=self.key, error=repr(error))
        self.revision = None

    async def __aenter__(self) -> "Lease":
        return await self.acquire()

    async def __aexit__(self, *exc) -> None:
        await self.release()
