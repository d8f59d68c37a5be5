"""Tasks: one group of rollouts to produce.

Sender: orchestrator coordinator. Receiver: orchestrator rollout workers (shared durable pull
consumer on the work-queue stream `subjects.tasks`). The message id is derived from the data
cursor (`task_id`), so a restarted coordinator that re-publishes a task is deduplicated.
"""

from typing import Annotated, Any

import msgspec

from rlbus.wire.base import Message, NonNegative, Positive, now


class ToolFunction(msgspec.Struct, kw_only=True):
    """The function a tool call names, with its arguments as the model wrote them (a JSON text
    that may not parse: the environment answers a broken one with a tool message)."""

    name: str
    arguments: str = "{}"


class ToolCall(msgspec.Struct, kw_only=True):
    """One tool call of an assistant message (OpenAI chat format)."""

    id: str
    function: ToolFunction
    type: str = "function"


class ChatMessage(msgspec.Struct, kw_only=True):
    """One message of a conversation (OpenAI chat format): a prompt's turn, an assistant's answer
    with its tool calls, or a tool's result (`role = "tool"`, with the `tool_call_id` it answers)."""

    role: str
    content: str = ""
    tool_calls: list[ToolCall] = []
    tool_call_id: str | None = None
    name: str | None = None
    """The tool's name on a `tool` message (some chat templates print it)."""


class EpisodeLimits(msgspec.Struct, kw_only=True):
    """Where a multi-turn episode ends if its environment has not said done (None: no limit)."""

    max_turns: Positive | None = None
    """Model turns per episode."""
    max_total_tokens: Positive | None = None
    """Tokens of the whole episode (prompt, every completion, every environment message)."""
    deadline_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    """Wall-clock seconds per episode, from its first request."""


class SamplingArgs(msgspec.Struct, kw_only=True):
    """Sampling parameters sent to inference (OpenAI/vLLM names)."""

    temperature: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    max_tokens: Positive = 128
    stop: list[str] = []
    seed: int | None = None
    extra: dict[str, Any] = {}
    """Extra vLLM sampling params passed through unchanged."""


class Problem(msgspec.Struct, kw_only=True):
    """The problem of a task: chat messages or raw prompt token ids, plus what scores it."""

    messages: list[ChatMessage] | None = None
    prompt_token_ids: list[int] | None = None
    answer: str | None = None
    info: dict[str, Any] = {}


class Task(Message, kw_only=True):
    """Roll out `group_size` samples of one problem for training step `step`."""

    task_id: str
    """Deterministic id, also the Nats-Msg-Id: `train-<cursor>` for training (the coordinator's
    data cursor: 0, 1, 2, ... over the whole run, not the step; a task issued again keeps its id),
    `eval-<step>-<k>-<i>` for problem `i` of eval environment `k` in the evaluation of step
    `step`."""
    step: NonNegative
    """The training step this group is meant for."""
    env_id: str
    env_args: dict[str, Any] = {}
    example_id: int | str | None = None
    problem: Problem
    sampling: SamplingArgs = msgspec.field(default_factory=SamplingArgs)
    group_size: Positive = 1
    limits: EpisodeLimits = msgspec.field(default_factory=EpisodeLimits)
    """Limits of a multi-turn episode (single-turn environments ignore them)."""
    min_policy_version: NonNegative = 0
    """Rollouts must come from weights at least this new."""
    created_at: float = msgspec.field(default_factory=now)


encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(Task)
