"""Rollouts: one finished group of samples for one task.

Sender: orchestrator rollout workers. Receiver: orchestrator coordinator (durable pull consumer on
the work-queue stream `subjects.rollouts`; acked only after the batch holding it is stored). The
message id is the task's `task_id`, so a retried publish is a no-op.
"""

from typing import Any

import msgspec

from rlbus.wire.base import Message, NonNegative, now


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
    metadata: dict[str, Any] = {}
    finished_at: float = msgspec.field(default_factory=now)


encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(Rollout)
