"""A classic verifiers environment that lives in a venv of its own, played turn by turn.

`rl env install` gives a package that requires classic verifiers (before 0.4) a venv of its own
(its pins do not fit rlbus's venv) and records it in the index with kind `classic`. Here the
rollout worker starts `classic_vf_main.py` with that venv's python and hands the existing
adapter (`verifiers_adapter.adapt`) a stand-in of the classic shape whose methods are requests
to that process: the turn loop, the limits, the token-exact sequence and the scoring order are
the in-process adapter's, only the environment's own code runs over there.

The process is started on first use, one per environment per worker; requests go one at a time
(one stdin line, one stdout line). A request that fails on the other side fails its episode with
the environment's one-line error; a process that died fails the episodes in flight (their state
was there) and is started again, with the environment loaded, by the next request.
"""

import asyncio
import itertools
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rlbus_orchestrator.envs.base import Environment

SERVER_MAIN = Path(__file__).with_name("classic_vf_main.py")


class ClassicServerError(RuntimeError):
    """The classic environment's process failed a request or is gone."""


class ClassicProcess:
    """`python classic_vf_main.py` in the environment's venv, one request at a time; (re)started
    with the environment loaded whenever a request finds it not running."""

    def __init__(self, python: str, env_id: str, load: dict[str, Any]) -> None:
        self.python, self.env_id, self.load = python, env_id, load
        self.popen: subprocess.Popen[bytes] | None = None
        self.shape: dict[str, Any] = {}

    def start(self) -> None:
        self.popen = subprocess.Popen(
            [self.python, str(SERVER_MAIN)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=sys.stderr,
        )
        self.shape = self.exchange(self.load)

    def request(self, payload: dict[str, Any]) -> dict[str, Any]:
        if self.popen is None or self.popen.poll() is not None:
            self.start()
        return self.exchange(payload)

    def exchange(self, payload: dict[str, Any]) -> dict[str, Any]:
        assert self.popen is not None and self.popen.stdin is not None
        assert self.popen.stdout is not None
        try:
            self.popen.stdin.write(json.dumps(payload).encode() + b"\n")
            self.popen.stdin.flush()
            line = self.popen.stdout.readline()
        except OSError as error:
            line, why = b"", str(error)
        else:
            why = "it exited"
        if not line:
            raise ClassicServerError(f"environment {self.env_id!r}: its process is gone ({why})")
        answer = json.loads(line)
        if not answer.pop("ok", False):
            raise ClassicServerError(f"environment {self.env_id!r}: {answer.get('error')}")
        return answer

    def close(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            assert self.popen.stdin is not None
            self.popen.stdin.close()
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


class RemoteClassicEnv:
    """A stand-in of the classic verifiers shape (what `adapt` reads) over a `ClassicProcess`."""

    def __init__(self, env_id: str, module: str, python: str, args: dict[str, Any]) -> None:
        self.env_id = env_id
        load = {"op": "load", "module": module, "args": args}
        self.process = ClassicProcess(python, env_id, load)
        self.lock = asyncio.Lock()
        self.process.start()
        shape = self.process.shape
        self.message_type = shape["message_type"]
        if shape["is_group"]:
            self.envs: list[Any] = []  # `adapt` refuses a group
        self.max_turns = shape["max_turns"]
        self.system_prompt = shape["system_prompt"]
        self.oai_tools = shape["oai_tools"]
        self.dataset = shape["dataset"]
        self.eval_dataset = shape["eval_dataset"] or None
        self.episodes = itertools.count()
        funcs = [
            self.remote_reward(i, name, len(shape["funcs"]))
            for i, name in enumerate(shape["funcs"])
        ]
        self.rubric = SimpleNamespace(funcs=funcs, weights=shape["weights"])
        if shape["has_env_response"]:
            self.env_response, self.is_completed = self._env_response, self._is_completed
        elif shape["has_rollout"]:
            self.rollout = lambda *a, **k: None  # `adapt` refuses its own rollout()

    async def call(self, payload: dict[str, Any]) -> dict[str, Any]:
        async with self.lock:
            return await asyncio.to_thread(self.process.request, payload)

    async def setup_state(self, state: dict[str, Any]) -> dict[str, Any]:
        episode = f"e{next(self.episodes)}"
        await self.call({"op": "setup", "episode": episode, "state": state})
        return {"_episode": episode}

    async def _is_completed(self, messages: list[dict[str, Any]], state: dict[str, Any]) -> bool:
        request = {"op": "is_completed", "messages": messages, "turn": state.get("turn", 0)}
        return (await self.call({**request, "episode": state["_episode"]}))["done"]

    async def _env_response(
        self, messages: list[dict[str, Any]], state: dict[str, Any]
    ) -> list[dict[str, Any]]:
        request = {"op": "env_response", "episode": state["_episode"], "messages": messages}
        return (await self.call(request))["messages"]

    def remote_reward(self, index: int, name: str, count: int) -> Any:
        async def reward(**available: Any) -> float:
            state = available.get("state") or {}
            request = {
                "op": "reward",
                "episode": state.get("_episode", ""),
                "index": index,
                "last": index == count - 1,
                **{k: available.get(k) for k in ("prompt", "completion", "answer", "info")},
                "task": (available.get("info") or {}).get("task"),
            }
            return (await self.call(request))["value"]

        reward.__name__ = name
        return reward

    def close(self) -> None:
        self.process.close()


def classic_environment(env_id: str, module: str, python: str, args: dict[str, Any]) -> Environment:
    """The rlbus environment over the classic verifiers environment `module` of the venv whose
    interpreter is `python` (module docstring)."""
    from rlbus_orchestrator.envs.verifiers_adapter import adapt

    return adapt(env_id, RemoteClassicEnv(env_id, module, python, args))
