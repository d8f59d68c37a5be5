"""Adapter for verifiers-style environment packages (`module.load_environment(**args)`).

The adapted object follows the classic verifiers single-turn contract, read duck-typed so that
the `verifiers` package itself is not needed at import time:

- `dataset` / `eval_dataset` (or `get_dataset()` / `get_eval_dataset()`): indexable rows with
  `prompt` (a list of chat messages) or `question` (a string, wrapped with `system_prompt`),
  plus `answer` and optional `info`;
- `rubric.funcs` (reward functions) and optional `rubric.weights`; each function is called with
  the keyword arguments it names among `prompt`, `completion`, `answer`, `info`, `state`, `text`
  (plain or async). The reward is the weighted sum; every function is a named component.

`completion` is the assistant turn as a message list, as in verifiers; `text` is its content.

Classic verifiers multi-turn environments (`MultiTurnEnv`, `ToolEnv`, and `SingleTurnEnv`,
which is a multi-turn one with one turn) have `env_response(messages, state)` and
`is_completed(messages, state)`: `adapt` plays them turn by turn as an rlbus `MultiTurnEnv`
(`VerifiersMultiTurnAdapter`, token-exact like every multi-turn episode):

- before each environment reply `is_completed(prompt + conversation, state)` is asked; True
  ends the episode; else `env_response` gives the messages to add (a list, one message, or a
  `(messages, state)` pair; a new state replaces the old);
- `oai_tools` (the schemas of a `ToolEnv`'s tools) go with every request; the model's parsed
  tool calls reach `env_response`, which runs the tools its own way (`StatefulToolEnv`'s
  injected arguments included);
- `max_turns` of the environment applies unless the task sets its own limit; `setup_state`
  prepares the state (`prompt`, `answer`, `info`, `task`);
- the rubric scores the conversation as above, with `completion` holding every message after
  the prompt.

Shapes that cannot be played turn by turn are refused when the environment is built, with one
line naming the shape: completion-format (`message_type = "completion"`) environments, groups
of environments (`EnvGroup`: use one `[[orchestrator.env]]` per environment instead), and
environments whose own `rollout` replaces the turn loop without an `env_response`.
"""

import inspect
import time
from typing import Any

from rlbus.wire.rollouts import RolloutSample
from rlbus.wire.tasks import ChatMessage, Problem, SamplingArgs
from rlbus_orchestrator.envs.base import (
    ChatClient,
    Environment,
    Score,
    Split,
    problem_messages,
    sample_from_turns,
)
from rlbus_orchestrator.envs.multiturn import MultiTurnEnv, Reply


class UnsupportedEnvironmentError(ValueError):
    """A verifiers environment of a shape rlbus cannot play turn by turn."""


def _dataset(env: Any, split: Split) -> Any:
    names = ("dataset", "get_dataset") if split == "train" else ("eval_dataset", "get_eval_dataset")
    value = getattr(env, names[0], None)
    if value is None and callable(getattr(env, names[1], None)):
        value = getattr(env, names[1])()
    if value is None and split == "eval":
        return _dataset(env, "train")
    assert value is not None, f"verifiers environment has no {names[0]}"
    return value


def _row_problem(row: dict[str, Any], system_prompt: str | None) -> Problem:
    if row.get("prompt") is not None:
        messages = [
            ChatMessage(role=m["role"], content=m.get("content") or "") for m in row["prompt"]
        ]
    else:
        messages = [ChatMessage(role="user", content=row["question"])]
        if system_prompt:
            messages.insert(0, ChatMessage(role="system", content=system_prompt))
    return Problem(messages=messages, answer=row.get("answer"), info=dict(row.get("info") or {}))


async def _call_reward(func: Any, available: dict[str, Any]) -> float:
    params = inspect.signature(func).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = available if takes_all else {k: v for k, v in available.items() if k in params}
    value = func(**kwargs)
    if inspect.isawaitable(value):
        value = await value
    return float(value)


class VerifiersAdapter:
    """An rlbus `Environment` over a verifiers-style environment object."""

    def __init__(self, env_id: str, env: Any) -> None:
        self.env_id = env_id
        self.env = env
        self.system_prompt = getattr(env, "system_prompt", None)
        rubric = getattr(env, "rubric", None)
        if rubric is None or not getattr(rubric, "funcs", None):
            raise ValueError(
                f"environment {env_id!r}: load_environment() returned an object without rubric.funcs"
            )
        self.funcs = list(rubric.funcs)
        self.weights = list(getattr(rubric, "weights", None) or [1.0] * len(self.funcs))

    def num_examples(self, split: Split) -> int | None:
        return len(_dataset(self.env, split))

    def example(self, split: Split, index: int) -> Problem:
        rows = _dataset(self.env, split)
        return _row_problem(dict(rows[index % len(rows)]), self.system_prompt)

    async def run_episode(
        self, client: ChatClient, problem: Problem, sampling: SamplingArgs
    ) -> RolloutSample:
        prompt = problem_messages(problem)
        turn = await client.chat(prompt, sampling)
        started = time.perf_counter()
        available = {
            "prompt": prompt,
            "completion": [{"role": "assistant", "content": turn.text}],
            "answer": problem.answer,
            "info": problem.info,
            "state": {},
            "text": turn.text,
        }
        components = {f.__name__: await _call_reward(f, available) for f in self.funcs}
        reward = sum(
            w * components[f.__name__] for f, w in zip(self.funcs, self.weights, strict=True)
        )
        turn.timings["score"] = time.perf_counter() - started
        return sample_from_turns(
            [turn], reward=reward, reward_components=components, sampling=sampling
        )


async def maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def unsupported_shape(env: Any) -> str | None:
    """Why a verifiers environment cannot be played turn by turn (None: it can)."""
    if getattr(env, "message_type", "chat") == "completion":
        return "a completion-format environment (message_type = 'completion'); rlbus plays chat"
    if isinstance(getattr(env, "envs", None), list):
        return (
            "a group of environments (EnvGroup); give each its own [[orchestrator.env]] entry "
            "(weights set the mix)"
        )
    if callable(getattr(env, "rollout", None)) and not callable(getattr(env, "env_response", None)):
        return "an environment whose own rollout() replaces the turn loop (no env_response)"
    return None


def adapt(env_id: str, env: Any) -> Environment:
    """The rlbus environment over what a verifiers-style `load_environment` returned: turn by
    turn for a classic multi-turn environment, one turn otherwise (module docstring)."""
    why = unsupported_shape(env)
    if why is not None:
        raise UnsupportedEnvironmentError(f"environment {env_id!r} cannot be played: it is {why}")
    if callable(getattr(env, "env_response", None)) and callable(
        getattr(env, "is_completed", None)
    ):
        return VerifiersMultiTurnAdapter(env_id, env)
    return VerifiersAdapter(env_id, env)


class VerifiersMultiTurnAdapter(MultiTurnEnv):
    """A classic verifiers multi-turn (or tool) environment, played turn by turn."""

    def __init__(self, env_id: str, env: Any) -> None:
        self.env_id = env_id
        self.single = VerifiersAdapter(env_id, env)
        self.env = env
        self.max_turns = int(getattr(env, "max_turns", None) or self.max_turns)

    def tool_schemas(self) -> list[dict[str, Any]]:
        return list(getattr(self.env, "oai_tools", None) or [])

    def num_examples(self, split: Split) -> int | None:
        return self.single.num_examples(split)

    def example(self, split: Split, index: int) -> Problem:
        return self.single.example(split, index)

    def initial_state(self, problem: Problem) -> dict[str, Any]:
        return {
            "prompt": problem_messages(problem),
            "answer": problem.answer,
            "info": problem.info,
            "task": problem.info.get("task"),
            "responses": [],
            "turn": 0,
        }

    async def respond(
        self, problem: Problem, conversation: list[dict[str, Any]], state: dict[str, Any]
    ) -> Reply:
        if not state.get("_set_up"):
            setup = getattr(self.env, "setup_state", None)
            if callable(setup):
                state.update((await maybe_await(setup(state))) or {})
            state["_set_up"] = True
        state["turn"] = sum(m["role"] == "assistant" for m in conversation)
        messages = problem_messages(problem) + conversation
        if await maybe_await(self.env.is_completed(messages, state)):
            return Reply(done=True)
        answer = await maybe_await(self.env.env_response(messages, state))
        if isinstance(answer, tuple) and len(answer) == 2:
            answer, new_state = answer
            if isinstance(new_state, dict) and new_state is not state:
                state.update(new_state)
        if isinstance(answer, dict):
            answer = [answer]
        return Reply(messages=[plain_message(m) for m in answer or []])

    async def score(
        self, problem: Problem, conversation: list[dict[str, Any]], state: dict[str, Any]
    ) -> Score:
        assistant = [m for m in conversation if m["role"] == "assistant"]
        available = {
            "prompt": problem_messages(problem),
            "completion": conversation,
            "answer": problem.answer,
            "info": problem.info,
            "state": state,
            "text": assistant[-1]["content"] if assistant else "",
        }
        funcs, weights = self.single.funcs, self.single.weights
        components = {f.__name__: await _call_reward(f, available) for f in funcs}
        reward = sum(w * components[f.__name__] for f, w in zip(funcs, weights, strict=True))
        return Score(reward=reward, components=components)


def plain_message(message: Any) -> Any:
    """A message of `env_response` as a plain dict (pydantic/OpenAI objects are dumped); what
    is not a message is passed on for `as_reply` to refuse with the environment's name."""
    dump = getattr(message, "model_dump", None)
    return dump(exclude_none=True) if callable(dump) else message
