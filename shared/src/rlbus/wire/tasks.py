"""Tasks: one group of rollouts to produce.

Sender: orchestrator coordinator. Receiver: orchestrator rollout workers (shared durable pull
consumer on the work-queue stream `subjects.tasks`). The message id is derived from the data
cursor (`task_id`), so a restarted coordinator that re-publishes a task is deduplicated.
"""

from typing import Annotated, Any

import msgspec

from rlbus.wire.base import Message, NonNegative, Positive, now


class ChatMessage(msgspec.Struct, kw_only=True):
    """One chat turn of a prompt (OpenAI chat format)."""

    role: str
    content: str


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
    `eval-<step>-<i>` for the `i`-th eval task of step `step`."""
    step: NonNegative
    """The training step this group is meant for."""
    env_id: str
    env_args: dict[str, Any] = {}
    example_id: int | str | None = None
    problem: Problem
    sampling: SamplingArgs = msgspec.field(default_factory=SamplingArgs)
    group_size: Positive = 1
    min_policy_version: NonNegative = 0
    """Rollouts must come from weights at least this new."""
    created_at: float = msgspec.field(default_factory=now)


encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(Task)
