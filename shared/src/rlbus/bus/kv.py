"""KV buckets and TTL leases.

`KV` wraps a JetStream KV bucket: get / put / create / compare-and-set update / delete / keys /
watch, with optional msgspec decoding. `Lease` holds a key with a per-key TTL (e.g. an inference
replica's registry entry): `create(msg_ttl)` acquires it, and a heartbeat republishes the value
with the TTL header and `Nats-Expected-Last-Subject-Sequence` (docs/facts.md:
`kv.update()` drops the TTL). When a heartbeat finds another revision (the key expired, or
someone else took it), the lease is lost: `lease.lost` is set and `on_lost` runs; except after a
NATS outage shorter than `bus.lease_grace_s` (counted from the last good heartbeat), when an
expired key is re-created and a revision holding our own value is adopted. Observers learn
about expiry with `KV.watch_presence()` (polling: TTL expiry writes no marker unless limit markers
are on, which we keep off for lease buckets).

An entry that does not decode (a garbage writer) never ends a `watch` or fails a `get`: it is
quarantined once per revision (`BusCore.dead_letter`, kind from the bucket, e.g.
`weights-record`) with one error line, and treated as absent; the watch goes on.
"""

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from functools import partial
from typing import Any, NamedTuple

import msgspec
import nats.js.errors
import structlog
from nats.js import api
from nats.js.kv import KeyValue

from rlbus.bus.core import RETRYABLE_PUBLISH_ERRORS, BusCore, encode, retry_transient
from rlbus.bus.errors import CasMismatch, LeaseHeld
from rlbus.bus.kvwatch import watch_updates

log = structlog.get_logger()

EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
WRONG_LAST_SEQUENCE_CODES = (10071, 10164)
DELETED = ("DEL", "PURGE")
"""`KV-Operation` header values of a delete marker."""
WATCH_CHECK_S = 5.0
"""A watch that got nothing for this long checks whether the bucket moved on without it (a
watcher nats-py could not re-create during an outage) and, if so, starts a new one (kvwatch.py)."""
KV_RETRY_ERRORS = RETRYABLE_PUBLISH_ERRORS
"""Errors after which a get/put/delete/keys is retried (until `bus.publish_retry_s`)."""


class Entry(NamedTuple):
    """A KV entry; `value` is None for a delete/purge marker."""

    key: str
    value: Any
    revision: int
    operation: str | None = None


class KV:
    """One KV bucket of the run (see module docstring)."""

    def __init__(self, bus: BusCore, bucket: str) -> None:
        self.bus = bus
        self.bucket = bucket
        self._kv: KeyValue | None = None

    async def handle(self) -> KeyValue:
        """The underlying nats-py KeyValue (created lazily)."""
        if self._kv is None:
            self._kv = await self.bus.js.key_value(self.bucket)
        return self._kv

    async def _retried(
        self, what: str, key: str, operation: Callable[[KeyValue], Awaitable[Any]]
    ) -> Any:
        """`await operation(kv)`, retried on connection trouble until `bus.publish_retry_s` (a NATS
        outage is waited out, with a log line naming what waits). Safe for get/put/delete/keys:
        repeating one changes nothing a reader sees (a put may add a revision of the same value)."""
        return await retry_transient(
            what,
            lambda: self._run(operation),
            within_s=self.bus.config.publish_retry_s,
            event="kv_retry",
            bucket=self.bucket,
            key=key,
        )

    async def _run(self, operation: Callable[[KeyValue], Awaitable[Any]]) -> Any:
        return await operation(await self.handle())

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
        self, key: str, revision: int, data: bytes | None, decoder: msgspec.msgpack.Decoder | None
    ) -> tuple[bool, Any]:
        """`(True, value)`, or `(False, None)` for an entry that does not decode (quarantined)."""
        try:
            return True, self._decode(data, decoder)
        except msgspec.DecodeError as error:  # ValidationError is a DecodeError too
            await self.quarantine(key, revision, data or b"", error)
            return False, None

    async def get(self, key: str, decoder: msgspec.msgpack.Decoder | None = None) -> Entry | None:
        """The current entry of `key`, or None when absent/deleted (or undecodable: quarantined)."""
        try:
            entry = await self._retried("get", key, lambda kv: kv.get(key))
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        ok, value = await self.decode_or_quarantine(key, entry.revision, entry.value, decoder)
        return Entry(key, value, entry.revision, entry.operation) if ok else None

    async def put(self, key: str, value: msgspec.Struct | bytes) -> int:
        """Write unconditionally; returns the new revision."""
        payload = encode(value)
        return await self._retried("put", key, lambda kv: kv.put(key, payload))

    async def create(
        self,
        key: str,
        value: msgspec.Struct | bytes,
        *,
        ttl_s: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> int:
        """Write only if `key` is absent (optionally with a per-key TTL); `CasMismatch` otherwise.
        `headers` travel with the record (trace context: `headers_of(revision)` reads them)."""
        if headers:
            try:
                return await self._write(key, encode(value), 0, headers)
            except CasMismatch:
                last = await self._last_message(key)
                if last is None or (last.headers or {}).get("KV-Operation") not in DELETED:
                    raise CasMismatch(f"{self.bucket}/{key} already exists") from None
                return await self._write(key, encode(value), last.seq or 0, headers)
        try:
            return await (await self.handle()).create(key, encode(value), msg_ttl=ttl_s)
        except nats.js.errors.KeyWrongLastSequenceError as error:
            raise CasMismatch(f"{self.bucket}/{key} already exists") from error

    async def update(
        self,
        key: str,
        value: msgspec.Struct | bytes,
        *,
        revision: int,
        headers: dict[str, str] | None = None,
    ) -> int:
        """Compare-and-set: write only if the key is still at `revision`; `CasMismatch` otherwise.
        `headers` travel with the record, as in `create`."""
        if headers:
            return await self._write(key, encode(value), revision, headers)
        try:
            return await (await self.handle()).update(key, encode(value), last=revision)
        except nats.js.errors.KeyWrongLastSequenceError as error:
            raise CasMismatch(f"{self.bucket}/{key} is no longer at revision {revision}") from error

    async def _write(self, key: str, payload: bytes, last: int, headers: dict[str, str]) -> int:
        """A compare-and-set write carrying `headers` (nats-py's KV API sends none of its own)."""
        try:
            ack = await self.bus.js.publish(
                f"$KV.{self.bucket}.{key}",
                payload,
                headers={**headers, EXPECTED_LAST_SUBJECT_SEQ: str(last)},
            )
        except nats.js.errors.APIError as error:
            if error.err_code in WRONG_LAST_SEQUENCE_CODES:
                raise CasMismatch(f"{self.bucket}/{key} is no longer at revision {last}") from None
            raise
        return ack.seq

    async def _last_message(self, key: str) -> api.RawStreamMsg | None:
        """The newest raw message of `key` (a delete marker included), or None."""
        try:
            return await self.bus.js.get_last_msg(f"KV_{self.bucket}", f"$KV.{self.bucket}.{key}")
        except nats.js.errors.NotFoundError:
            return None

    async def headers_of(self, revision: int) -> dict[str, str]:
        """The headers stored with revision `revision` (empty when it is gone or has none)."""
        try:
            message = await self.bus.js.get_msg(f"KV_{self.bucket}", seq=revision, direct=True)
        except nats.js.errors.NotFoundError:
            return {}
        return dict(message.headers or {})

    async def delete(self, key: str, *, revision: int | None = None) -> None:
        """Delete `key` (only if still at `revision`, when given)."""
        await self._retried("delete", key, lambda kv: kv.delete(key, last=revision))

    async def keys(self) -> list[str]:
        """Keys holding a value now (not deleted, purged or expired to an empty marker).

        Read from the stream's subject index plus one direct get per key, never through a
        consumer: nats-py's `kv.keys()` creates an ephemeral consumer per call that outlives the
        call, and a rollout worker polling an empty registry twice a second reached the server's
        limit (`maximum consumers limit reached`, error 10026) in under 30 s, after which every
        registry read failed for minutes (docs/bus.md, "KV")."""
        stream = f"KV_{self.bucket}"
        prefix = f"$KV.{self.bucket}."

        async def subjects(_kv: KeyValue) -> list[str]:
            info = await self.bus.js.stream_info(stream, subjects_filter=prefix + ">")
            return sorted(info.state.subjects or {})

        live = []
        for subject in await self._retried("keys", ">", subjects):
            key = subject[len(prefix) :]
            try:
                entry = await self._retried("get", key, partial(KeyValue.get, key=key))
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                continue
            if entry.value:
                live.append(key)
        return live

    async def watch(
        self,
        key: str = ">",
        decoder: msgspec.msgpack.Decoder | None = None,
        *,
        initial: bool = True,
        check_s: float = WATCH_CHECK_S,
    ) -> AsyncIterator[Entry]:
        """Yield entries as they change (current values first when `initial`); deletes have value
        None; an entry that does not decode is quarantined and skipped (module docstring).

        Survives NATS outages (kvwatch.py): after `check_s` without an entry the watch checks
        whether the bucket moved on without it and, if so, starts a new nats-py watcher,
        yielding nothing twice."""
        updates = watch_updates(self.handle, self.bucket, key, initial=initial, check_s=check_s)
        async with aclosing(updates):  # closing the watch stops the nats-py watcher at once
            async for update in updates:
                value = None
                if update.operation not in DELETED:
                    ok, value = await self.decode_or_quarantine(
                        update.key, update.revision or 0, update.value, decoder
                    )
                    if not ok:
                        continue
                yield Entry(update.key, value, update.revision or 0, update.operation)

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
        grace_s: float | None = None,
    ) -> None:
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
        self.grace_s = bus.config.lease_grace_s if grace_s is None else grace_s
        self.revision: int | None = None
        self._renewed_at = 0.0
        """monotonic time of the last acquire or heartbeat the server confirmed."""
        self.lost = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._renew_lock = asyncio.Lock()
        """`update` and the heartbeat both write with the expected revision: one at a time, or
        the second one fails with 'wrong last sequence' and a live lease looks lost."""

    @property
    def held(self) -> bool:
        """Whether this lease holds its key now (acquired, not lost, not released)."""
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
        self._renewed_at = time.monotonic()
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
            self._renewed_at = time.monotonic()

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self._renew()
            except nats.js.errors.APIError as error:
                if error.err_code in WRONG_LAST_SEQUENCE_CODES:
                    if await self._recover_after_outage():
                        continue
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

    async def _recover_after_outage(self) -> bool:
        """After a wrong-revision heartbeat within `grace_s` of the last good one: keep the lease
        if the key expired (re-create it) or holds our own value (adopt its revision)."""
        out_for = time.monotonic() - self._renewed_at
        if out_for > self.grace_s:
            return False
        try:
            return await self._take_back(out_for)
        except Exception as error:  # taken meanwhile (CasMismatch), or the server is away again
            log.warning("lease_recover_failed", bucket=self.bucket, key=self.key, error=repr(error))
            return isinstance(error, RETRYABLE_PUBLISH_ERRORS)

    async def reclaim(self) -> bool:
        """After the lease was lost: hold it again if no one else does (the key expired, or holds
        this lease's own value) and heartbeat again: True; False if another holder has it. Bus
        errors propagate (ask again later). For a holder that would notice a rival's work anyway
        (the coordinator: step-log writes are conditional, docs/orchestrator.md)."""
        if not self.lost.is_set():
            return self.held
        try:
            if not await self._take_back(time.monotonic() - self._renewed_at):
                return False
        except CasMismatch:  # created by another holder between our get and create
            return False
        self.lost.clear()
        if self._task is not None:
            self._task.cancel()
        self._task = asyncio.create_task(self._heartbeat())
        return True

    async def _take_back(self, out_for: float) -> bool:
        """Re-create the expired key, or adopt the revision of a key that holds our own value;
        False when the key holds another value."""
        current = await self.kv.get(self.key)
        if current is None:
            async with self._renew_lock:
                self.revision = await self.kv.create(self.key, self.value, ttl_s=self.ttl_s)
                self._renewed_at = time.monotonic()
            how = "recreated"
        elif current.value == self.value:
            self.revision = current.revision
            self._renewed_at = time.monotonic()
            how = "adopted"
        else:
            return False
        log.warning(
            "lease_kept_after_outage",
            bucket=self.bucket,
            key=self.key,
            how=how,
            out_for_s=round(out_for, 1),
            revision=self.revision,
        )
        return True

    async def _mark_lost(self, reason: str) -> None:
        log.warning("lease_lost", bucket=self.bucket, key=self.key, reason=reason)
        self.lost.set()
        if self.on_lost is not None:
            result = self.on_lost()
            if asyncio.iscoroutine(result):
                await result

    async def release(self) -> None:
        """Stop heartbeating and delete the key if we still hold it. Under the renew lock: a
        heartbeat cancelled in flight may have stored a newer revision than the one we would
        delete, and the entry would stay registered (a phantom) until its TTL."""
        async with self._renew_lock:
            if self._task is not None:
                self._task.cancel()
                self._task = None
            if self.held:
                try:
                    await self.kv.delete(self.key, revision=self.revision)
                except Exception as error:
                    log.warning("lease_release_failed", key=self.key, error=repr(error))
            self.revision = None

    async def __aenter__(self) -> "Lease":
        return await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        await self.release()
