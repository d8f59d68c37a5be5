"""Raw updates of a KV key through NATS outages: the transport half of `KV.watch`.

nats-py's watcher does not always come back after an outage (it cannot re-create its consumer
while the server is away) and then waits forever. So a watch that got nothing for `check_s`
compares the newest revision in the bucket with the last one it yielded and, when it fell
behind, starts a new nats-py watcher, yielding only revisions it had not yielded: nothing twice,
nothing lost beyond intermediate values of one key. Decoding and quarantine are `KV`'s part
(kv.py); this module imports no other bus module.
"""

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass

import nats.errors
import nats.js.errors
import structlog
from nats.js.kv import KeyValue

log = structlog.get_logger()

OpenBucket = Callable[[], Awaitable[KeyValue]]
"""Returns the nats-py handle of the watched bucket (`KV.handle`)."""


@dataclass
class WatchCursor:
    """Where a watch is, across the nats-py watchers it starts."""

    initial: bool
    """Whether the caller wants the current values first."""
    last_revision: int = 0
    first_watcher: bool = True


async def watch_updates(
    open_bucket: OpenBucket, bucket: str, key: str, *, initial: bool, check_s: float
) -> AsyncGenerator[KeyValue.Entry, None]:
    """Every new revision of `key` (a wildcard: of any key) of `bucket`, delete markers
    included; the current values first when `initial`."""
    cursor = WatchCursor(initial=initial)
    while True:
        watcher = await start_watcher(open_bucket, bucket, key, check_s)
        try:
            async for update in updates_until_behind(
                open_bucket, watcher, bucket, key, cursor, check_s
            ):
                yield update
        finally:
            cursor.first_watcher = False
            try:
                await watcher.stop()
            except Exception:  # the server is away: the watcher dies with the connection
                pass


async def start_watcher(
    open_bucket: OpenBucket, bucket: str, key: str, check_s: float
) -> KeyValue.KeyWatcher:
    """A nats-py watcher of `key`, retried while the server is away."""
    while True:
        try:
            return await (await open_bucket()).watch(key)
        except Exception as error:  # the server is away: try again
            log.warning("kv_watch_start_failed", bucket=bucket, key=key, error=repr(error))
            await asyncio.sleep(min(check_s, 1.0))


async def updates_until_behind(
    open_bucket: OpenBucket,
    watcher: KeyValue.KeyWatcher,
    bucket: str,
    key: str,
    cursor: WatchCursor,
    check_s: float,
) -> AsyncGenerator[KeyValue.Entry, None]:
    """New updates of `watcher` (none twice across watchers, no initial values unless wanted),
    until it falls behind the bucket."""
    while True:
        try:
            update = await watcher.updates(timeout=check_s)
        except (TimeoutError, nats.errors.TimeoutError):
            if await fell_behind(open_bucket, bucket, key, cursor.last_revision):
                log.warning(
                    "kv_watch_restarted", bucket=bucket, key=key, after=cursor.last_revision
                )
                return
            continue
        if update is None:  # the end of the initial values
            continue
        revision = update.revision or 0
        if revision <= cursor.last_revision:
            continue
        skip_initial = cursor.first_watcher and not cursor.initial
        if skip_initial and update.delta is not None and update.delta > 0:
            continue
        cursor.last_revision = revision
        yield update


async def fell_behind(open_bucket: OpenBucket, bucket: str, key: str, last_revision: int) -> bool:
    """Whether `bucket` holds a revision of `key` (any key for a wildcard) newer than
    `last_revision` (False when the server cannot say now: the watch keeps waiting)."""
    try:
        handle = await open_bucket()
        if "*" in key or ">" in key:
            return (await handle.status()).stream_info.state.last_seq > last_revision
        return ((await handle.get(key)).revision or 0) > last_revision
    except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
        return False
    except Exception as error:
        log.debug("kv_watch_check_failed", bucket=bucket, error=repr(error))
        return False
