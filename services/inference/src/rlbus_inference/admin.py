"""Admin endpoints on the engine port, added to vLLM's own FastAPI app as an endpoint plugin.

vLLM 0.32 loads `vllm.endpoint_plugins` entry points named in `VLLM_PLUGINS` and calls
`attach_router(app)` while building its app, then `init_state(engine_client, ...)` (see
vllm/plugins/endpoint_plugins/interface.py). Our package registers `rlbus` in that group
(services/inference/pyproject.toml) and the service sets `VLLM_PLUGINS` when it starts the
engine, so vLLM itself stays unpatched. The heavy lifting runs in the workers through
`collective_rpc` into `rlbus_inference.worker.RlbusWorkerExtension`.

Routes (engine port only; the public port and the gate-facing listener serve only the OpenAI
API, so these 404 there):

    GET  /liveness           {"status", "weights_version", "paused"}
    POST /pause              {"mode": "wait"|"abort", "timeout_s"}   stop scheduling
    POST /resume             schedule again
    POST /update_weights     {"version", "path", "sha256": {file: hex}} or {"version", "source": "broadcast"}
    POST /init_broadcaster   {"host", "port", "rank_offset", "world_size", "timeout_s"}
    POST /load_lora_adapter  {"lora_name", "lora_path", "version"?, "sha256"?}  load, or reload in place

The public gate does not call backend_port: it calls a second, loopback-only listener of the
same app (`admin_access.GATE_PORT_ENV`), which serves only what `rlbus_inference.gate.is_public`
allows (the OpenAI API, /health, /metrics); everything else answers 404 there
(`RlbusMiddleware`).

backend_port binds `admin.host` (loopback by default). With a token (`RLBUS_ADMIN_TOKEN` in the
engine's environment, set by the service from admin.token_file or its own environment), every
path on backend_port except /health answers 401 without `Authorization: Bearer <token>`.
Weight directories must lie under `RLBUS_WEIGHTS_ROOT` (the run's broadcasts directory) and pass
`rlbus_inference.validation` before the engine pauses: a bad update is 422 naming the tensor and
the problem, and the engine keeps serving the version it had.

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
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rlbus.checksums import ChecksumMismatch, verify_files
from rlbus.lifecycle import terminate_on_failure
from rlbus.wire.weights import WEIGHTS_VERSION_HEADER
from rlbus_inference import admin_access, validation
from rlbus_inference.gate import is_public, no_signal_server

INITIAL_VERSION_ENV = "RLBUS_INITIAL_WEIGHTS_VERSION"
EngineClient = Any
"""vllm.engine.protocol.EngineClient (AsyncLLM): typed loosely so that mypy does not walk vLLM."""

router = APIRouter()

MAX_VERSION = 2**53
"""Largest version accepted (JSON numbers beyond it lose precision in many clients)."""
MAX_TIMEOUT_S = 24 * 3600.0


class AdminState:
    """Per-app state: the version being served and the lock that serialises weight changes."""

    def __init__(self, engine_client: EngineClient, version: int, model: str | None = None) -> None:
        self.engine = engine_client
        self.version = version
        self.lock = asyncio.Lock()
        self.last_error: str | None = None
        self.model = model
        self.reference: dict[str, validation.Spec] | None = None
        """Tensor specs of the served model's checkpoint, read at the first update."""
        self.weights_root = admin_access.root_from_env()
        self.check_finite = os.environ.get(admin_access.CHECK_FINITE_ENV, "1") == "1"

    def reference_specs(self) -> dict[str, validation.Spec]:
        """The served model's tensor specs (read once); FileNotFoundError when it is unknown."""
        if self.model is None:
            raise FileNotFoundError("the served model is not known")
        if self.reference is None:
            self.reference = validation.file_specs(validation.model_files(self.model))
        return self.reference


class PauseRequest(BaseModel):
    model_config = {"extra": "forbid"}

    mode: Literal["wait", "abort"] = "wait"
    """wait: let in-flight requests finish (aborted after timeout_s); abort: abort them now."""
    timeout_s: float = Field(60.0, gt=0, le=MAX_TIMEOUT_S)


class UpdateWeightsRequest(BaseModel):
    model_config = {"extra": "forbid"}

    version: int = Field(ge=0, le=MAX_VERSION)
    """Policy version (trainer step) of these weights; reported in every later response."""
    path: str | None = Field(None, max_length=admin_access.MAX_PATH_CHARS)
    """Directory of HF safetensors files (filesystem transport), under the weights root."""
    sha256: dict[str, str] = Field({}, max_length=10_000)
    """File name -> hex sha256 as published; any mismatch refuses the directory."""
    source: Literal["path", "broadcast"] = "path"
    """`broadcast`: receive the version from the group joined with /init_broadcaster."""
    pause_timeout_s: float = Field(60.0, gt=0, le=MAX_TIMEOUT_S)
    timeout_s: float = Field(600.0, gt=0, le=MAX_TIMEOUT_S)
    """Deadline of the load in the workers: after it the answer is 504 and the old version stays
    the one reported (the weight agent sends a bit less than its own HTTP deadline)."""


class InitBroadcasterRequest(BaseModel):
    model_config = {"extra": "forbid"}

    host: str = Field(min_length=1, max_length=253)
    port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(1, ge=1, le=1024)
    world_size: int = Field(ge=2, le=1025)
    timeout_s: float = Field(300.0, gt=0, le=MAX_TIMEOUT_S)


class LoadLoraRequest(BaseModel):
    model_config = {"extra": "forbid"}

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=admin_access.MAX_PATH_CHARS)
    version: int | None = Field(None, ge=0, le=MAX_VERSION)
    """Policy version of this adapter; when set, later responses report it."""
    sha256: dict[str, str] = Field({}, max_length=100)
    """File name -> hex sha256 as published; any mismatch refuses the adapter (422)."""


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


async def pause_engine(engine: EngineClient, mode: str, timeout_s: float) -> str:
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


def checked_update_dir(state: AdminState, body: UpdateWeightsRequest) -> Path:
    """The safetensors directory of a filesystem update, checked before the engine is touched:
    confined to the weights root (PathRefused: 400), files as published (ChecksumMismatch: 422),
    tensors loadable into the served model (WeightsRefused: 422). Runs in a thread."""
    if body.path is None:
        raise admin_access.PathRefused("`path` is required when source is 'path'")
    directory = admin_access.confined_dir("path", body.path, state.weights_root)
    files = admin_access.regular_files(directory, "*.safetensors", state.weights_root)
    if not files:
        raise admin_access.PathRefused(f"no *.safetensors files in {body.path}")
    for name in body.sha256:
        if name != Path(name).name or name.startswith("."):
            raise admin_access.PathRefused(f"`sha256` key {name!r} must be a plain file name")
    verify_files(directory, body.sha256)
    try:
        reference = state.reference_specs()
    except FileNotFoundError as error:
        raise validation.WeightsRefused([f"cannot check the update: {error}"]) from None
    validation.check_files(files, reference, check_finite=state.check_finite)
    return directory


def refuse(state: AdminState, version: int, reason: str) -> JSONResponse:
    """422 naming what is wrong with an update; the engine keeps serving what it had."""
    state.last_error = f"update to version {version} refused: {reason}"
    return _error(HTTPStatus.UNPROCESSABLE_ENTITY, f"refused: {reason}")


@router.post("/update_weights")
async def update_weights(request: Request, body: UpdateWeightsRequest) -> JSONResponse:
    state = _state(request)
    directory = None
    if body.source == "path":
        try:
            directory = await asyncio.to_thread(checked_update_dir, state, body)
        except admin_access.PathRefused as error:
            return _error(HTTPStatus.BAD_REQUEST, str(error))
        except (ChecksumMismatch, validation.WeightsRefused) as error:
            return refuse(state, body.version, str(error))
    async with state.lock:
        start = time.perf_counter()
        was_paused = await state.engine.is_paused()
        in_flight = (
            "already_paused"
            if was_paused
            else await pause_engine(state.engine, "wait", body.pause_timeout_s)
        )
        try:
            if directory is not None:
                load = state.engine.collective_rpc(
                    "rlbus_load_weights_from_dir", args=(str(directory),)
                )
            else:
                load = state.engine.collective_rpc(
                    "rlbus_receive_broadcast", args=(state.check_finite,)
                )
            results = await asyncio.wait_for(load, body.timeout_s)
            if refused := [r["refused"] for r in results if r.get("refused")]:
                return refuse(state, body.version, refused[0])
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
    try:
        adapter = admin_access.confined_dir("lora_path", body.lora_path, state.weights_root)
        admin_access.regular_files(adapter, "*", state.weights_root)
        for name in body.sha256:
            if name != Path(name).name or name.startswith("."):
                raise admin_access.PathRefused(f"`sha256` key {name!r} must be a plain file name")
        await asyncio.to_thread(verify_files, adapter, body.sha256)
    except admin_access.PathRefused as error:
        return _error(HTTPStatus.BAD_REQUEST, str(error))
    except ChecksumMismatch as error:
        return _error(HTTPStatus.UNPROCESSABLE_ENTITY, str(error))
    models = request.app.state.openai_serving_models
    async with state.lock:
        result = await models.load_lora_adapter(
            LoadLoRAAdapterRequest(
                lora_name=body.lora_name, lora_path=str(adapter), load_inplace=True
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
    """ASGI middleware: the admin token on backend_port, the public allow-list on the gate-facing
    listener, and the weights-version header on every response.

    The public gate reaches this app on a second, loopback listener (`GATE_PORT_ENV`) where only
    `gate.is_public` paths are served: a second check behind the gate's own allow-list.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        gate_port = os.environ.get(admin_access.GATE_PORT_ENV)
        self.gate_port = int(gate_port) if gate_port else None
        self.token = os.environ.get(admin_access.ADMIN_TOKEN_ENV) or None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if refusal := self.refusal(scope):
            await refusal(scope, receive, send)
            return
        app_state = scope["app"].state if "app" in scope else None

        async def send_with_version(message: Message) -> None:
            if message["type"] == "http.response.start":
                state = getattr(app_state, "rlbus", None)
                if state is not None:
                    headers = list(message.get("headers", []))
                    headers.append(
                        (WEIGHTS_VERSION_HEADER.lower().encode(), str(state.version).encode())
                    )
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_version)

    def refusal(self, scope: Scope) -> JSONResponse | None:
        """The answer to a request this listener must not serve, or None."""
        path = scope["path"]
        server = scope.get("server")
        if self.gate_port is not None and server is not None and server[1] == self.gate_port:
            if is_public(path):
                return None
            return JSONResponse(
                {
                    "error": f"{path} is not served on the gate-facing port; "
                    "call the engine port (backend_port) directly"
                },
                status_code=HTTPStatus.NOT_FOUND.value,
            )
        if self.token is None or path.rstrip("/") == "/health":
            return None
        header = dict(scope["headers"]).get(b"authorization")
        if admin_access.authorized(header.decode("latin-1") if header else None, self.token):
            return None
        return JSONResponse(
            {"error": f"{path} needs `Authorization: Bearer <admin token>` (admin.token_file)"},
            status_code=HTTPStatus.UNAUTHORIZED.value,
            headers={"WWW-Authenticate": "Bearer"},
        )


class RlbusAdminPlugin:
    """vLLM endpoint plugin (entry point `rlbus` in group `vllm.endpoint_plugins`)."""

    name = "rlbus"
    required_tasks = None

    def attach_router(self, app: FastAPI) -> None:
        """vLLM's call while it builds its app: our routes and middleware."""
        app.include_router(router)
        app.add_middleware(RlbusMiddleware)
        self.app = app

    async def init_state(self, engine_client: EngineClient, state: Any, args: Any) -> None:
        """vLLM's call once the engine client exists: our state, and the gate-facing listener."""
        state.rlbus = AdminState(
            engine_client, int(os.environ.get(INITIAL_VERSION_ENV, "0")), model=args.model
        )
        if port := os.environ.get(admin_access.GATE_PORT_ENV):
            # The gate-facing listener: same app, same event loop, loopback only.
            server = no_signal_server(self.app, "127.0.0.1", int(port))
            listener = asyncio.get_running_loop().create_task(server.serve())
            # A listener that cannot serve (port taken) must end the engine, not leave the
            # gate talking to nothing.
            terminate_on_failure(listener, "gate_listener")
            state.rlbus.gate_listener = listener
