"""The weights-version header is one contract (rlbus.wire.weights.WEIGHTS_VERSION_HEADER) between
the inference admin middleware, which stamps every engine response, and the orchestrator's
inference client, which attributes a completion to the version that produced it."""

import asyncio

import httpx
from fastapi import FastAPI

from rlbus.wire.replicas import ReplicaInfo
from rlbus.wire.tasks import SamplingArgs
from rlbus.wire.weights import WEIGHTS_VERSION_HEADER
from rlbus_inference.admin import AdminState, RlbusMiddleware
from rlbus_orchestrator.client import InferenceClient, ReplicaPool


def make_engine_app(version: int) -> FastAPI:
    """A stand-in for vLLM's OpenAI app (one route), wrapped in the real admin middleware."""
    app = FastAPI()
    app.state.rlbus = AdminState(engine_client=None, version=version)

    @app.post("/v1/chat/completions")
    async def chat() -> dict:
        return {
            "prompt_token_ids": [1, 2],
            "choices": [
                {
                    "message": {"role": "assistant", "content": "a"},
                    "finish_reason": "stop",
                    "token_ids": [7],
                    "logprobs": {"content": [{"logprob": -0.5}]},
                }
            ],
        }

    app.add_middleware(RlbusMiddleware)
    return app


def test_the_version_the_engine_stamps_is_the_version_the_client_reads():
    pool = ReplicaPool()
    # The registry still says version 0: the header, not the registry, must win.
    pool.update([ReplicaInfo(replica_id="r", base_url="http://r/v1", model="m", weights_version=0)])
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=make_engine_app(version=12)))
    client = InferenceClient(pool, http, "m")

    async def chat():
        raw = await http.post("http://r/v1/chat/completions", json={})
        turn = await client.chat([{"role": "user", "content": "x"}], SamplingArgs())
        await http.aclose()
        return raw, turn

    raw, turn = asyncio.run(chat())
    assert raw.headers[WEIGHTS_VERSION_HEADER] == "12"
    assert turn.policy_version == 12
