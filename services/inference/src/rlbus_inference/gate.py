"""The public port (`server.port`): an allow-list in front of vLLM, in the replica process.

vLLM's app serves more than the OpenAI API: its own control routes (/pause, /resume,
/scale_elastic_ep, /v1/load_lora_adapter, ...) and, through our endpoint plugin, the admin
routes. So the engine binds `admin.host` (loopback by default) and this gate, running in the
replica process, serves `server.port`:

    PUBLIC paths (the OpenAI API, vLLM's token-in/token-out /inference/v1/generate,
                  /tokenize, /health, /metrics)        -> streamed through to vLLM
    anything else                                      -> 404 {"error": ...}
    CORS                                               -> only for server.cors_allowed_origins

The gate forwards to the engine's gate-facing listener (`admin_access.GATE_PORT_ENV`, loopback),
where the same `is_public` rule is enforced again (`rlbus_inference.admin`), so vLLM's control
routes are closed on both hops. The gate only allows and denies: bodies pass through unchanged
(clients that want vLLM's answers in another form adapt them on their side, e.g. the verifiers
env server's token names, docs/environments.md).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable, Iterable, Iterator
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import structlog
from opentelemetry.trace import SpanKind

from rlbus.netutil import CLIENT_KEEPALIVE_S, SERVER_KEEPALIVE_S
from rlbus.obs import tracing

if TYPE_CHECKING:  # aiohttp and uvicorn load with the gate, not with this module
    import aiohttp
    import uvicorn

Message = dict[str, Any]
"""An ASGI message (or scope)."""
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

log = structlog.get_logger()

GENERATE_PATH = "/inference/v1/generate"
"""vLLM's token-in/token-out endpoint (`--enable-scale-out`): verifiers 0.4's train client calls
it. The rest of vLLM's scale-out API (/render, /derender, ...) stays closed."""
TOKENIZE_PATH = "/tokenize"
"""vLLM's chat-template rendering to token ids (read-only): a multi-turn episode learns the tokens
of the messages it adds between two model turns from it (rlbus_orchestrator.envs.turns)."""
PUBLIC_EXACT = frozenset({"/health", "/metrics", GENERATE_PATH, TOKENIZE_PATH})
PUBLIC_PREFIX = "/v1/"
NOT_PUBLIC = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
"""vLLM's own adapter management lives under /v1/ but is an admin operation."""
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
    }
)
TRACE_HEADERS = frozenset({"traceparent", "tracestate"})
"""W3C trace context: replaced by the gate's own span when it records one."""
CORS_METHODS = "GET, POST, OPTIONS"
MAX_BODY_BYTES = 64 << 20
"""Largest request body passed on (a long multi-turn prompt is well under 1 MiB); more is 413,
so a client cannot make the replica process hold gigabytes."""


def is_public(path: str) -> bool:
    """Whether clients may reach `path` on the public port (the OpenAI API, health, metrics)."""
    path = path.rstrip("/") or "/"
    if path in PUBLIC_EXACT:
        return True
    return path.startswith(PUBLIC_PREFIX) and path not in NOT_PUBLIC and ".." not in path


def json_response(
    status: HTTPStatus, body: dict[str, Any], headers: Headers | None = None
) -> tuple[Message, Message]:
    """An ASGI (start, body) message pair with a JSON body."""
    data = json.dumps(body).encode()
    start = {
        "type": "http.response.start",
        "status": status.value,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
            *(headers or []),
        ],
    }
    return start, {"type": "http.response.body", "body": data}


class PublicGate:
    """ASGI app: forwards public paths to `upstream` (the engine), refuses the rest."""

    def __init__(self, upstream: str, allowed_origins: list[str]) -> None:
        self.upstream = upstream.rstrip("/")
        self.session: aiohttp.ClientSession | None = None  # made in the serving event loop
        self.allow_any = "*" in allowed_origins
        self.allowed = frozenset(allowed_origins)

    def client(self) -> aiohttp.ClientSession:
        """The upstream session. aiohttp (a vLLM dependency), not httpx: on 2 cores httpx's
        per-request cost halved the throughput through the gate (docs/inference.md). Idle
        connections are dropped before vLLM's server drops them (CLIENT_KEEPALIVE_S): with
        aiohttp's default 15 s the gate answered bursts of 502s (`engine unreachable:
        ServerDisconnectedError`) whenever requests paused for 5-15 s, e.g. between the turns of
        multi-turn episodes."""
        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, connect=5.0),
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S),
                auto_decompress=False,
            )
        return self.session

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        cors = self.cors_headers(headers.get("origin"))
        if scope["method"] == "OPTIONS":  # a CORS preflight: answered here, never forwarded
            await self.preflight(send, cors)
            return
        if not is_public(scope["path"]):
            refusal = {
                "error": f"{scope['path']} is not served on the public port (only the OpenAI API "
                f"under /v1/, {GENERATE_PATH}, {TOKENIZE_PATH}, /health and /metrics are)"
            }
            for message in json_response(HTTPStatus.NOT_FOUND, refusal):
                await send(message)
            return
        await self.forward(scope, receive, send, cors)

    async def preflight(self, send: Send, cors: Headers) -> None:
        """Answer a CORS preflight: 204 with the CORS headers, or 403 for an origin not allowed."""
        if not cors:
            refusal = {
                "error": "cross-origin requests are not allowed (server.cors_allowed_origins)"
            }
            for message in json_response(HTTPStatus.FORBIDDEN, refusal):
                await send(message)
            return
        start = {"type": "http.response.start", "status": HTTPStatus.NO_CONTENT.value}
        await send({**start, "headers": cors})
        await send({"type": "http.response.body", "body": b""})

    def cors_headers(self, origin: bytes | None) -> Headers:
        """CORS response headers for a request from `origin`; none unless it is allowed."""
        if origin is None or not (self.allow_any or origin.decode("latin-1") in self.allowed):
            return []
        return [
            (b"access-control-allow-origin", origin),
            (b"access-control-allow-methods", CORS_METHODS.encode()),
            (b"access-control-allow-headers", b"authorization, content-type"),
            (b"vary", b"origin"),
        ]

    async def forward(self, scope: Message, receive: Receive, send: Send, cors: Headers) -> None:
        """Read the request body (413 past MAX_BODY_BYTES) and relay the request upstream."""
        body = bytearray()
        while True:
            message = await receive()
            body.extend(message.get("body", b""))
            if len(body) > MAX_BODY_BYTES:
                too_big = {"error": f"request body over {MAX_BODY_BYTES >> 20} MiB"}
                for message in json_response(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, too_big):
                    await send(message)
                return
            if not message.get("more_body"):
                break
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in scope["headers"]
            if k.decode("latin-1").lower() not in HOP_BY_HOP
        ]
        # A request that carries a W3C traceparent (the orchestrator's) gets an
        # `inference.http` SERVER span here, and vLLM sees this span as parent.
        with tracing.span(
            tracing.HTTP_SERVER,
            context=tracing.extract_context(dict(headers)),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": scope["method"], "url.path": scope["path"]},
        ) as span:
            if span.get_span_context().is_valid:
                headers = [(k, v) for k, v in headers if k.lower() not in TRACE_HEADERS]
                headers.extend(tracing.inject_headers({}).items())
            status = await self.relay(scope, send, cors, headers, bytes(body))
            span.set_attribute("http.response.status_code", status)

    async def relay(
        self, scope: Message, send: Send, cors: Headers, headers: list[tuple[str, str]], body: bytes
    ) -> int:
        """Send the request to vLLM and stream its answer back; returns the status."""
        import aiohttp

        query = scope["query_string"].decode("latin-1")
        url = self.upstream + scope["path"] + ("?" + query if query else "")
        try:
            response = await self.client().request(
                scope["method"], url, headers=headers, data=body, allow_redirects=False
            )
        except (aiohttp.ClientError, OSError) as error:
            log.warning("engine_unreachable", path=scope["path"], error=repr(error))
            for message in json_response(
                HTTPStatus.BAD_GATEWAY, {"error": f"engine unreachable: {error!r}"}
            ):
                await send(message)
            return HTTPStatus.BAD_GATEWAY.value
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status,
                    "headers": [*upstream_headers(response.raw_headers), *cors],
                }
            )
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            response.release()
        return response.status

    async def aclose(self) -> None:
        """Close the upstream session (at the replica's stop)."""
        if self.session is not None:
            await self.session.close()


def upstream_headers(raw_headers: Iterable[tuple[bytes, bytes]]) -> Headers:
    """vLLM's response headers without hop-by-hop ones and without its CORS headers."""
    return [
        (k, v)
        for k, v in raw_headers
        if (name := k.decode("latin-1").lower()) not in HOP_BY_HOP
        and not name.startswith("access-control-")
    ]


def no_signal_server(app: Any, host: str, port: int) -> uvicorn.Server:
    """A uvicorn server for the ASGI `app` (typed Any: uvicorn's ASGI types and starlette's do
    not unify) that leaves signal handling to its host process (vLLM's
    server in the engine, `rlbus.lifecycle` in the replica)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_keep_alive=int(SERVER_KEEPALIVE_S),
        )
    )
