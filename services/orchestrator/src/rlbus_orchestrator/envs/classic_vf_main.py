"""Run by a classic verifiers environment's own venv interpreter, never imported by rlbus.

Classic verifiers (before 0.4: `load_environment(**args)` returning a `MultiTurnEnv`,
`ToolEnv`, `SingleTurnEnv`) pins packages that rlbus's venv cannot hold, so `rl env install`
gives such a package a venv of its own and rlbus starts this file with that venv's python
(`rlbus_orchestrator.envs.classic_remote`). It imports only verifiers, the environment and the
standard library, and answers one JSON request per stdin line with one JSON line on stdout:

    {"op": "load", "module": m, "args": {...}}     -> the environment's shape and its datasets
    {"op": "setup", "episode": e, "state": {...}}  -> {} (setup_state; the state stays here)
    {"op": "is_completed", "episode": e, "messages": [...]}      -> {"done": bool}
    {"op": "env_response", "episode": e, "messages": [...]}      -> {"messages": [...]}
    {"op": "reward", "episode": e, "index": i, "last": bool, ...} -> {"value": float}

Each answer is `{"ok": true, ...}` or `{"ok": false, "error": "<one line>"}`. An episode's state
lives here (a classic environment may keep anything in it) and is dropped after its last
reward. The process ends when stdin closes (the rollout worker is gone).
"""

import asyncio
import importlib
import inspect
import json
import sys
from typing import Any

MAX_STATES = 10000
"""Episodes whose state is kept at once (an episode that failed mid-way never sends its last
reward; the oldest states go first)."""


async def maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def rows(dataset: Any) -> list[dict[str, Any]]:
    """A dataset's rows as JSON-ready dicts (the fields the rlbus side reads)."""
    if dataset is None:
        return []
    keep = ("prompt", "question", "answer", "info", "task")
    return [{k: row.get(k) for k in keep if row.get(k) is not None} for row in dataset]


def plain(message: Any) -> Any:
    dump = getattr(message, "model_dump", None)
    return dump(exclude_none=True) if callable(dump) else message


class Server:
    def __init__(self) -> None:
        self.env: Any = None
        self.states: dict[str, dict[str, Any]] = {}

    def load(self, request: dict[str, Any]) -> dict[str, Any]:
        module = importlib.import_module(request["module"])
        self.env = module.load_environment(**request.get("args", {}))
        env = self.env
        rubric = getattr(env, "rubric", None)
        funcs = list(getattr(rubric, "get_reward_funcs", lambda: [])() or [])
        weights = list(getattr(rubric, "get_reward_weights", lambda: [])() or [])
        return {
            "class": type(env).__name__,
            "message_type": getattr(env, "message_type", "chat"),
            "is_group": isinstance(getattr(env, "envs", None), list),
            "has_rollout": callable(getattr(env, "rollout", None)),
            "has_env_response": callable(getattr(env, "env_response", None))
            and callable(getattr(env, "is_completed", None)),
            "max_turns": getattr(env, "max_turns", None),
            "system_prompt": getattr(env, "system_prompt", None),
            "oai_tools": getattr(env, "oai_tools", None) or [],
            "funcs": [f.__name__ for f in funcs],
            "weights": weights or [1.0] * len(funcs),
            "dataset": rows(getattr(env, "dataset", None)),
            "eval_dataset": rows(getattr(env, "eval_dataset", None)),
        }

    async def setup(self, request: dict[str, Any]) -> dict[str, Any]:
        state = request["state"]
        setup = getattr(self.env, "setup_state", None)
        if callable(setup):
            state = (await maybe_await(setup(state))) or state
        if len(self.states) >= MAX_STATES:
            self.states.pop(next(iter(self.states)))
        self.states[request["episode"]] = state
        return {}

    def state_of(self, episode: str) -> dict[str, Any]:
        if episode not in self.states:
            raise LookupError(
                f"no state for episode {episode!r}: this process started after the episode did "
                "(the earlier one died)"
            )
        return self.states[episode]

    async def is_completed(self, request: dict[str, Any]) -> dict[str, Any]:
        state = self.state_of(request["episode"])
        state["turn"] = request.get("turn", state.get("turn", 0))
        done = await maybe_await(self.env.is_completed(request["messages"], state))
        return {"done": bool(done)}

    async def env_response(self, request: dict[str, Any]) -> dict[str, Any]:
        episode = request["episode"]
        answer = await maybe_await(
            self.env.env_response(request["messages"], self.state_of(episode))
        )
        if isinstance(answer, tuple) and len(answer) == 2:
            answer, new_state = answer
            if isinstance(new_state, dict):
                self.states[episode] = new_state
        if isinstance(answer, dict):
            answer = [answer]
        return {"messages": [plain(m) for m in answer or []]}

    async def reward(self, request: dict[str, Any]) -> dict[str, Any]:
        episode = request["episode"]
        state = self.states.get(episode, {})
        rubric = self.env.rubric
        func = rubric.get_reward_funcs()[request["index"]]
        value = await rubric.call_reward_func(
            func,
            prompt=request["prompt"],
            completion=request["completion"],
            answer=request.get("answer") or "",
            state=state,
            task=request.get("task") or "default",
            info=request.get("info") or {},
        )
        if request.get("last"):
            self.states.pop(episode, None)
        return {"value": float(value)}

    async def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "load":
            return self.load(request)
        if op in ("setup", "is_completed", "env_response", "reward"):
            return await getattr(self, op)(request)
        raise ValueError(f"unknown op {op!r}")


async def main() -> None:
    server = Server()
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            return
        request = json.loads(line)
        try:
            answer = {"ok": True, **(await server.handle(request))}
        except Exception as error:  # every failure is one line back, the server lives on
            answer = {"ok": False, "error": f"{type(error).__name__}: {error}".splitlines()[0]}
        sys.stdout.write(json.dumps(answer, default=str) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    asyncio.run(main())
