"""Attach mode: check an already running `inference` server and reset its weights, before the
attach process registers it for the run (docs/inference.md, "Attach to a running inference
server").

    1. public /health answers within attach.timeout_s (else exit 4: the server may be starting;
       the launcher retries within its restart budget)
    2. public /v1/models lists the run's model name (else exit 2: another model is served)
    3. admin /liveness answers, with the admin token when one is configured (else exit 2/4)
    4. admin /update_weights loads the run's model directory as version 0, through the same
       checks as every update (names, shapes, dtypes, finite): a second run never starts from
       the trained weights a first run left behind; a model that does not fit is exit 2

Plain HTTP calls from this process, as an operator would make them: the server needs nothing
new, and it never learns that a run attached.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import structlog

from rlbus.configs.inference import InferenceConfig
from rlbus.lifecycle import EXIT_INPUT_MISSING
from rlbus_inference import engine_process, validation
from rlbus_inference.replica import served_model_name

log = structlog.get_logger()

EXIT_CONFIG = 2
RETRY_S = 0.5
"""Pause between two attempts to reach a server that does not answer yet."""
START_HINT = "start it in another terminal with `uv run inference @ <the run's rl.toml>`"


class AttachFailed(RuntimeError):
    """The server cannot be attached; `code` is the exit code (2: never restarted, 4: retried)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def prepare(config: InferenceConfig, token: str | None) -> None:
    """Steps 1-4 of the module docstring; AttachFailed (one line) when one fails."""
    attach = engine_process.attached_server(config)
    headers = {"Authorization": f"Bearer {token}"} if token else None
    with (
        httpx.Client(timeout=attach.timeout_s) as public,
        httpx.Client(timeout=attach.timeout_s, headers=headers) as admin,
    ):
        first_answer(public, attach.url + "/health", attach.timeout_s, what="the server")
        served = check_model(public, config)
        liveness = first_answer(
            admin,
            engine_process.engine_url(config) + "/liveness",
            attach.timeout_s,
            what="its admin port",
        )
        if liveness.get("paused"):
            log.warning("attached_server_paused", admin_url=attach.admin_url)
        reset_weights(admin, config, served=", ".join(served))


def first_answer(client: httpx.Client, url: str, timeout_s: float, *, what: str) -> dict:
    """The JSON (or {}) of the first 200 answer of GET `url` within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            response = client.get(url, timeout=max(0.5, deadline - time.monotonic()))
        except httpx.HTTPError as error:
            reason = f"no answer ({type(error).__name__})"
        else:
            if response.status_code == 401:
                raise AttachFailed(
                    f"{url} answered 401: give the server's admin token "
                    "(--inference.admin.token-file or env RLBUS_ADMIN_TOKEN)",
                    EXIT_CONFIG,
                )
            if response.status_code == 200:
                return json_or_empty(response)
            reason = f"answered {response.status_code}"
        if time.monotonic() + RETRY_S > deadline:
            raise AttachFailed(
                f"{what} at {url} {reason} within {timeout_s:g} s: is `inference` running "
                f"there? {START_HINT} (--inference.attach URL names another server)",
                EXIT_INPUT_MISSING,
            )
        time.sleep(RETRY_S)


def served_models(public: httpx.Client, config: InferenceConfig) -> list[str]:
    response = public.get(engine_process.attached_server(config).url + "/v1/models")
    response.raise_for_status()
    return [entry["id"] for entry in response.json().get("data", [])]


def check_model(public: httpx.Client, config: InferenceConfig) -> list[str]:
    """The names the server serves, which must include the run's model (what the rollout
    clients ask for)."""
    wanted = served_model_name(config)
    served = served_models(public, config)
    if wanted not in served:
        raise AttachFailed(
            f"the server at {engine_process.attached_server(config).url} serves {', '.join(served) or 'no model'}, "
            f"not the run's model {wanted}: {START_HINT}, or attach to a server of {wanted}",
            EXIT_CONFIG,
        )
    return served


def model_dir(model: str) -> Path:
    """The directory of the run's model safetensors (a local directory or the HF cache)."""
    try:
        return validation.model_files(model)[0].parent.resolve()
    except FileNotFoundError as error:
        raise AttachFailed(f"cannot reset the attached server: {error}", EXIT_CONFIG) from None


def reset_weights(admin: httpx.Client, config: InferenceConfig, *, served: str) -> None:
    """Load the run's model as version 0 (the trainer's step 0), checked like any update."""
    directory = model_dir(config.vllm.model)
    timeout_s = config.weights_apply_timeout_s
    start = time.perf_counter()
    try:
        response = admin.post(
            engine_process.engine_url(config) + "/update_weights",
            json={"version": 0, "path": str(directory), "timeout_s": 0.9 * timeout_s},
            timeout=timeout_s,
        )
    except httpx.HTTPError as error:
        raise AttachFailed(
            f"resetting the weights of {engine_process.engine_url(config)}: no answer "
            f"({type(error).__name__})",
            EXIT_INPUT_MISSING,
        ) from None
    if response.status_code == 200:
        log.info(
            "attached_weights_reset",
            model=config.vllm.model,
            path=str(directory),
            seconds=round(time.perf_counter() - start, 3),
        )
        return
    reason = error_text(response)
    if response.status_code == 422:
        raise AttachFailed(
            f"the server at {engine_process.attached_server(config).url} serves {served}, whose tensors differ from "
            f"the run's model {config.vllm.model} ({reason}): serve the run's model",
            EXIT_CONFIG,
        )
    if response.status_code == 400:
        raise AttachFailed(
            f"the server at {engine_process.engine_url(config)} refused the run's model directory "
            f"({reason}): start it without --admin.weights-root and --run-dir, so it accepts "
            "the run's directories",
            EXIT_CONFIG,
        )
    raise AttachFailed(
        f"resetting the weights of {engine_process.engine_url(config)}: {response.status_code} {reason}",
        EXIT_INPUT_MISSING,
    )


def json_or_empty(response: httpx.Response) -> dict:
    """The JSON object of `response` ({} for another body: vLLM's /health has none)."""
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def error_text(response: httpx.Response) -> str:
    return str(json_or_empty(response).get("error") or response.text)[:500]
