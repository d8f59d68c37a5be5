"""verifiers 0.4 (`verifiers.v1`) environments, served by their own process: `vf:<taskset-id>`.

verifiers 0.4 pins openai>=2.54, which conflicts with rlbus's pins, so such an environment lives
in its own venv and runs as verifiers' `EnvServer` (started with that venv's python on
`vf_server_main.py`). The rollout worker speaks the server's protocol with its own client:

    rollout worker (rlbus venv)            EnvServer (env venv)          inference replica
    VfServerEnv.run_episode ──run──▶ ZMQ ROUTER ─ harness + rewards ──HTTP──▶ vLLM
          ▲                                 │
          └──── delta frames, then reply ───┘

Wire (ZMQ DEALER -> ROUTER, msgpack payloads; read from verifiers/v1/serve/{server,client}.py):

- request: three frames `[request_id, method, msgpack(payload)]`, method `health` (payload `{}`),
  `run` (`{task_data, client, model, sampling}`) or `cancel` (`{request_id}`);
- answers: three frames `[request_id, kind, msgpack(data)]`, kind `delta` zero or more times
  (a run's traces as they grow: `{trace, open?, nodes?, calls?, errors?, set?, discard?}`),
  then one `reply` (`{success, error, head, traces: [{id, nodes, calls}]}`). An answer outside
  this shape ends the client's receive loop, which fails every pending request with it
  (`VfClient`); `VfServerEnv` then connects again.

A trace's nodes carry token ids, a trainable mask and logprobs only when the server's model
client is verifiers' `train` client (it renders prompts itself and calls the replica's
`/inference/v1/generate`); the `eval` client records messages only, which scores but cannot
train. `trace_sample` turns one finished trace into a `RolloutSample`.

The dataset (task rows) comes from the env venv too: `vf_server_main.py tasks` prints each
task's `TaskData`, which a `run` request ships back whole. docs/environments.md has the setup.
"""

import asyncio
import atexit
import contextlib
import functools
import json
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import msgpack
import structlog
import zmq
import zmq.asyncio

from rlbus.wire.rollouts import RolloutSample
from rlbus.wire.tasks import ChatMessage, Problem, SamplingArgs
from rlbus_orchestrator.client import NoReplicaError, ReplicaPool
from rlbus_orchestrator.envs.base import ChatClient, Split

log = structlog.get_logger()

PREFIX = "vf:"
SERVER_MAIN = Path(__file__).with_name("vf_server_main.py")
LIST_FIELDS = ("nodes", "calls", "errors", "extra_usage", "request_rewrites", "response_rewrites")
"""Trace fields a delta appends to (verifiers.v1.serve.delta.LIST_FIELDS)."""


class VfServerError(RuntimeError):
    """The environment server failed a request or answered outside the protocol."""


def default_env_config(taskset_id: str) -> dict[str, Any]:
    """The env over `taskset_id`. Each agent role of its env class (whichever `env.id` names)
    gets the `null` harness (one chat program, no tools) in a local subprocess runtime where the
    config sets none, on the server side (`vf_server_main.ROLE_DEFAULTS`): only verifiers knows
    an env's roles."""
    return {"taskset": {"id": taskset_id}}


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`override` deep-merged onto `base`."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def load_tasks(python: str, env_config: dict[str, Any]) -> list[dict[str, Any]]:
    """The taskset's rows (dumped `TaskData`), read with the env venv's interpreter."""
    result = subprocess.run(
        [python, str(SERVER_MAIN), "tasks", json.dumps(env_config)],
        capture_output=True,
        text=True,
    )
    if result.returncode:
        raise VfServerError(f"listing tasks failed:\n{result.stderr[-2000:]}")
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


class VfServerProcess:
    """An `EnvServer` started with the env venv's python; stopped by its pid."""

    def __init__(self, python: str, env_config: dict[str, Any], max_concurrent: int = 0) -> None:
        config = json.dumps(env_config)
        self.popen = subprocess.Popen(
            [python, str(SERVER_MAIN), "serve", config, "tcp://127.0.0.1:0", str(max_concurrent)],
            stdout=subprocess.PIPE,
            text=True,
        )
        atexit.register(self.stop)

    def wait_address(self, timeout_s: float = 120.0) -> str:
        """The endpoint the server bound (it prints `address <endpoint>` once listening)."""
        assert self.popen.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.popen.stdout.readline()
            if line.startswith("address "):
                return line.split(maxsplit=1)[1].strip()
            if not line and self.popen.poll() is not None:
                raise VfServerError(f"env server exited with code {self.popen.returncode}")
        raise VfServerError(f"env server printed no address in {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


class VfClient:
    """Our client of verifiers' `EnvServer` protocol (see module docstring).

    One receive loop serves every request in flight. It is supervised: when it dies (a frame
    outside the protocol, a socket error, anything), every pending request fails at once with
    a `VfServerError` naming the cause, and so does every later request (`failure`); the
    client is not restarted, its owner (`VfServerEnv`) connects a new one."""

    def __init__(self, address: str, exit_code: Callable[[], int | None] = lambda: None) -> None:
        self.address = address
        self.exit_code = exit_code
        """The server process's exit code, None while it runs (or when it is not ours)."""
        self.ctx = zmq.asyncio.Context()
        self.socket = self.ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self._replies: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._deltas: dict[str, Callable[[dict[str, Any]], None]] = {}
        self._receiver: asyncio.Task[None] | None = None
        self.failure: str | None = None
        """Why the receive loop ended (None while it runs): every request fails with it."""

    async def _receive(self) -> None:
        while True:
            request_id, kind, payload = decoded_answer(await self.socket.recv_multipart())
            if kind == b"delta":
                self._apply_delta(request_id, payload)
            elif (future := self._replies.pop(request_id, None)) and not future.done():
                future.set_result(payload)

    def _apply_delta(self, request_id: str, delta: dict[str, Any]) -> None:
        """Hand a delta to its run; one that does not fit the run fails that run only."""
        on_delta = self._deltas.get(request_id)
        if on_delta is None:
            return
        try:
            on_delta(delta)
        except Exception as error:  # any bad delta is that run's error, not the loop's
            self._deltas.pop(request_id, None)
            if (future := self._replies.pop(request_id, None)) and not future.done():
                future.set_exception(
                    VfServerError(f"env server at {self.address} sent a bad delta: {error!r}")
                )

    async def _receive_supervised(self) -> None:
        """The receive loop; whatever ends it fails every pending request with the cause."""
        try:
            await self._receive()
        except asyncio.CancelledError:
            self._fail_pending(f"the client of the env server at {self.address} was closed")
            raise
        except Exception as error:  # any death of the loop is reported, not lost
            log.error("vf_client_receive_failed", address=self.address, error=repr(error))
            cause = f"{type(error).__name__}: {error}"
            self._fail_pending(f"env server connection {self.address} failed ({cause})")

    def _fail_pending(self, failure: str) -> None:
        self.failure = failure
        replies, self._replies = self._replies, {}
        self._deltas.clear()
        for future in replies.values():
            if not future.done():
                future.set_exception(VfServerError(failure))

    async def request(
        self,
        method: str,
        payload: dict[str, Any],
        *,
        timeout_s: float | None = None,
        on_delta: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Send one request; its reply (raises `VfServerError` when it did not succeed)."""
        if self.failure is not None:
            raise VfServerError(self.failure)
        if self._receiver is None:
            self._receiver = asyncio.create_task(self._receive_supervised())
        request_id = uuid.uuid4().hex
        future = self._replies[request_id] = asyncio.get_running_loop().create_future()
        if on_delta is not None:
            self._deltas[request_id] = on_delta
        frames = [request_id.encode(), method.encode(), msgpack.packb(payload, use_bin_type=True)]
        try:
            await self.socket.send_multipart(frames)
            reply = await self.wait_reply(method, future, timeout_s)
        except TimeoutError:
            if method == "run":  # the server stops playing it (its reply is dropped)
                await self.send_cancel(request_id)
            raise
        finally:
            self._replies.pop(request_id, None)
            self._deltas.pop(request_id, None)
        if not reply.get("success", False):
            raise VfServerError(f"env server {method} failed: {reply.get('error')}")
        return reply

    async def send_cancel(self, request_id: str) -> None:
        cancel = msgpack.packb({"request_id": request_id}, use_bin_type=True)
        with contextlib.suppress(zmq.ZMQError):
            await self.socket.send_multipart([uuid.uuid4().hex.encode(), b"cancel", cancel])

    async def wait_reply(
        self, method: str, future: asyncio.Future[dict[str, Any]], timeout_s: float | None
    ) -> dict[str, Any]:
        """The reply, checking every second that the server process still runs (a dead server
        never answers); TimeoutError past `timeout_s`; the receive loop's failure at once."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not future.done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"env server {method} did not answer in {timeout_s:g} s")
            await asyncio.wait({future}, timeout=1.0 if left is None else min(left, 1.0))
            if not future.done() and (code := self.exit_code()) is not None:
                raise VfServerError(
                    f"env server at {self.address} exited with code {code} during {method}"
                )
        return future.result()

    async def wait_healthy(self, timeout_s: float = 120.0) -> None:
        """Returns once the server answers `health`; `VfServerError` past `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await self.request("health", {}, timeout_s=2.0)
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise VfServerError(f"env server at {self.address} not healthy") from None

    async def run(
        self,
        task_data: dict[str, Any],
        client: dict[str, Any],
        model: str,
        sampling: dict[str, Any],
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """One episode: `{"head": ..., "traces": [trace dict, ...]}` (traces as dumped
        `verifiers.v1.Trace`s, assembled from the deltas). Past `timeout_s` the episode is
        cancelled on the server and `VfServerError` names the timeout."""
        traces: dict[str, dict[str, Any]] = {}
        payload = {"task_data": task_data, "client": client, "model": model, "sampling": sampling}
        try:
            reply = await self.request(
                "run", payload, timeout_s=timeout_s, on_delta=lambda d: apply_delta(traces, d)
            )
        except TimeoutError as error:
            raise VfServerError(
                f"{error} (args.episode_timeout_s); the episode was abandoned"
            ) from None
        return {"head": reply.get("head"), "traces": finished_traces(traces, reply["traces"])}

    async def close(self) -> None:
        """Stop receiving (requests still pending fail) and close the socket."""
        if self._receiver is not None:
            self._receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._receiver
        self.socket.close()
        self.ctx.term()


def decoded_answer(frames: list[bytes]) -> tuple[str, bytes, dict[str, Any]]:
    """(request id, kind, payload) of one answer; `VfServerError` for frames outside the
    protocol (the receive loop cannot tell whose they were, so they end it)."""
    if len(frames) != 3:
        raise VfServerError(f"expected 3 frames from the env server, got {len(frames)}")
    request_id, kind, data = frames
    if kind not in (b"delta", b"reply"):
        raise VfServerError(f"unknown answer kind {kind!r} from the env server")
    try:
        payload = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except ValueError as error:  # msgpack's decode errors are ValueErrors
        raise VfServerError(f"undecodable {kind.decode()} payload: {error!r}") from error
    if not isinstance(payload, dict):
        raise VfServerError(f"{kind.decode()} payload is a {type(payload).__name__}, not a map")
    return request_id.decode(), kind, payload


def apply_delta(traces: dict[str, dict[str, Any]], delta: dict[str, Any]) -> None:
    """Fold one `delta` frame into the traces of a run (semantic links, routing repairs and
    previews, which rlbus does not use, are ignored)."""
    trace_id = delta["trace"]
    if delta.get("discard"):  # a retried attempt abandons its traces
        traces.pop(trace_id, None)
        return
    if trace_id not in traces:
        traces[trace_id] = {**delta["open"], **{field: [] for field in LIST_FIELDS}}
    trace = traces[trace_id]
    for field in LIST_FIELDS:
        trace[field].extend(delta.get(field) or [])
    trace.update(delta.get("set") or {})


def finished_traces(
    traces: dict[str, dict[str, Any]], summaries: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The reply's traces in its order, checked against the sizes the server reports."""
    out = []
    for summary in summaries:
        trace = traces.get(summary["id"])
        if trace is None or (len(trace["nodes"]), len(trace["calls"])) != (
            summary["nodes"],
            summary["calls"],
        ):
            raise VfServerError(f"trace {summary['id']} did not assemble from its deltas")
        out.append(trace)
    return out


def last_branch(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The root-to-leaf path ending at the last node (one training sequence)."""
    path: list[dict[str, Any]] = []
    index: int | None = len(nodes) - 1
    while index is not None:
        path.append(nodes[index])
        index = nodes[index].get("parent")
    return path[::-1]


def trace_sample(
    trace: dict[str, Any], sampling: SamplingArgs, policy_version: int
) -> RolloutSample:
    """A scored `RolloutSample` from a finished trace: prompt = the tokens before the first
    sampled one; completion = the rest, masked where the model did not sample it."""
    if not trace.get("ok", False):
        errors = trace.get("errors") or [{}]
        raise VfServerError(
            f"episode failed: {errors[-1].get('type')}: {errors[-1].get('message')}"
        )
    branch = last_branch(trace["nodes"])
    off_branch = [n for n in trace["nodes"] if n.get("sampled") and not any(n is b for b in branch)]
    if off_branch:
        raise VfServerError(
            f"the episode's trace branches ({len(off_branch)} sampled node(s) off its last "
            "branch: the harness rewrote the conversation between model calls); rlbus trains one "
            "token-exact sequence per episode, so such a harness is not played"
        )
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    for node in branch:
        node_mask = [int(m) for m in node.get("mask") or []]
        node_logprobs = iter(node.get("logprobs") or [])
        ids += node.get("token_ids") or []
        mask += node_mask
        logprobs += [next(node_logprobs, 0.0) if m else 0.0 for m in node_mask]
    if 1 not in mask:
        raise VfServerError(
            "the trace has no sampled tokens: serve the environment with the `train` model client "
            "(args.client_type, the default), which records token ids and logprobs"
        )
    start = mask.index(1)
    rewards = {name: r for name, r in (trace.get("rewards") or {}).items() if r is not None}
    replies = [n for n in trace["nodes"] if n.get("sampled")]
    calls = [c for c in trace.get("calls") or [] if c.get("error") is None]
    finish_reason = calls[-1].get("finish_reason") if calls else None
    return RolloutSample(
        prompt_token_ids=ids[:start],
        completion_token_ids=ids[start:],
        completion_logprobs=logprobs[start:],
        completion_mask=mask[start:],
        reward=sum(r["score"] * r.get("weight", 1.0) for r in rewards.values()),
        reward_components={name: r["score"] for name, r in rewards.items()},
        finish_reason=finish_reason,
        is_truncated=finish_reason == "length",
        policy_version=policy_version,
        timings={"episode": episode_seconds(trace)},
        temperature=sampling.temperature,
        completion_text=(replies[-1]["message"].get("content") or "") if replies else "",
        num_turns=max(1, sum(1 for n in branch if n.get("sampled"))),
    )


def episode_seconds(trace: dict[str, Any]) -> float:
    timing = trace.get("timing") or {}
    agent = timing.get("agent") or {}
    return max(0.0, float(agent.get("end") or 0.0) - float(agent.get("start") or 0.0))


def problem_of(task_data: dict[str, Any]) -> Problem:
    """The rlbus view of a row (for logs and samples); the row itself rides in `info`."""
    messages = []
    if task_data.get("system_prompt"):
        messages.append(ChatMessage(role="system", content=task_data["system_prompt"]))
    prompt = task_data.get("prompt")
    if isinstance(prompt, str):
        messages.append(ChatMessage(role="user", content=prompt))
    else:
        messages += [
            ChatMessage(role=m["role"], content=str(m.get("content"))) for m in prompt or []
        ]
    return Problem(
        messages=messages, answer=task_data.get("answer"), info={"vf_task_data": task_data}
    )


@runtime_checkable
class PooledClient(Protocol):
    """The rollout worker's `InferenceClient`: it picks replicas from its pool."""

    pool: ReplicaPool
    model: str


@runtime_checkable
class NamedReplicaClient(Protocol):
    """A client without a pool (tests): it names its replica."""

    base_url: str
    model: str


@contextlib.contextmanager
def replica_endpoint(client: ChatClient) -> Iterator[tuple[str, str, int]]:
    """(OpenAI API root, model, weights version) of the replica an episode should use, counted
    as outstanding on it while the episode runs: the rollout worker's `InferenceClient` picks
    from its replica pool (least outstanding); a client without a pool (tests) names one with
    `base_url` and `model`."""
    if not isinstance(client, PooledClient):
        assert isinstance(client, NamedReplicaClient), "a client with a pool or a base_url"
        yield client.base_url, client.model, 0
        return
    replica = client.pool.pick(set())
    if replica is None:  # the worker naks the task and waits for a replica
        raise NoReplicaError("no inference replica is ready for the environment server")
    info = replica.info
    replica.outstanding += 1
    replica.num_requests += 1
    try:
        yield info.base_url, info.model or client.model, info.weights_version
    finally:
        replica.outstanding -= 1


class VfServerEnv:
    """An rlbus `Environment` over a verifiers 0.4 environment server (module docstring).

    Args (`[orchestrator.env.args]`): `python` (the env venv's interpreter, required),
    `env` (verifiers `EnvConfig` fields deep-merged onto `default_env_config`, e.g.
    `{taskset = {num_tasks = 64}}`), `address` (an `EnvServer` already running; otherwise one
    is started on first use, and again after it exits), `client_type` (`train`, default, or
    `eval`), `renderer_model` (the tokenizer the `train` client renders with; default the
    served model),
    `max_concurrent` (episodes the started server plays at once, default 8: verifiers' local
    runtime runs each episode's program as its own python process, so more only queue for the
    CPU; 0 = no bound), `episode_timeout_s` (an episode that has not ended by then is
    cancelled and fails, default 600)."""

    def __init__(
        self,
        env_id: str,
        *,
        python: str | None = None,
        env: dict[str, Any] | None = None,
        address: str | None = None,
        client_type: str = "train",
        renderer_model: str | None = None,
        max_concurrent: int = 8,
        episode_timeout_s: float = 600.0,
    ) -> None:
        self.env_id = env_id
        if max_concurrent < 0:
            raise ValueError(
                f"environment {env_id!r}: args.max_concurrent must be >= 0 (0 = no bound), "
                f"got {max_concurrent}"
            )
        self.max_concurrent = max_concurrent
        if episode_timeout_s <= 0:
            raise ValueError(
                f"environment {env_id!r}: args.episode_timeout_s must be > 0, "
                f"got {episode_timeout_s}"
            )
        self.episode_timeout_s = episode_timeout_s
        if address is None and (python is None or not Path(python).exists()):
            raise ValueError(
                f"environment {env_id!r}: args.python must be the python of a venv holding the "
                f"environment (got {python!r}); create one with `uv venv -p 3.11 <dir> && uv pip "
                "install --python <dir>/bin/python -e environments/<name>` (docs/environments.md)"
            )
        self.python = python
        self.env_config = merged(default_env_config(env_id.removeprefix(PREFIX)), env or {})
        self.address = address
        self.client_type = client_type
        self.renderer_model = renderer_model
        self.process: VfServerProcess | None = None
        self._client: VfClient | None = None
        self._starting = asyncio.Lock()

    @functools.cached_property
    def tasks(self) -> list[dict[str, Any]]:
        """The taskset's rows, listed on first use (~6 s: the env venv imports verifiers); a
        rollout worker never needs them, its tasks carry their row."""
        if self.python is None:
            raise VfServerError(f"environment {self.env_id!r}: listing tasks needs args.python")
        return load_tasks(self.python, self.env_config)

    def num_examples(self, split: Split) -> int | None:
        return len(self.tasks)

    def example(self, split: Split, index: int) -> Problem:
        return problem_of(self.tasks[index % len(self.tasks)])

    async def client(self) -> VfClient:
        """The connection to the server, starting the server first when it is ours."""
        async with self._starting:
            if self._client is not None and self._client.failure is not None:
                # its receive loop died (its episodes failed with the cause): connect again
                log.warning("vf_env_reconnecting", env_id=self.env_id, failure=self._client.failure)
                await self._client.close()
                self._client = None
            if self._client is None:
                if self.address is None:
                    assert self.python is not None
                    self.process = VfServerProcess(
                        self.python, self.env_config, self.max_concurrent
                    )
                    self.address = await asyncio.to_thread(self.process.wait_address)
                exit_code = self.process.popen.poll if self.process else (lambda: None)
                self._client = VfClient(self.address, exit_code)
                await self._client.wait_healthy()
            return self._client

    def client_config(self, base_url: str, model: str) -> dict[str, Any]:
        config: dict[str, Any] = {"type": self.client_type, "base_url": base_url}
        config["api_key_var"] = "RLBUS_INFERENCE_API_KEY"  # unset: verifiers sends "EMPTY"
        if self.client_type == "train":
            config["renderer_model_name"] = self.renderer_model or model
        return config

    async def run_episode(
        self, client: ChatClient, problem: Problem, sampling: SamplingArgs
    ) -> RolloutSample:
        vf_sampling = {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens,
            **sampling.extra,
        }
        server = await self.client()
        with replica_endpoint(client) as (base_url, model, version):
            try:
                episode = await server.run(
                    problem.info["vf_task_data"],
                    self.client_config(base_url, model),
                    model,
                    vf_sampling,
                    timeout_s=self.episode_timeout_s,
                )
            except VfServerError:
                await self.forget_dead_server()
                raise
        traces = [t for t in episode["traces"] if t.get("agent", {}).get("trainable", True)]
        if not traces:
            errors = (episode["head"] or {}).get("errors")
            raise VfServerError(f"episode produced no trainable trace (errors: {errors})")
        if len(traces) > 1:
            raise VfServerError(
                f"episode produced {len(traces)} trainable traces (several trainable agents); "
                "rlbus trains one sequence per episode: mark all agents but one untrainable"
            )
        return trace_sample(traces[0], sampling, version)

    async def forget_dead_server(self) -> None:
        """After a failed episode: when the server we started has exited, drop it, so the next
        episode starts a new one (the failed episode's group is retried by the worker)."""
        async with self._starting:
            if self.process is not None and self.process.popen.poll() is not None:
                log.warning(
                    "vf_env_server_exited",
                    env_id=self.env_id,
                    code=self.process.popen.returncode,
                )
                if self._client is not None:
                    await self._client.close()
                self._client, self.process, self.address = None, None, None

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
        if self.process is not None:
            await asyncio.to_thread(self.process.stop)
            self.process = None
