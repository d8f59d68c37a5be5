"""Opening the NATS connection: auth/TLS options from `BusConfig`, reconnect forever, logged callbacks.

Failures a retry cannot fix end the first connection at once, with one line naming the URL and
what to check: refused credentials (`BusAuthError`), and TLS trouble (`BusTLSError`): a server
certificate the CA does not vouch for, a TLS client talking to a plaintext server, or a plaintext
client talking to a TLS server. A client configured for TLS never sends its CONNECT (credentials
included) over plaintext: nats-py would (it upgrades only when the server's INFO asks for TLS),
so `TlsOnlyClient` refuses such a server before CONNECT, on every reconnect too.
"""

import asyncio
import ssl
import time
from collections.abc import Awaitable, Callable

import nats.errors
import structlog
from nats.aio.client import Client as NATS

from rlbus.bus.errors import BusAuthError, BusConnectError, BusTLSError
from rlbus.configs.bus import BusConfig
from rlbus.secrets import read_secret_file

log = structlog.get_logger()


class ServerWithoutTLS(nats.errors.Error):
    """The server's INFO offers no TLS although the client requires it (a nats error, so nats-py
    treats it as a failed connection attempt when it reconnects)."""


class TlsOnlyClient(NATS):
    """A nats-py client that refuses a server without TLS before sending CONNECT.

    Overrides nats-py's private `_process_info` (2.16: called with the first INFO of every
    connection, before the TLS upgrade decision), the one hook between INFO and CONNECT."""

    async def _process_info(self, info: dict, initial_connection: bool = False) -> None:
        if initial_connection and not info.get("tls_required"):
            raise ServerWithoutTLS("the server offers no TLS")
        await super()._process_info(info, initial_connection)


def tls_context(config: BusConfig) -> ssl.SSLContext | None:
    """Client TLS context from `bus.tls_ca` / `bus.tls_cert` / `bus.tls_key` (None without TLS;
    a tls:// URL without a CA verifies against the system's CAs)."""
    if not config.wants_tls:
        return None
    context = ssl.create_default_context(cafile=config.tls_ca)
    if config.tls_cert:
        context.load_cert_chain(config.tls_cert, config.tls_key)
    return context


def auth_options(config: BusConfig) -> dict:
    """Credential keywords for `nats.connect`; secrets are read here, never stored in options
    that a log could print. Credential files must be 0600 (`rlbus.secrets`)."""
    options: dict = {}
    if token := config.secret_token():
        options["token"] = token
    if config.user:
        password = config.secret_password()
        if password is None:
            raise ValueError(
                f"bus.user={config.user} has no password: set bus.password_file (a 0600 file) "
                "or export RLBUS_BUS_PASSWORD"
            )
        options["user"], options["password"] = config.user, password
    if config.creds_file:
        read_secret_file(config.creds_file, field="bus.creds_file")  # owner-only, like a seed
        options["user_credentials"] = config.creds_file
    if config.nkey_seed_file:
        seed = read_secret_file(config.nkey_seed_file, field="bus.nkey_seed_file")
        options["nkeys_seed_str"] = seed
    return options


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
    options |= auth_options(config)
    tls = tls_context(config)
    if tls is not None:
        options["tls"] = tls
    return options


def tls_failure(config: BusConfig, error: BaseException) -> str | None:
    """What to check when `error` is a TLS problem no retry fixes (None: not a TLS problem)."""
    url = config.url
    if isinstance(error, ServerWithoutTLS):
        return (
            f"NATS at {url} offers no TLS but this client requires it (bus.tls_ca or a tls:// "
            "URL); refusing plaintext: point bus.url at the TLS listener or configure TLS on the server"
        )
    if not isinstance(error, ssl.SSLError):
        return None
    if not config.wants_tls:  # nats-py upgraded on its own (the server's INFO asked for TLS)
        return (
            f"NATS at {url} requires TLS: use a tls:// URL and set bus.tls_ca to the CA that "
            "signed the server's certificate"
        )
    if isinstance(error, ssl.SSLCertVerificationError):
        return (
            f"NATS at {url}: the server's certificate is not trusted ({error.verify_message}); "
            "check that bus.tls_ca is the CA that signed it and the URL's host is one of its names"
        )
    return (
        f"NATS at {url}: TLS handshake failed ({error.reason or error}); check that the server "
        "serves TLS on this port and bus.tls_ca / bus.tls_cert / bus.tls_key"
    )


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
        nc = TlsOnlyClient() if config.wants_tls else NATS()
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
            if (tls_problem := tls_failure(config, error)) is not None:
                await _close_quietly(nc)
                raise BusTLSError(tls_problem) from error
            if auth_failed or is_auth_error(error):
                await _close_quietly(nc)
                raise BusAuthError(
                    f"NATS at {url} refused the credentials ({auth_failed[0] if auth_failed else error}); "
                    "check bus.token_file (RLBUS_BUS_TOKEN) / bus.user + bus.password_file "
                    "(RLBUS_BUS_PASSWORD) / bus.creds_file / bus.nkey_seed_file"
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


CLOSE_TIMEOUT_S = 1.0
"""Longest wait for a failed connection to close: after a failed TLS upgrade, asyncio's stream
never reports the socket closed, and nats-py's close() waits for that forever."""


async def _close_quietly(nc: NATS) -> None:
    try:
        await asyncio.wait_for(nc.close(), CLOSE_TIMEOUT_S)
    except Exception:
        pass
