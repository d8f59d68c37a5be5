"""The public port (`server.port`): an allow-list in front of vllm-router.

vllm-router has no switch for its own management API (/add_worker, /remove_worker, /workers,
/list_workers, /flush_cache, /get_loads, ...) or for vLLM's elastic-scaling endpoints it
forwards (/scale_elastic_ep), and it answers every origin with permissive CORS headers
(measured on vllm-router 0.1.17, docs/inference.md "Public port"). So the router binds loopback
on a free port and this gate, running in the replica process, serves `server.port`:

    PUBLIC paths (the OpenAI API, vLLM's token-in/token-out /inference/v1/generate,
                  /health, /metrics)                   -> streamed through to the router
    anything else                                      -> 404 {"error": ...}
    CORS                                               -> only for server.cors_allowed_origins

The same `is_public` rule guards the engine's router-facing listener (`rlbus_inference.admin`),
so vLLM's control routes are closed on both hops.
"""

from __future__ import annotations

import contextlib
import json
from http import HTTPStatus

from opentelemetry.trace import SpanKind

from rlbus.obs import tracing

GENERATE_PATH = "/inference/v1/generate"
"""vLLM's token-in/token-out endpoint (`--enable-scale-out`): verifiers 0.4's train client calls
it. The rest of vLLM's scale-out API (/render, /derender, ...) stays closed."""
PUBLIC_EXACT = frozenset({"/health", "/metrics", GENERATE_PATH})
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


def json_response(status: HTTPStatus, body: dict, headers: list | None = None):
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
    """ASGI app: forwards public paths to `upstream` (the router), refuses the rest."""

    def __init__(self, upstream: str, allowed_origins: list[str]):
        self.upstream = upstream.rstrip("/")
        self.session = None  # an aiohttp.ClientSession, made in the serving event loop
        self.allow_any = "*" in allowed_origins
        self.allowed = frozenset(allowed_origins)

    def client(self):
        """The upstream session. aiohttp (a vLLM dependency), not httpx: on 2 cores httpx's
        per-request cost halved the throughput through the gate (docs/inference.md)."""
        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, connect=5.0),
                connector=aiohttp.TCPConnector(limit=0),
                auto_decompress=False,
            )
        return self.session

    async def __call__(self, scope, receive, send) -> None:
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
                f"under /v1/, {GENERATE_PATH}, /health and /metrics are)"
            }
            for message in json_response(HTTPStatus.NOT_FOUND, refusal):
                await send(message)
            return
        await self.forward(scope, receive, send, cors)

    async def preflight(self, send, cors: list) -> None:
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

    def cors_headers(self, origin: bytes | None) -> list[tuple[bytes, bytes]]:
        """CORS response headers for a request from `origin`; none unless it is allowed."""
        if origin is None or not (self.allow_any or origin.decode("latin-1") in self.allowed):
            return []
        return [
            (b"access-control-allow-origin", origin),
            (b"access-control-allow-methods", CORS_METHODS.encode()),
            (b"access-control-allow-headers", b"authorization, content-type"),
            (b"vary", b"origin"),
        ]

    async def forward(self, scope, receive, send, cors: list) -> None:
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
        # `inference.http` SERVER span here, and the router and vLLM see this span as parent.
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

    async def relay(self, scope, send, cors: list, headers: list, body: bytes) -> int:
        """Send the request to the router and stream its answer back; returns the status."""
        import aiohttp

        query = scope["query_string"].decode("latin-1")
        url = self.upstream + scope["path"] + ("?" + query if query else "")
        try:
            response = await self.client().request(
                scope["method"], url, headers=headers, data=body, allow_redirects=False
            )
        except (aiohttp.ClientError, OSError) as error:
            for message in json_response(
                HTTPStatus.BAD_GATEWAY, {"error": f"router unreachable: {error!r}"}
            ):
                await send(message)
            return HTTPStatus.BAD_GATEWAY.value
        try:
            if scope["path"].rstrip("/") == GENERATE_PATH and is_json(response):
                await self.send_generate(response, send, cors)
                return response.status
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

    async def send_generate(self, response, send, cors: list) -> None:
        """A whole (non-streamed) generate answer, its logprob entries named the way clients
        of the token API expect (`token_id_names`)."""
        body = await response.read()
        if response.status == HTTPStatus.OK:
            with contextlib.suppress(ValueError):
                body = json.dumps(token_id_names(json.loads(body))).encode()
        headers = [
            (k, v)
            for k, v in upstream_headers(response.raw_headers)
            if k.lower() != b"content-length"
        ]
        headers.append((b"content-length", str(len(body)).encode()))
        await send(
            {"type": "http.response.start", "status": response.status, "headers": headers + cors}
        )
        await send({"type": "http.response.body", "body": body})

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()


def is_json(response) -> bool:
    return response.headers.get("content-type", "").startswith("application/json")


def token_id_names(payload: dict) -> dict:
    """Give each logprob entry of a generate answer the name `token_id:<id>` under `token`.

    vLLM 0.32's token API returns entries as `{"token_id": 5, "logprob": ...}`, while the
    `renderers` client that verifiers 0.4 uses (renderers 0.1.12, the newest) checks
    `entry["token"] == "token_id:5"`, the form vLLM's `--return-tokens-as-token-ids` gives
    in the OpenAI API. Both fields are kept, so a client of either form reads the answer
    (docs/environments.md)."""
    for choice in payload.get("choices") or []:
        logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
        entries = logprobs.get("content") if isinstance(logprobs, dict) else None
        for entry in entries or []:
            if isinstance(entry, dict) and "token" not in entry and "token_id" in entry:
                entry["token"] = f"token_id:{entry['token_id']}"
    return payload


def upstream_headers(raw_headers) -> list[tuple[bytes, bytes]]:
    """The router's response headers without hop-by-hop ones and without its CORS headers."""
    return [
        (k, v)
        for k, v in raw_headers
        if (name := k.decode("latin-1").lower()) not in HOP_BY_HOP
        and not name.startswith("access-control-")
    ]


def no_signal_server(app, host: str, port: int):
    """A uvicorn server for `app` that leaves signal handling to its host process (vLLM's
    server in the engine, `rlbus.runtime` in the replica)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return Server(
        uvicorn.Config(
            app, host=host, port=port, lifespan="off", log_level="warning", access_log=False
        )
    )
