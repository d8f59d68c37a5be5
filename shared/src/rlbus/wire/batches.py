"""Train batches: everything the trainer needs for one optimizer step.

Sender: orchestrator coordinator (once per step, to `subjects.batch(step)`, message id
`batch-<step>`). Receiver: trainer (reads step N by subject, so a restarted trainer re-reads the
steps after its checkpoint). Large batches travel by claim check (see `rlbus.bus`).
"""

from typing import Any

import msgspec

from rlbus.wire.base import Message, NonNegative, now


class MicroBatch(msgspec.Struct, kw_only=True, array_like=True):
    """One packed micro-batch: several sequences concatenated into flat token lists.

    All per-token lists have the same length `sum(seq_lens)`. Hot path: array_like.
    """

    input_ids: list[int]
    position_ids: list[int]
    """Restart at 0 for each packed sequence."""
    loss_mask: list[int]
    """1 where the token's loss counts (completion tokens), else 0."""
    advantages: list[float]
    inference_logprobs: list[float]
    """Logprob of each token under the policy that sampled it (0.0 on prompt tokens)."""
    temperatures: list[float]
    """Sampling temperature per token (logits are divided by it before the loss)."""
    seq_lens: list[int]
    """Length of each packed sequence."""
    parent_ids: list[int] = []
    """Empty: each sequence is one sample, every token follows the one before it. Otherwise one
    entry per token (the shared-prefix layout, docs/orchestrator.md "Packing"): the index in this
    micro-batch of the token before it in its own sample, -1 for a sequence's first token. A
    sequence is then a group's shared prompt once, followed by the completions of several of its
    samples, each completion's first token pointing at the prompt's last; a token attends to its
    ancestors (and itself) only, and its logprob is read from its parent's logits."""


class TrainBatch(Message, kw_only=True):
    """Step `step`'s data, split per data-parallel rank."""

    step: NonNegative
    micro_batches: list[list[MicroBatch]]
    """`micro_batches[rank]` is the list of micro-batches of data-parallel rank `rank`."""
    num_samples: NonNegative = 0
    num_tokens: NonNegative = 0
    min_policy_version: NonNegative = 0
    max_policy_version: NonNegative = 0
    task_ids: list[str] = []
    metrics: dict[str, float] = {}
    """Orchestrator-side metrics of this batch (reward mean, lengths, off-policy drops, ...)."""
    metadata: dict[str, Any] = {}
    created_at: float = msgspec.field(default_factory=now)


encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(TrainBatch)
