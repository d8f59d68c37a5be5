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
"""

import inspect
import time
from typing import Any

from rlbus.wire.rollouts import RolloutSample
from rlbus.wire.tasks import ChatMessage, Problem, SamplingArgs
from rlbus_orchestrator.envs.base import ChatClient, Split, problem_messages, sample_from_turns


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
        messages = [ChatMessage(role=m["role"], content=m["content"]) for m in row["prompt"]]
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
