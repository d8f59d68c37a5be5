"""The environment interface: a dataset of problems plus an async episode function.

An environment owns three things:

- a dataset with a `train` and an `eval` split; `example(split, index)` is deterministic for a
  given seed, so the coordinator's data cursor (an integer) is all that is needed to resume;
- `run_episode(client, problem, sampling)`: plays one episode (one or more chat turns) against
  inference through a `ChatClient` and returns a `RolloutSample` (token ids, logprobs, loss mask,
  reward and its named components);
- nothing else: no bus, no batching. Rollout workers call `run_episode` `group_size` times per
  task; the coordinator turns the samples into advantages and batches.

An environment may also have `run_group(client, problem, sampling, n)` (`GroupEnvironment`): the
`n` samples of a group from one `client.chat_n` request, which lets inference share the prompt and
schedule the samples together. Workers use it when it is there. Single-turn environments get both
methods by deriving from `SingleTurnEnv` and writing only `score`.

Multi-turn environments call `client.chat` once per turn and merge the turns with `merge_turns`:
tokens the environment adds between two model turns (tool output, user replies) become part of
the completion with loss mask 0, so the trainer sees one sequence per episode.
"""

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from rlbus.obs import tracing
from rlbus.wire.rollouts import RolloutSample
from rlbus.wire.tasks import EpisodeLimits, Problem, SamplingArgs, ToolCall

Split = Literal["train", "eval"]


@dataclass
class ChatTurn:
    """One completion from inference, with the tokens the trainer needs."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    text: str
    finish_reason: str | None
    policy_version: int
    replica_id: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    tool_calls: list[ToolCall] = field(default_factory=list)
    """Tool calls the engine parsed from the completion (its tool-call parser), in order."""


@dataclass
class TurnRequest:
    """What a multi-turn episode adds to a chat request: the tools it offers (OpenAI tool
    schemas), and the exact prompt token ids of a later turn (the previous turn's prompt and
    completion plus the new messages' tokens: `envs.turns`). vLLM then generates from those ids
    instead of rendering `messages` again, and still parses tool calls from the output."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None


class ChatClient(Protocol):
    """What an episode talks to: an OpenAI-style chat endpoint that also returns token ids."""

    async def chat(
        self,
        messages: list[dict[str, Any]],
        sampling: SamplingArgs,
        turn: TurnRequest | None = None,
        prefer: str | None = None,
    ) -> ChatTurn:
        """One sample; `turn` carries a multi-turn episode's tools and exact prompt ids, `prefer`
        the replica of its earlier turns."""
        ...

    async def chat_n(
        self, messages: list[dict[str, Any]], sampling: SamplingArgs, n: int
    ) -> list[ChatTurn]:
        """`n` independent samples of one prompt, from one request."""
        ...

    async def tokenize_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        prefer: str | None = None,
    ) -> list[int]:
        """`messages` rendered by the served model's chat template, with the generation prompt."""
        ...


@runtime_checkable
class Environment(Protocol):
    """A dataset of problems and an episode function (see module docstring)."""

    env_id: str

    def num_examples(self, split: Split) -> int | None:
        """Examples in `split`; None for an unbounded generated split."""
        ...

    def example(self, split: Split, index: int) -> Problem:
        """The `index`-th problem of `split` (deterministic)."""
        ...

    async def run_episode(
        self, client: ChatClient, problem: Problem, sampling: SamplingArgs
    ) -> RolloutSample:
        """Play one episode and score it."""
        ...


@runtime_checkable
class GroupEnvironment(Environment, Protocol):
    """An environment that can play a whole group at once (see module docstring)."""

    async def run_group(
        self, client: ChatClient, problem: Problem, sampling: SamplingArgs, n: int
    ) -> list[RolloutSample]:
        """Play `n` episodes of `problem` and score each."""
        ...


async def play_episode(
    env: Environment,
    client: ChatClient,
    problem: Problem,
    sampling: SamplingArgs,
    limits: EpisodeLimits,
) -> RolloutSample:
    """One episode of `env`; the task's episode limits go to environments that take them
    (`takes_limits`, e.g. `MultiTurnEnv`), single-turn ones are played as they always were."""
    if getattr(env, "takes_limits", False):
        return await env.run_episode(client, problem, sampling, limits)  # type: ignore[call-arg]
    return await env.run_episode(client, problem, sampling)


@dataclass
class Score:
    """What a single-turn environment makes of one completion."""

    reward: float
    components: dict[str, float]
    completion_text: str | None = None
    """The text kept with the sample (None: the completion as inference returned it)."""


class SingleTurnEnv(ABC):
    """Base of environments whose episode is one chat turn on `problem.messages`: a subclass
    writes `score`, and gets `run_episode` and the one-request `run_group` from it."""

    @abstractmethod
    async def score(self, problem: Problem, turn: ChatTurn) -> Score:
        """The reward of `turn` as an answer to `problem`."""

    async def run_episode(
        self, client: ChatClient, problem: Problem, sampling: SamplingArgs
    ) -> RolloutSample:
        turn = await client.chat(problem_messages(problem), sampling)
        with tracing.span(tracing.SCORE, attributes={"rlbus.samples": 1}):
            return await self.scored_sample(problem, turn, sampling)

    async def run_group(
        self, client: ChatClient, problem: Problem, sampling: SamplingArgs, n: int
    ) -> list[RolloutSample]:
        turns = await client.chat_n(problem_messages(problem), sampling, n)
        with tracing.span(tracing.SCORE, attributes={"rlbus.samples": n}):
            return [await self.scored_sample(problem, turn, sampling) for turn in turns]

    async def scored_sample(
        self, problem: Problem, turn: ChatTurn, sampling: SamplingArgs
    ) -> RolloutSample:
        started = time.perf_counter()
        score = await self.score(problem, turn)
        turn.timings["score"] = time.perf_counter() - started
        return sample_from_turns(
            [turn],
            reward=score.reward,
            reward_components=score.components,
            sampling=sampling,
            completion_text=score.completion_text,
        )


def problem_messages(problem: Problem) -> list[dict[str, Any]]:
    """The problem's chat messages as plain dicts (what the OpenAI API takes)."""
    assert problem.messages is not None, "chat environments need problem.messages"
    return [{"role": m.role, "content": m.content} for m in problem.messages]


def merge_turns(turns: list[ChatTurn]) -> tuple[list[int], list[int], list[float], list[int]]:
    """Flatten the turns of one episode into (prompt ids, completion ids, logprobs, mask).

    Each turn's prompt must extend the previous prompt + completion (the chat template re-renders
    the conversation); the extension is environment text: kept in the sequence, masked out.
    """
    assert turns, "an episode has at least one turn"
    prompt = list(turns[0].prompt_token_ids)
    ids: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    for turn in turns:
        seen = prompt + ids
        if turn is not turns[0]:
            if turn.prompt_token_ids[: len(seen)] != seen:
                raise ValueError(
                    "multi-turn prompt does not extend the previous turn's tokens; the chat template "
                    "must render earlier turns unchanged for token-level training"
                )
            extra = turn.prompt_token_ids[len(seen) :]
            ids += extra
            logprobs += [0.0] * len(extra)
            mask += [0] * len(extra)
        ids += turn.completion_token_ids
        logprobs += turn.completion_logprobs
        mask += [1] * len(turn.completion_token_ids)
    return prompt, ids, logprobs, mask


def sample_from_turns(
    turns: list[ChatTurn],
    *,
    reward: float,
    reward_components: dict[str, float],
    sampling: SamplingArgs,
    completion_text: str | None = None,
) -> RolloutSample:
    """A scored `RolloutSample` from the turns of one episode."""
    prompt, ids, logprobs, mask = merge_turns(turns)
    last = turns[-1]
    timings: dict[str, float] = {}
    for turn in turns:
        for key, value in turn.timings.items():
            timings[key] = timings.get(key, 0.0) + value
    return RolloutSample(
        prompt_token_ids=prompt,
        completion_token_ids=ids,
        completion_logprobs=logprobs,
        completion_mask=mask,
        reward=reward,
        reward_components=reward_components,
        finish_reason=last.finish_reason,
        is_truncated=last.finish_reason == "length",
        policy_version=min(t.policy_version for t in turns),
        replica_id=last.replica_id,
        timings=timings,
        temperature=sampling.temperature,
        completion_text=completion_text if completion_text is not None else last.text,
    )
