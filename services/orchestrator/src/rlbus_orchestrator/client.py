"""Inference over HTTP: pick a replica (least outstanding requests), ask for tokens + logprobs.

`ReplicaPool` holds the replicas known from the registry (bus KV, refreshed by the worker) or from
static URLs. `InferenceClient.chat` is the `ChatClient` episodes use: it sends one OpenAI chat
completion with vLLM's `return_token_ids` and `logprobs`, reads the prompt and completion token
ids and each token's logprob, and the weights version from the `X-Rlbus-Weights-Version` header
(falling back to the registry's version). A replica that fails (connection error, 5xx) is set
aside for `cooldown_s` and the request is retried on another; when none is left the call raises
`NoReplicaError` and the worker naks the task with a delay.
"""

import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import structlog

from rlbus.wire.replicas import ReplicaInfo
from rlbus.wire.tasks import SamplingArgs
from rlbus.wire.weights import WEIGHTS_VERSION_HEADER
from rlbus_orchestrator.envs.base import ChatTurn

log = structlog.get_logger()


class NoReplicaError(RuntimeError):
    """No inference replica is reachable right now."""


@dataclass
class Replica:
    info: ReplicaInfo
    outstanding: int = 0
    down_until: float = 0.0
    num_requests: int = 0


@dataclass
class ReplicaPool:
    """Replicas by id, with in-flight counts for least-outstanding choice."""

    cooldown_s: float = 2.0
    replicas: dict[str, Replica] = field(default_factory=dict)

    def update(self, infos: list[ReplicaInfo]) -> None:
        """Replace the known set (counts of replicas that stay are kept)."""
        fresh = {i.replica_id: i for i in infos if i.status in ("ready", "updating_weights")}
        for rid in list(self.replicas):
            if rid not in fresh:
                del self.replicas[rid]
        for rid, info in fresh.items():
            if rid in self.replicas:
                self.replicas[rid].info = info
            else:
                self.replicas[rid] = Replica(info)

    def pick(self, exclude: set[str]) -> Replica | None:
        now = time.monotonic()
        alive = [
            r for rid, r in self.replicas.items() if rid not in exclude and r.down_until <= now
        ]
        return min(alive, key=lambda r: (r.outstanding, r.num_requests), default=None)

    def mark_down(self, replica: Replica) -> None:
        replica.down_until = time.monotonic() + self.cooldown_s

    def newest_version(self) -> int:
        return max((r.info.weights_version for r in self.replicas.values()), default=0)


def static_replicas(urls: list[str], model: str) -> list[ReplicaInfo]:
    """Registry entries for fixed URLs (`inference_urls`), e.g. an external OpenAI server."""
    return [
        ReplicaInfo(replica_id=f"static-{i}", base_url=u.rstrip("/"), model=model)
        for i, u in enumerate(urls)
    ]


def request_body(
    model: str, messages: list[dict[str, Any]], sampling: SamplingArgs
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens,
        "logprobs": True,
        "return_token_ids": True,
    }
    if sampling.stop:
        body["stop"] = sampling.stop
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    body.update(sampling.extra)
    return body


def parse_turn(data: dict[str, Any], version: int, replica_id: str) -> ChatTurn:
    """Token ids, logprobs and text of a vLLM chat completion with return_token_ids + logprobs."""
    choice = data["choices"][0]
    ids = list(choice.get("token_ids") or [])
    logprobs = [c["logprob"] for c in (choice.get("logprobs") or {}).get("content") or []]
    assert data.get("prompt_token_ids") is not None, (
        "inference must support return_token_ids (vLLM >= 0.10)"
    )
    assert len(ids) == len(logprobs), f"{len(ids)} completion tokens but {len(logprobs)} logprobs"
    return ChatTurn(
        prompt_token_ids=list(data["prompt_token_ids"]),
        completion_token_ids=ids,
        completion_logprobs=logprobs,
        text=choice["message"].get("content") or "",
        finish_reason=choice.get("finish_reason"),
        policy_version=version,
        replica_id=replica_id,
    )


class InferenceClient:
    """The `ChatClient` of rollout workers (see module docstring)."""

    def __init__(
        self, pool: ReplicaPool, http: httpx.AsyncClient, model: str, *, max_attempts: int = 4
    ):
        self.pool, self.http, self.model, self.max_attempts = pool, http, model, max_attempts

    async def chat(self, messages: list[dict[str, Any]], sampling: SamplingArgs) -> ChatTurn:
        tried: set[str] = set()
        for _ in range(self.max_attempts):
            replica = self.pool.pick(tried)
            if replica is None:
                break
            tried.add(replica.info.replica_id)
            try:
                return await self._send(replica, messages, sampling)
            except (httpx.TransportError, httpx.HTTPStatusError) as error:
                if isinstance(error, httpx.HTTPStatusError) and error.response.status_code < 500:
                    raise
                self.pool.mark_down(replica)
                log.warning("replica_failed", replica_id=replica.info.replica_id, error=repr(error))
        raise NoReplicaError(f"no inference replica answered (tried {sorted(tried) or 'none'})")

    async def _send(
        self, replica: Replica, messages: list[dict[str, Any]], sampling: SamplingArgs
    ) -> ChatTurn:
        model = replica.info.model or self.model
        replica.outstanding += 1
        replica.num_requests += 1
        started = time.perf_counter()
        try:
            response = await self.http.post(
                f"{replica.info.base_url}/chat/completions",
                json=request_body(model, messages, sampling),
            )
            response.raise_for_status()
        finally:
            replica.outstanding -= 1
        header = response.headers.get(WEIGHTS_VERSION_HEADER)
        version = int(header) if header is not None else replica.info.weights_version
        turn = parse_turn(response.json(), version, replica.info.replica_id)
        turn.timings["generate"] = time.perf_counter() - started
        return turn
