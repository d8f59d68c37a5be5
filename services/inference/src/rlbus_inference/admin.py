"""Admin endpoints on the engine port, added to vLLM's own FastAPI app as an endpoint plugin.

vLLM 0.32 loads `vllm.endpoint_plugins` entry points named in `VLLM_PLUGINS` and calls
`attach_router(app)` while building its app, then `init_state(engine_client, ...)` (see
vllm/plugins/endpoint_plugins/interface.py). Our package registers `rlbus` in that group
(services/inference/pyproject.toml) and the service sets `VLLM_PLUGINS` when it starts the
engine, so vLLM itself stays unpatched. The heavy lifting runs in the workers through
`collective_rpc` into `rlbus_inference.worker.RlbusWorkerExtension`.

Routes (engine port only; the router in front forwards only the OpenAI API, so these 404 there):

    GET  /liveness           {"status", "weights_version", "paused"}
    POST /pause              {"mode": "wait"|"abort", "timeout_s"}   stop scheduling
    POST /resume             schedule again
    POST /update_weights     {"version", "path", "sha256": {file: hex}} or {"version", "source": "broadcast"}
    POST /init_broadcaster   {"host", "port", "rank_offset", "world_size", "timeout_s"}
    POST /load_lora_adapter  {"lora_name", "lora_path", "version"?}  load, or reload in place

The router does not call backend_port: it calls a second, loopback-only listener of the same
app (`RLBUS_ROUTER_FACING_PORT`), where every admin path answers 404 (`RlbusMiddleware`).

Every HTTP response of the app carries `X-Rlbus-Weights-Version`: the version loaded when the
response started. A weight update pauses the scheduler (in-flight requests finish, or are
aborted after `pause_timeout_s`), loads, resets the prefix cache, bumps the version, resumes;
so a completion is produced by exactly one version and cached prefixes never cross versions.
"""

from __future__ import annotations

import asyncio
import os
import time
from http import HTTPStatus
from pathlib import Path
from typing import Literal

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from rlbus.checksums import ChecksumMismatch, verify_files
from rlbus.runtime import terminate_on_failure
from rlbus.wire.weights import WEIGHTS_VERSION_HEADER
from rlbus_inference.worker import safetensors_files

INITIAL_VERSION_ENV = "RLBUS_INITIAL_WEIGHTS_VERSION"
ROUTER_PORT_ENV = "RLBUS_ROUTER_FACING_PORT"
# Paths the router must never reach (ours and vLLM's own control paths).
ADMIN_PATHS = frozenset(
    {
        "/update_weights",
        "/load_lora_adapter",
        "/init_broadcaster",
        "/pause",
        "/resume",
        "/liveness",
        "/is_paused",
        "/abort_requests",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/reset_prefix_cache",
        "/sleep",
        "/wake_up",
        "/collective_rpc",
    }
)

router = APIRouter()


class AdminState:
    """Per-app state: the version being served and the lock that serialises weight changes."""

    def __init__(self, engine_client, version: int):
        self.engine = engine_client
        self.version = version
        self.lock = asyncio.Lock()
        self.last_error: str | None = None


class PauseRequest(BaseModel):
    mode: Literal["wait", "abort"] = "wait"
    """wait: let in-flight requests finish (aborted after timeout_s); abort: abort them now."""
    timeout_s: float = Field(60.0, gt=0)


class UpdateWeightsRequest(BaseModel):
    version: int = Field(ge=0)
    """Policy version (trainer step) of these weights; reported in every later response."""
    path: str | None = None
    """Directory of HF safetensors files (filesystem transport)."""
    sha256: dict[str, str] = {}
    """File name -> hex sha256 as published; any mismatch refuses the directory."""
    source: Literal["path", "broadcast"] = "path"
    """`broadcast`: receive the version from the group joined with /init_broadcaster."""
    pause_timeout_s: float = Field(60.0, gt=0)
    timeout_s: float = Field(600.0, gt=0)
    """Deadline of the load in the workers: after it the answer is 504 and the old version stays
    the one reported (the weight agent sends a bit less than its own HTTP deadline)."""


class InitBroadcasterRequest(BaseModel):
    host: str
    port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(1, ge=1)
    world_size: int = Field(ge=2)
    timeout_s: float = Field(300.0, gt=0)


class LoadLoraRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    version: int | None = Field(None, ge=0)
    """Policy version of this adapter; when set, later responses report it."""


def _state(request: Request) -> AdminState:
    return request.app.state.rlbus


def _error(status: HTTPStatus, reason: str) -> JSONResponse:
    return JSONResponse({"error": reason}, status_code=status.value)


@router.get("/liveness")
async def liveness(request: Request) -> JSONResponse:
    state = _state(request)
    paused = await state.engine.is_paused()
    return JSONResponse(
        {
            "status": "ok",
            "weights_version": state.version,
            "paused": paused,
            "last_error": state.last_error,
        }
    )


async def pause_engine(engine, mode: str, timeout_s: float) -> str:
    """Pause scheduling; in `wait` mode abort what is still running after timeout_s."""
    if mode == "abort":
        await engine.pause_generation(mode="abort", clear_cache=True)
        return "aborted"
    try:
        await asyncio.wait_for(engine.pause_generation(mode="wait", clear_cache=True), timeout_s)
        return "drained"
    except TimeoutError:
        await engine.pause_generation(mode="abort", clear_cache=True)
        return "aborted_after_timeout"


@router.post("/pause")
async def pause(request: Request, body: PauseRequest) -> JSONResponse:
    outcome = await pause_engine(_state(request).engine, body.mode, body.timeout_s)
    return JSONResponse({"status": "paused", "in_flight": outcome})


@router.post("/resume")
async def resume(request: Request) -> JSONResponse:
    await _state(request).engine.resume_generation()
    return JSONResponse({"status": "resumed"})


def _check_weights_dir(body: UpdateWeightsRequest) -> str | None:
    """The reason a filesystem update request is unusable, or None."""
    if body.path is None:
        return "`path` is required when source is 'path'"
    path = Path(body.path)
    if not path.is_dir():
        return f"weights directory {path} does not exist"
    try:
        safetensors_files(path)
    except FileNotFoundError as e:
        return str(e)
    return None


@router.post("/update_weights")
async def update_weights(request: Request, body: UpdateWeightsRequest) -> JSONResponse:
    state = _state(request)
    if body.source == "path":
        if reason := _check_weights_dir(body):
            return _error(HTTPStatus.BAD_REQUEST, reason)
        try:
            await asyncio.to_thread(verify_files, Path(body.path), body.sha256)
        except ChecksumMismatch as e:
            state.last_error = str(e)
            return _error(HTTPStatus.UNPROCESSABLE_ENTITY, f"refused: {e}")
    async with state.lock:
        start = time.perf_counter()
        was_paused = await state.engine.is_paused()
        in_flight = (
            "already_paused"
            if was_paused
            else await pause_engine(state.engine, "wait", body.pause_timeout_s)
        )
        try:
            if body.source == "path":
                load = state.engine.collective_rpc("rlbus_load_weights_from_dir", args=(body.path,))
            else:
                load = state.engine.collective_rpc("rlbus_receive_broadcast")
            results = await asyncio.wait_for(load, body.timeout_s)
            await state.engine.reset_prefix_cache()
            state.version = body.version
            state.last_error = None
        except TimeoutError:
            state.last_error = (
                f"update to version {body.version}: no answer from the workers within "
                f"{body.timeout_s:g} s"
            )
            return _error(HTTPStatus.GATEWAY_TIMEOUT, state.last_error)
        except Exception as e:  # the engine keeps its old weights only if nothing was loaded yet
            state.last_error = f"update to version {body.version} failed: {e}"
            return _error(HTTPStatus.INTERNAL_SERVER_ERROR, state.last_error)
        finally:
            if not was_paused:
                await state.engine.resume_generation()
    return JSONResponse(
        {
            "status": "ok",
            "weights_version": state.version,
            "in_flight": in_flight,
            "seconds": time.perf_counter() - start,
            "workers": results,
        }
    )


@router.post("/init_broadcaster")
async def init_broadcaster(request: Request, body: InitBroadcasterRequest) -> JSONResponse:
    state = _state(request)
    if body.rank_offset >= body.world_size:
        return _error(HTTPStatus.BAD_REQUEST, "rank_offset must be < world_size")
    try:
        ranks = await state.engine.collective_rpc(
            "rlbus_init_broadcaster",
            args=(body.host, body.port, body.rank_offset, body.world_size, body.timeout_s),
        )
    except Exception as e:
        return _error(HTTPStatus.BAD_GATEWAY, f"could not join the broadcast group: {e}")
    return JSONResponse({"status": "ok", "ranks": ranks})


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request, body: LoadLoraRequest) -> JSONResponse:
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    state = _state(request)
    if not Path(body.lora_path).is_dir():
        return _error(HTTPStatus.BAD_REQUEST, f"adapter directory {body.lora_path} does not exist")
    models = request.app.state.openai_serving_models
    async with state.lock:
        result = await models.load_lora_adapter(
            LoadLoRAAdapterRequest(
                lora_name=body.lora_name, lora_path=body.lora_path, load_inplace=True
            )
        )
        # Cached prefixes computed with the adapter's previous weights must not be reused.
        await state.engine.reset_prefix_cache()
        if isinstance(result, str) and body.version is not None:
            state.version = body.version
    if not isinstance(result, str):
        status = getattr(result, "error", result)
        return JSONResponse(result.model_dump(), status_code=getattr(status, "code", 400))
    return JSONResponse(
        {"status": "ok", "lora_name": body.lora_name, "weights_version": state.version}
    )


class RlbusMiddleware:
    """ASGI middleware: stamp responses with the weights version; hide admin routes from the router.

    vllm-router forwards some admin paths itself (/pause, /resume, /update_weights, ...: it was
    built to fan RL control out to workers), so blocking them at the router is not possible
    without patching it. Instead the router reaches this app on a second, router-facing
    listener (`ROUTER_PORT_ENV`), and requests arriving there for an admin path get 404.
    """

    def __init__(self, app):
        self.app = app
        router_port = os.environ.get(ROUTER_PORT_ENV)
        self.router_port = int(router_port) if router_port else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self._is_admin_via_router(scope):
            response = JSONResponse(
                {
                    "error": f"{scope['path']} is not served on the router port; "
                    "call the engine port (backend_port) directly"
                },
                status_code=HTTPStatus.NOT_FOUND.value,
            )
            return await response(scope, receive, send)
        app_state = scope["app"].state if "app" in scope else None

        async def send_with_version(message):
            if message["type"] == "http.response.start":
                state = getattr(app_state, "rlbus", None)
                if state is not None:
                    headers = list(message.get("headers", []))
                    headers.append(
                        (WEIGHTS_VERSION_HEADER.lower().encode(), str(state.version).encode())
                    )
                    message = {**message, "headers": headers}
            await send(message)

        return await self.app(scope, receive, send_with_version)

    def _is_admin_via_router(self, scope) -> bool:
        server = scope.get("server")
        return (
            self.router_port is not None
            and server is not None
            and server[1] == self.router_port
            and scope["path"].rstrip("/") in ADMIN_PATHS
        )


class _NoSignalServer:
    """A uvicorn server that leaves signal handling to vLLM's main server."""

    @staticmethod
    def make(app, host: str, port: int):
        import contextlib

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


class RlbusAdminPlugin:
    """vLLM endpoint plugin (entry point `rlbus` in group `vllm.endpoint_plugins`)."""

    name = "rlbus"
    required_tasks = None

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(router)
        app.add_middleware(RlbusMiddleware)
        self.app = app

    async def init_state(self, engine_client, state, args) -> None:
        state.rlbus = AdminState(engine_client, int(os.environ.get(INITIAL_VERSION_ENV, "0")))
        if port := os.environ.get(ROUTER_PORT_ENV):
            # The router-facing listener: same app, same event loop, loopback only.
            server = _NoSignalServer.make(self.app, "127.0.0.1", int(port))
            listener = asyncio.get_running_loop().create_task(server.serve())
            # A listener that cannot serve (port taken) must end the engine, not leave the
            # router talking to nothing.
            terminate_on_failure(listener, "router_listener")
            state.rlbus.router_listener = listener
