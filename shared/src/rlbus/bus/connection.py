"""Opening the NATS connection: auth/TLS options from `BusConfig`, reconnect forever, logged callbacks."""

import asyncio
import ssl
import time
from collections.abc import Awaitable, Callable

import structlog
from nats.aio.client import Client as NATS

from rlbus.bus.errors import BusAuthError, BusConnectError
from rlbus.configs.bus import BusConfig

log = structlog.get_logger()


def tls_context(config: BusConfig) -> ssl.SSLContext | None:
    """Client TLS context from `bus.tls_ca` / `bus.tls_cert` / `bus.tls_key` (None without TLS)."""
    if not (config.tls_ca or config.tls_cert):
        return None
    context = ssl.create_default_context(cafile=config.tls_ca)
    if config.tls_cert:
        context.load_cert_chain(config.tls_cert, config.tls_key)
    return context


def connect_options(config: BusConfig, *, name: str) -> dict:
    """Keyword arguments for `nats.connect` (without the callbacks)."""
    if config.url is None:
        raise ValueError(
            "bus.url is unset: pass --bus.url nats://HOST:PORT (the `rl` launcher sets it)"
        )
    options: dict = dict(
        servers=[config.url],
        name=name,
        connect_timeout=config.connect_timeout_s,
        # The first connection fails fast (our loop retries it, and stops at bad credentials,
        # which nats-py would otherwise retry forever); `enable_reconnect_forever` flips these
        # once connected, so a restarted server never kills a service.
        allow_reconnect=False,
        max_reconnect_attempts=1,
        reconnect_time_wait=config.reconnect_wait_s,
        # Buffer while disconnected: at least two maximum-size messages (the default is 2 MiB:
        # docs/facts.md).
        pending_size=max(2 * config.max_payload_mb, 16) * 1024 * 1024,
        ping_interval=config.ping_interval_s,
        max_outstanding_pings=3,
    )
    if config.token:
        options["token"] = config.token
    if config.user:
        options["user"] = config.user
        options["password"] = config.password
    if config.creds_file:
        options["user_credentials"] = config.creds_file
    tls = tls_context(config)
    if tls is not None:
        options["tls"] = tls
    return options


def is_auth_error(error: BaseException) -> bool:
    text = str(error).lower()
    return (
        "authorization" in text
        or "authentication" in text
        or "auth" in type(error).__name__.lower()
    )


async def open_connection(
    config: BusConfig, *, name: str, on_reconnected: Callable[[], Awaitable[None]] | None = None
) -> NATS:
    """Connect, retrying refused connections for `bus.connect_retry_s`; bad credentials fail at once.

    `on_reconnected` runs after every reconnect (the Bus re-ensures its streams there: a server
    restarted on an empty store would otherwise have none)."""
    options = connect_options(config, name=name)
    url = config.url
    auth_failed: list[BaseException] = []

    async def on_error(error: BaseException) -> None:
        if is_auth_error(error):
            auth_failed.append(error)
        log.warning("nats_error", error=str(error) or type(error).__name__, url=url)

    async def on_disconnected() -> None:
        log.warning("nats_disconnected", url=url)

    async def on_reconnected_cb() -> None:
        log.info("nats_reconnected", url=url)
        if on_reconnected is not None:
            await on_reconnected()

    async def on_closed() -> None:
        log.info("nats_closed", url=url)

    deadline = time.monotonic() + config.connect_retry_s
    while True:
        nc = NATS()
        try:
            await nc.connect(
                **options,
                error_cb=on_error,
                disconnected_cb=on_disconnected,
                reconnected_cb=on_reconnected_cb,
                closed_cb=on_closed,
            )
            enable_reconnect_forever(nc)
            log.info("nats_connected", url=url, name=name, max_payload=nc.max_payload)
            return nc
        except Exception as error:  # nats-py raises several unrelated types here
            if auth_failed or is_auth_error(error):
                await _close_quietly(nc)
                raise BusAuthError(
                    f"NATS at {url} refused the credentials ({auth_failed[0] if auth_failed else error}); "
                    "check bus.token / bus.user + bus.password / bus.creds_file"
                ) from error
            if time.monotonic() > deadline:
                await _close_quietly(nc)
                raise BusConnectError(
                    f"no NATS server answered at {url} within bus.connect_retry_s={config.connect_retry_s}s "
                    f"({type(error).__name__}: {error}); start one (`rlbus-nats --store DIR`) or fix bus.url"
                ) from error
            await _close_quietly(nc)
            await asyncio.sleep(min(config.reconnect_wait_s, 0.5))


def enable_reconnect_forever(nc: NATS) -> None:
    """Reconnect without limit from now on (nats-py reads these options at each disconnect)."""
    nc.options["allow_reconnect"] = True
    nc.options["max_reconnect_attempts"] = -1


async def _close_quietly(nc: NATS) -> None:
    try:
        await nc.close()
    except Exception:
        pass
