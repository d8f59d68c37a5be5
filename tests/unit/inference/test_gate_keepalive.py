"""Idle keep-alive connections are closed by the client side first on every hop of a request
(orchestrator -> gate -> vLLM), so no request is sent on a connection its server is closing
(rlbus.netutil: CLIENT_KEEPALIVE_S, SERVER_KEEPALIVE_S)."""

import asyncio

import httpx
import vllm.envs

from rlbus.configs.orchestrator import InferenceHttpConfig
from rlbus.netutil import CLIENT_KEEPALIVE_S, SERVER_KEEPALIVE_S
from rlbus_inference.gate import PublicGate, no_signal_server
from rlbus_orchestrator.client import make_http_client


def test_the_gate_drops_idle_engine_connections_before_vllm_does():
    async def connector_keepalive() -> float:
        gate = PublicGate("http://127.0.0.1:1", [])
        try:
            return gate.client().connector._keepalive_timeout
        finally:
            await gate.aclose()

    assert asyncio.run(connector_keepalive()) == CLIENT_KEEPALIVE_S
    assert CLIENT_KEEPALIVE_S < vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE


def test_the_gate_keeps_client_connections_longer_than_clients_reuse_them():
    server = no_signal_server(PublicGate("http://127.0.0.1:1", []), "127.0.0.1", 0)
    assert server.config.timeout_keep_alive == SERVER_KEEPALIVE_S
    httpx_default = httpx.Limits().keepalive_expiry
    assert SERVER_KEEPALIVE_S > max(httpx_default, CLIENT_KEEPALIVE_S)


def test_the_orchestrator_client_drops_idle_connections_before_a_vllm_server_does():
    async def expiry() -> float:
        async with make_http_client(InferenceHttpConfig(), max_connections=4) as client:
            return client._transport._pool._keepalive_expiry

    assert asyncio.run(expiry()) == CLIENT_KEEPALIVE_S < vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
