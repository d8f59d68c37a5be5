"""Rollouts: one finished group of samples for one task.

Sender: orchestrator rollout workers. Receiver: orchestrator coordinator (durable pull consumer on
the work-queue stream `subjects.rollouts`; acked only after the batch holding it is stored). The
message id is the task's `task_id`, so a retried publish is a no-op.
"""

from typing import Any

import msgspec

from rlbus.wire.base import Message, NonNegative, now
from rlbus.wire.tasks import ChatMessage


class RolloutSample(msgspec.Struct, kw_only=True, array_like=True):
    """One sample of a group. Hot path: positional (array_like) encoding."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    """Inference logprob of each completion token (same length as completion_token_ids)."""
    completion_mask: list[int]
    """Loss mask over completion tokens (1 = trained; 0 = e.g. tool output in multi-turn)."""
    reward: float = 0.0
    """The reward: the one number advantages are computed from (the environment's score of this
    sample). The run's reward curve is its mean, `reward/mean` in the orchestrator's StepMetrics."""
    reward_components: dict[str, float] = {}
    """Named parts or extra scores of the reward, reported as metrics only (never trained on)."""
    finish_reason: str | None = None
    """`stop`, `length`, ... as reported by inference."""
    is_truncated: bool = False
    policy_version: NonNegative = 0
    """Weights version that generated the completion (oldest one if it changed mid-sample)."""
    replica_id: str | None = None
    timings: dict[str, float] = {}
    """Named durations in seconds (e.g. `generate`, `score`)."""
    temperature: float = 1.0
    completion_text: str | None = None
    num_turns: NonNegative = 1
    """Model turns of the episode (1 for a single-turn environment)."""
    num_tool_calls: NonNegative = 0
    num_tool_errors: NonNegative = 0
    """Tool calls answered with an error (a tool that raised or timed out, broken JSON
    arguments, an unknown tool name); the episode went on."""
    stop_reason: str | None = None
    """Why a multi-turn episode ended: `done` (the environment said so), `max_turns`,
    `max_total_tokens`, `deadline`, `length` (the model's turn was cut at max_tokens)."""
    messages: list[ChatMessage] = []
    """The episode's conversation after the prompt (assistant turns, tool calls, tool and
    environment messages); empty for single-turn samples (`completion_text` holds the answer)."""


class Rollout(Message, kw_only=True):
    """One finished group (all samples of one task)."""

    task_id: str
    step: NonNegative
    env_id: str
    example_id: int | str | None = None
    samples: list[RolloutSample] = []
    worker_id: str | None = None
    error: str | None = None
    """Set when the group could not be produced; samples are then empty."""
    dropped: dict[str, NonNegative] = {}
    """Episodes of the group that failed and were left out of `samples`, by reason (e.g.
    `error`, `timeout`); the group trains on the rest when enough remain."""
    metadata: dict[str, Any] = {}
    prompt: list[ChatMessage] = []
    """The problem's messages (the task's `problem.messages`), for the samples people read
    (rlbus.samples); empty for a problem given as token ids."""
    finished_at: float = msgspec.field(default_factory=now)


encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(Rollout)
