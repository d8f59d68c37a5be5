"""Inference over HTTP: pick a replica (least outstanding requests), ask for tokens + logprobs.

`ReplicaPool` holds the replicas known from the registry (bus KV, refreshed by the worker) or from
static URLs. `InferenceClient` is the `ChatClient` episodes use: `chat_n` sends one OpenAI chat
completion with `n` choices and vLLM's `return_token_ids` and `logprobs`, and reads the shared
prompt token ids, each choice's own completion token ids and per-token logprobs, and the weights
version from the `X-Rlbus-Weights-Version` header (falling back to the registry's version);
`chat` is `chat_n` with n=1. One request for a whole group lets vLLM schedule its samples together
and share the prompt's prefix; with a `seed`, vLLM seeds choice `i` with `seed + i`
(vllm/v1/engine/parallel_sampling.py), so the choices still differ. Greedy sampling (temperature
0) with n > 1 is refused by vLLM (`n must be 1 when using greedy sampling`, HTTP 400); every
greedy sample is the same completion, so `chat_n` asks for one and copies it.

Deadlines and back-off (`OrchestratorConfig.http`): every call has a connect and a read timeout
(`make_http_client`). A replica that fails (connection refused, timeout, 5xx, a 200 that is not a usable
completion) is backed off:
skipped for `backoff_s`, doubling with each further failure up to `backoff_max_s`, reset by one
success; failures of requests already in flight while it is backed off do not count again, so a
dead replica costs one `replica_backed_off` line per back-off, not one per request. Each back-off
also asks the worker to re-read the registry at once (`ReplicaPool.refresh_now`). The request is
retried on another replica (`max_attempts`); when none is left the call raises `NoReplicaError`
and the worker waits for a replica, then naks the task for later.
"""

import asyncio
import copy
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import structlog
from opentelemetry.trace import SpanKind

from rlbus.configs.orchestrator import InferenceHttpConfig
from rlbus.netutil import CLIENT_KEEPALIVE_S
from rlbus.obs import tracing
from rlbus.obs.metrics import timed_transport
from rlbus.wire.replicas import ReplicaInfo
from rlbus.wire.tasks import SamplingArgs, ToolCall, ToolFunction
from rlbus.wire.weights import WEIGHTS_VERSION_HEADER
from rlbus_orchestrator.envs.base import ChatTurn, TurnRequest

log = structlog.get_logger()

T = TypeVar("T")


GREEDY_TEMPERATURE = 1e-5
"""vLLM samples greedily below this temperature (`vllm.sampling_params._SAMPLING_EPS`)."""


class NoReplicaError(RuntimeError):
    """No inference replica is reachable right now."""


class BadResponseError(ValueError):
    """A replica answered 200 with something that is not a usable completion."""


@dataclass
class Replica:
    info: ReplicaInfo
    outstanding: int = 0
    down_until: float = 0.0
    num_requests: int = 0
    failures: int = 0
    """Consecutive failures (0: healthy); sets the back-off."""


@dataclass
class ReplicaPool:
    """Replicas by id, with in-flight counts for least-outstanding choice."""

    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    replicas: dict[str, Replica] = field(default_factory=dict)
    refresh_now: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a replica is backed off: the registry refresher re-reads at once."""

    @classmethod
    def from_config(cls, config: InferenceHttpConfig) -> "ReplicaPool":
        return cls(backoff_s=config.backoff_s, backoff_max_s=config.backoff_max_s)

    def update(self, infos: list[ReplicaInfo]) -> None:
        """Replace the known set (counts and back-off of replicas that stay are kept; a replica
        that registered again, e.g. restarted, starts healthy)."""
        fresh = {i.replica_id: i for i in infos if i.status in ("ready", "updating_weights")}
        for rid in list(self.replicas):
            if rid not in fresh:
                del self.replicas[rid]
        for rid, info in fresh.items():
            known = self.replicas.get(rid)
            if known is None:
                self.replicas[rid] = Replica(info)
                continue
            if (known.info.base_url, known.info.started_at) != (info.base_url, info.started_at):
                known.failures, known.down_until = 0, 0.0
            known.info = info

    def pick(self, exclude: set[str], prefer: str | None = None) -> Replica | None:
        """The replica with the fewest outstanding requests, or `prefer` (the replica of an
        episode's earlier turns: its prefix cache holds the conversation) while it is up."""
        now = time.monotonic()
        alive = [
            r for rid, r in self.replicas.items() if rid not in exclude and r.down_until <= now
        ]
        preferred = [r for r in alive if r.info.replica_id == prefer]
        if preferred:
            return preferred[0]
        return min(alive, key=lambda r: (r.outstanding, r.num_requests), default=None)

    def mark_down(self, replica: Replica, error: str) -> None:
        """Back `replica` off (module docstring); logs one line per back-off."""
        now = time.monotonic()
        if replica.down_until > now:  # a request sent before the back-off: already counted
            return
        replica.failures += 1
        delay = min(self.backoff_s * 2 ** (replica.failures - 1), self.backoff_max_s)
        replica.down_until = now + delay
        self.refresh_now.set()
        log.warning(
            "replica_backed_off",
            replica_id=replica.info.replica_id,
            url=replica.info.base_url,
            error=error,
            failures=replica.failures,
            retry_in_s=round(delay, 2),
        )

    def mark_up(self, replica: Replica) -> None:
        if replica.failures:
            log.info(
                "replica_recovered", replica_id=replica.info.replica_id, failures=replica.failures
            )
            replica.failures = 0

    def next_up_in_s(self) -> float | None:
        """Seconds until the first backed-off replica may be tried again (None: no replicas)."""
        if not self.replicas:
            return None
        return max(0.0, min(r.down_until for r in self.replicas.values()) - time.monotonic())

    def newest_version(self) -> int:
        return max((r.info.weights_version for r in self.replicas.values()), default=0)


def static_replicas(urls: list[str], model: str) -> list[ReplicaInfo]:
    """Registry entries for fixed URLs (`inference_urls`), e.g. an external OpenAI server."""
    return [
        ReplicaInfo(replica_id=f"static-{i}", base_url=u.rstrip("/"), model=model)
        for i, u in enumerate(urls)
    ]


def request_body(
    model: str,
    messages: list[dict[str, Any]],
    sampling: SamplingArgs,
    n: int = 1,
    turn: TurnRequest | None = None,
) -> dict[str, Any]:
    """The chat completion request for `n` samples; `n` is set last, so `sampling.extra` cannot
    change how many choices `parse_turns` expects."""
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
    if turn is not None and turn.tools:
        body["tools"] = turn.tools
    if turn is not None and turn.prompt_token_ids is not None:
        # vLLM's decode-side token reuse: the engine takes these ids as the prompt as they are
        # (vllm/renderers/online_renderer.py `_reused_prompt_token_ids`); `messages` are not
        # rendered, the tool parser still runs on the output.
        body["kv_transfer_params"] = {"prompt_token_ids": turn.prompt_token_ids}
    body["n"] = n
    return body


def parse_turns(data: dict[str, Any], n: int, version: int, replica_id: str) -> list[ChatTurn]:
    """One `ChatTurn` per choice (in `index` order) of a vLLM chat completion with
    return_token_ids + logprobs; `BadResponseError` when the answer is not one with `n` choices."""
    try:
        choices = sorted(data["choices"], key=lambda c: c.get("index", 0))
    except (KeyError, TypeError, AttributeError) as error:
        raise BadResponseError(f"not a chat completion ({type(error).__name__}: {error})") from None
    if len(choices) != n:
        raise BadResponseError(f"asked for {n} choices, got {len(choices)}")
    prompt = data.get("prompt_token_ids")
    if prompt is None:
        raise BadResponseError(
            "no prompt_token_ids: inference must support return_token_ids (vLLM >= 0.10)"
        )
    return [parse_choice(choice, list(prompt), version, replica_id) for choice in choices]


def parse_choice(
    choice: dict[str, Any], prompt_token_ids: list[int], version: int, replica_id: str
) -> ChatTurn:
    """The `ChatTurn` of one choice: its own token ids and one logprob per token."""
    try:
        ids = list(choice.get("token_ids") or [])
        logprobs = [c["logprob"] for c in (choice.get("logprobs") or {}).get("content") or []]
        text = choice["message"].get("content") or ""
        tool_calls = [parse_tool_call(call) for call in choice["message"].get("tool_calls") or []]
    except (KeyError, TypeError, AttributeError) as error:
        raise BadResponseError(f"not a chat completion ({type(error).__name__}: {error})") from None
    if len(ids) != len(logprobs):
        raise BadResponseError(f"{len(ids)} completion tokens but {len(logprobs)} logprobs")
    return ChatTurn(
        prompt_token_ids=prompt_token_ids,
        completion_token_ids=ids,
        completion_logprobs=logprobs,
        text=text,
        finish_reason=choice.get("finish_reason"),
        policy_version=version,
        replica_id=replica_id,
        tool_calls=tool_calls,
    )


def parse_tool_call(call: dict[str, Any]) -> ToolCall:
    """A tool call of a chat completion choice (`KeyError`/`TypeError` when it is not one)."""
    function = call["function"]
    arguments = function.get("arguments")
    return ToolCall(
        id=str(call.get("id") or ""),
        function=ToolFunction(
            name=str(function["name"]),
            arguments=arguments if isinstance(arguments, str) else json.dumps(arguments),
        ),
    )


def raise_for_status(response: httpx.Response) -> None:
    """`response.raise_for_status()`, with vLLM's reason in the message of a refused request
    (a 4xx says why in its body: a prompt longer than the context, a bad argument, ...)."""
    if 400 <= response.status_code < 500:
        try:
            error = response.json().get("error") or response.json()
            reason = error.get("message") if isinstance(error, dict) else str(error)
        except (ValueError, AttributeError):
            reason = response.text[:300]
        message = f"HTTP {response.status_code} from {response.request.url}: {reason}"
        raise httpx.HTTPStatusError(message, request=response.request, response=response)
    response.raise_for_status()


def describe(error: Exception) -> str:
    """What failed, in a few words (`HTTP 503`, `ConnectError: ...`, `ReadTimeout`)."""
    if isinstance(error, httpx.HTTPStatusError):
        return f"HTTP {error.response.status_code}"
    if isinstance(error, BadResponseError):
        return f"bad response: {error}"
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def make_http_client(config: InferenceHttpConfig, max_connections: int) -> httpx.AsyncClient:
    """The workers' HTTP client: every call has the configured connect and read deadlines."""
    timeout = httpx.Timeout(
        config.read_timeout_s,
        connect=config.connect_timeout_s,
        write=config.connect_timeout_s,
        pool=config.connect_timeout_s,
    )
    # timed: rlbus_http_client_request_seconds; a client given a transport ignores its `limits`
    # idle connections are closed before the server closes them (rlbus.netutil)
    limits = httpx.Limits(max_connections=max_connections, keepalive_expiry=CLIENT_KEEPALIVE_S)
    transport = timed_transport(limits)
    return httpx.AsyncClient(timeout=timeout, transport=transport)


class InferenceClient:
    """The `ChatClient` of rollout workers (see module docstring)."""

    def __init__(
        self, pool: ReplicaPool, http: httpx.AsyncClient, model: str, *, max_attempts: int = 4
    ) -> None:
        self.pool, self.http, self.model, self.max_attempts = pool, http, model, max_attempts

    async def chat(
        self,
        messages: list[dict[str, Any]],
        sampling: SamplingArgs,
        turn: TurnRequest | None = None,
        prefer: str | None = None,
    ) -> ChatTurn:
        """One sample; `turn` for a multi-turn episode's tools and exact prompt ids, `prefer` the
        replica of its earlier turns."""
        (one,) = await self.request(messages, sampling, 1, turn, prefer)
        return one

    async def chat_n(
        self, messages: list[dict[str, Any]], sampling: SamplingArgs, n: int
    ) -> list[ChatTurn]:
        """`n` samples of one prompt from one request (greedy: one sample, copied; module
        docstring)."""
        if n > 1 and sampling.temperature < GREEDY_TEMPERATURE:
            (turn,) = await self.request(messages, sampling, 1)
            return [turn] + [copy.deepcopy(turn) for _ in range(n - 1)]
        return await self.request(messages, sampling, n)

    async def request(
        self,
        messages: list[dict[str, Any]],
        sampling: SamplingArgs,
        n: int,
        turn: TurnRequest | None = None,
        prefer: str | None = None,
    ) -> list[ChatTurn]:
        """One chat completion with `n` choices, retried on another replica on failure (module
        docstring); a 4xx is raised as is."""
        body = request_body(self.model, messages, sampling, n, turn)
        return await self.on_a_replica(lambda replica: self._send(replica, body, n), prefer=prefer)

    async def tokenize_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        prefer: str | None = None,
    ) -> list[int]:
        """The token ids of `messages` rendered by the served model's chat template, with the
        generation prompt (vLLM's `/tokenize`): how a multi-turn episode learns the tokens of
        the messages it adds between two model turns (`envs.turns`)."""
        body: dict[str, Any] = {"messages": messages, "add_generation_prompt": True}
        if tools:
            body["tools"] = tools
        return await self.on_a_replica(lambda replica: self._tokenize(replica, body), prefer=prefer)

    async def on_a_replica(
        self, call: Callable[[Replica], Awaitable[T]], prefer: str | None = None
    ) -> T:
        """`call` on a replica, retried on another on failure (module docstring); a 4xx is
        raised as is, `NoReplicaError` when none answered."""
        tried: set[str] = set()
        for _ in range(self.max_attempts):
            replica = self.pool.pick(tried, prefer)
            if replica is None:
                break
            tried.add(replica.info.replica_id)
            try:
                result = await call(replica)
            except (httpx.TransportError, httpx.HTTPStatusError, BadResponseError) as error:
                if isinstance(error, httpx.HTTPStatusError) and error.response.status_code < 500:
                    raise
                self.pool.mark_down(replica, describe(error))
                continue
            self.pool.mark_up(replica)
            return result
        raise NoReplicaError(f"no inference replica answered (tried {sorted(tried) or 'none'})")

    async def _tokenize(self, replica: Replica, body: dict[str, Any]) -> list[int]:
        url = replica.info.base_url.removesuffix("/v1") + "/tokenize"
        response = await self.http.post(
            url, json={"model": replica.info.model or self.model, **body}
        )
        raise_for_status(response)
        try:
            tokens = response.json()["tokens"]
        except (ValueError, KeyError, TypeError) as error:
            raise BadResponseError(f"not a /tokenize answer ({type(error).__name__})") from None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise BadResponseError("not a /tokenize answer (tokens is not a list of ids)")
        return tokens

    async def _send(self, replica: Replica, body: dict[str, Any], n: int) -> list[ChatTurn]:
        model = replica.info.model or self.model
        replica.outstanding += 1
        replica.num_requests += 1
        started = time.perf_counter()
        url = f"{replica.info.base_url}/chat/completions"
        try:
            with tracing.span(
                tracing.GENERATE,
                kind=SpanKind.CLIENT,
                attributes={
                    "http.request.method": "POST",
                    "url.full": url,
                    tracing.REPLICA: replica.info.replica_id,
                    "gen_ai.request.model": model,
                    "rlbus.samples": n,
                },
            ) as span:
                response = await self.http.post(
                    url,
                    json={**body, "model": model},
                    headers=tracing.inject_headers({}),  # W3C traceparent: vLLM's spans join
                )
                span.set_attribute("http.response.status_code", response.status_code)
                raise_for_status(response)
        finally:
            replica.outstanding -= 1
        header = response.headers.get(WEIGHTS_VERSION_HEADER)
        try:
            version = int(header) if header is not None else replica.info.weights_version
            data = response.json()
        except ValueError as error:
            raise BadResponseError(f"{type(error).__name__}: {error}") from None
        turns = parse_turns(data, n, version, replica.info.replica_id)
        elapsed = time.perf_counter() - started
        for turn in turns:  # each sample waited for the whole request
            turn.timings["generate"] = elapsed
        return turns
