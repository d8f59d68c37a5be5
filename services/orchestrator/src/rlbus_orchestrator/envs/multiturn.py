"""Multi-turn environments: the model and the environment take turns until it is done.

A `MultiTurnEnv` subclass writes the dataset (`num_examples`, `example`), `score`, and usually
`respond`; `tools` lists the functions the model may call (envs/tools.py). An episode:

    prompt ──▶ model turn ──▶ tool calls? ──yes──▶ tool messages ──┐
                  ▲               │ no                              │
                  │               ▼                                 │
                  │       respond(problem, conversation, state)     │
                  │        └─ Reply(messages, done) ── done? ──▶ score
                  └──────────────── new messages ◀──────────────────┘

- Tool calls are parsed by the engine (vLLM's tool-call parser of the model family); each is run
  by `tools.call_tool`, and its result (or what went wrong) goes back as a `tool` message. A
  turn with tool calls is answered by the tools alone; `respond` answers turns without.
- `respond` returns a `Reply`: the messages to add (a `user` message with feedback, the next
  items to sort, ...) and whether the episode is done. The default ends the episode: in a tool
  environment, an answer without tool calls is the final one.
- Limits end an episode the environment has not ended (`stop_reason`): `max_turns` model turns
  (`EpisodeLimits.max_turns`, else the class's `max_turns`), `max_total_tokens` for the whole
  sequence (each turn's `max_tokens` is cut to what is left), a wall-clock `deadline_s`, and a
  model turn cut at `max_tokens` (`length`). The episode is then scored as it stands. A deadline
  that passes before the first turn answered fails the episode (`EpisodeDeadline`).
- The sequence trained on is token-exact (envs/turns.py): the prompt, each completion (loss mask
  1), and the environment's tokens between them (loss mask 0).

`score(problem, conversation, state)` gets the messages after the prompt (assistant turns with
their `tool_calls`, tool results, the environment's messages) and the episode's `state` dict
(from `initial_state`, shared with `respond`).
"""

import asyncio
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec

from rlbus.obs import tracing
from rlbus.wire.rollouts import RolloutSample
from rlbus.wire.tasks import ChatMessage, EpisodeLimits, Problem, SamplingArgs, ToolCall
from rlbus_orchestrator.envs.base import (
    ChatClient,
    ChatTurn,
    Score,
    Split,
    TurnRequest,
    problem_messages,
)
from rlbus_orchestrator.envs.tools import Tool, ToolOutcome, call_tool, tool_message
from rlbus_orchestrator.envs.turns import TurnTokens, bridge_tokens

DEFAULT_MAX_TURNS = 10
STOP_REASONS = ("done", "max_turns", "max_total_tokens", "deadline", "length")
"""Why an episode ended (`RolloutSample.stop_reason`)."""


class EpisodeDeadline(TimeoutError):
    """The episode's deadline passed before its first model turn answered: nothing to score."""


class EnvironmentAnswerError(TypeError):
    """`respond` returned something that is not a `Reply` (or a list of messages)."""


@dataclass
class Reply:
    """The environment's answer to a model turn without tool calls."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    """Messages to add (role and content), e.g. one `user` message with feedback."""
    done: bool = False
    """The episode ends here (the messages are kept in the conversation, not trained on)."""


class MultiTurnEnv(ABC):
    """Base of multi-turn and tool environments (see module docstring)."""

    env_id: str
    tools: ClassVar[list[Tool]] = []
    max_turns: int = DEFAULT_MAX_TURNS
    """Model turns per episode unless the task's limits say otherwise."""
    tool_call_tag: str | None = "<tool_call>"
    """How a tool call starts in the model's text (hermes format). A turn whose text holds it but
    whose calls the engine could not parse (broken JSON) is answered with a tool message saying
    so; None: such text is an ordinary answer."""
    takes_limits: ClassVar[bool] = True
    """The worker passes the task's `EpisodeLimits` to `run_episode`."""

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The OpenAI tool schemas sent with every request of an episode (default: `tools`')."""
        return [t.schema() for t in self.tools]

    @abstractmethod
    def num_examples(self, split: Split) -> int | None: ...

    @abstractmethod
    def example(self, split: Split, index: int) -> Problem: ...

    def initial_state(self, problem: Problem) -> dict[str, Any]:
        """The episode's own state, passed to `respond` and `score`."""
        return {}

    async def respond(
        self, problem: Problem, conversation: list[dict[str, Any]], state: dict[str, Any]
    ) -> Reply:
        """The environment's answer to the model's last turn (`conversation[-1]`)."""
        return Reply(done=True)

    @abstractmethod
    async def score(
        self, problem: Problem, conversation: list[dict[str, Any]], state: dict[str, Any]
    ) -> Score:
        """The reward of the finished episode."""

    async def run_episode(
        self,
        client: ChatClient,
        problem: Problem,
        sampling: SamplingArgs,
        limits: EpisodeLimits | None = None,
    ) -> RolloutSample:
        episode = Episode(self, client, problem, sampling, limits or EpisodeLimits())
        return await episode.play()


def as_reply(env_id: str, value: Any) -> Reply:
    """`respond`'s answer as a `Reply` (a bare list of messages means "go on")."""
    if isinstance(value, list):
        value = Reply(messages=value)
    if not isinstance(value, Reply):
        raise EnvironmentAnswerError(
            f"environment {env_id!r}: respond() returned {type(value).__name__}; return "
            "Reply(messages=[{'role': 'user', 'content': '...'}], done=False) or a list of messages"
        )
    for message in value.messages:
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise EnvironmentAnswerError(
                f"environment {env_id!r}: respond() gave a message that is not "
                f"{{'role': str, 'content': str}}: {message!r}"
            )
    return value


def assistant_message(turn: ChatTurn) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": turn.text}
    if turn.tool_calls:
        message["tool_calls"] = [msgspec.to_builtins(call) for call in turn.tool_calls]
    return message


def chat_message(message: dict[str, Any]) -> ChatMessage:
    """A conversation message as the wire's `ChatMessage` (kept with the sample)."""
    return ChatMessage(
        role=str(message.get("role")),
        content=str(message.get("content") or ""),
        tool_calls=msgspec.convert(message.get("tool_calls") or [], list[ToolCall]),
        tool_call_id=message.get("tool_call_id"),
        name=message.get("name"),
    )


class Episode:
    """One multi-turn episode being played (see module docstring)."""

    def __init__(
        self,
        env: MultiTurnEnv,
        client: ChatClient,
        problem: Problem,
        sampling: SamplingArgs,
        limits: EpisodeLimits,
    ) -> None:
        self.env, self.client, self.problem, self.sampling = env, client, problem, sampling
        self.max_turns = limits.max_turns or env.max_turns
        self.max_total_tokens = limits.max_total_tokens
        self.deadline_s = limits.deadline_s
        self.deadline = time.monotonic() + limits.deadline_s if limits.deadline_s else None
        self.prompt = problem_messages(problem)
        self.conversation: list[dict[str, Any]] = []
        self.state = env.initial_state(problem)
        self.tokens = TurnTokens()
        self.bridge: list[int] = []
        """The environment's tokens for the next turn: added to the sequence when it starts (an
        episode that ends here does not end on tokens nobody answers)."""
        self.tools = {t.name: t for t in env.tools}
        self.schemas = env.tool_schemas()
        self.turns: list[ChatTurn] = []
        self.num_tool_calls = self.num_tool_errors = 0
        self.timings: dict[str, float] = {}

    def timed(self, name: str, since: float) -> None:
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - since

    async def play(self) -> RolloutSample:
        stop_reason = None
        while stop_reason is None:
            stop_reason = self.limit_reached()
            if stop_reason is not None:
                break
            turn = await self.model_turn()
            if turn is None:
                stop_reason = "deadline"
            elif turn.finish_reason == "length":
                stop_reason = "length"
            else:
                stop_reason = await self.answer(turn)
        started = time.perf_counter()
        with tracing.span(tracing.SCORE, attributes={"rlbus.samples": 1}):
            score = await self.env.score(self.problem, self.conversation, self.state)
        self.timed("score", started)
        return self.sample(score, stop_reason)

    def limit_reached(self) -> str | None:
        if len(self.turns) >= self.max_turns:
            return "max_turns"
        if self.max_total_tokens is not None and self.turns:
            if self.tokens.total() + len(self.bridge) >= self.max_total_tokens:
                return "max_total_tokens"
        if self.deadline is not None and self.turns and time.monotonic() >= self.deadline:
            return "deadline"
        return None

    def turn_sampling(self) -> SamplingArgs:
        """The sampling of the next turn: max_tokens cut to the episode's token budget."""
        if self.max_total_tokens is None:
            return self.sampling
        left = self.max_total_tokens - self.tokens.total() - len(self.bridge)
        return msgspec.structs.replace(
            self.sampling, max_tokens=max(1, min(self.sampling.max_tokens, left))
        )

    async def model_turn(self) -> ChatTurn | None:
        """The model's next turn (None: the deadline passed while it was generated)."""
        sampling = self.turn_sampling()
        if self.turns:
            self.tokens.add_bridge(self.bridge)
            self.bridge = []
        sent = self.tokens.next_prompt() if self.turns else None
        request = TurnRequest(tools=self.schemas, prompt_token_ids=sent)
        prefer = self.turns[-1].replica_id if self.turns else None
        call = self.client.chat(self.prompt + self.conversation, sampling, request, prefer)
        started = time.perf_counter()
        try:
            if self.deadline is None:
                turn = await call
            else:
                turn = await asyncio.wait_for(call, max(self.deadline - time.monotonic(), 0.0))
        except TimeoutError:
            if not self.turns:
                raise EpisodeDeadline(
                    f"no model turn within the episode deadline ({self.deadline_s:g} s)"
                ) from None
            return None
        self.timed("generate", started)
        self.tokens.check_echo(turn, sent)
        self.tokens.add_model_turn(turn)
        self.turns.append(turn)
        self.conversation.append(assistant_message(turn))
        return turn

    async def answer(self, turn: ChatTurn) -> str | None:
        """Answer the model's turn (tools, or the environment); "done" when the episode ends."""
        new: list[dict[str, Any]] | None
        if turn.tool_calls and self.tools:
            new = await self.run_tools(turn.tool_calls)
        elif self.tools and self.env.tool_call_tag and self.env.tool_call_tag in turn.text:
            new = [self.unparsed_call()]
        else:
            # tool calls of tools the environment runs itself (`tool_schemas` only) go to it too
            self.num_tool_calls += len(turn.tool_calls)
            new = await self.respond_to(turn)
            if new is None:
                return "done"
        started = time.perf_counter()
        self.bridge = await bridge_tokens(self.client, new, self.schemas or None, turn.replica_id)
        self.timed("tokenize", started)
        self.conversation += new
        return None

    async def respond_to(self, turn: ChatTurn) -> list[dict[str, Any]] | None:
        """The environment's reply to `turn` (None: it ended the episode)."""
        started = time.perf_counter()
        reply = as_reply(
            self.env.env_id, await self.env.respond(self.problem, self.conversation, self.state)
        )
        self.timed("env", started)
        if reply.done:
            self.conversation += reply.messages
            return None
        return reply.messages

    async def run_tools(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        started = time.perf_counter()
        outcomes: list[ToolOutcome] = [await call_tool(self.tools, call) for call in calls]
        self.timed("tools", started)
        self.num_tool_calls += len(calls)
        self.num_tool_errors += sum(outcome.failed for outcome in outcomes)
        return [outcome.message for outcome in outcomes]

    def unparsed_call(self) -> dict[str, Any]:
        """The answer to a tool call the engine could not parse (broken JSON, no name)."""
        self.num_tool_calls += 1
        self.num_tool_errors += 1
        return tool_message(
            f"unparsed-{len(self.turns)}",
            "",
            "error: the tool call could not be parsed; write "
            f'{self.env.tool_call_tag}{{"name": ..., "arguments": {{...}}}} with valid JSON',
        )

    def sample(self, score: Score, stop_reason: str) -> RolloutSample:
        last = self.turns[-1]
        timings = dict(self.timings)
        return RolloutSample(
            prompt_token_ids=self.tokens.prompt,
            completion_token_ids=self.tokens.ids,
            completion_logprobs=self.tokens.logprobs,
            completion_mask=self.tokens.mask,
            reward=score.reward,
            reward_components=score.components,
            finish_reason=last.finish_reason,
            is_truncated=stop_reason == "length",
            policy_version=min(t.policy_version for t in self.turns),
            replica_id=last.replica_id,
            timings=timings,
            temperature=self.sampling.temperature,
            completion_text=score.completion_text
            if score.completion_text is not None
            else last.text,
            num_turns=len(self.turns),
            num_tool_calls=self.num_tool_calls,
            num_tool_errors=self.num_tool_errors,
            stop_reason=stop_reason,
            messages=[chat_message(m) for m in self.conversation],
        )
