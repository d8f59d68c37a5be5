"""Packing samples into the trainer's micro-batches.

Each sample becomes one sequence `prompt + completion` with per-token fields aligned to
`input_ids`: `loss_mask` (0 on the prompt, the episode's mask on the completion),
`inference_logprobs` (0.0 on the prompt), `advantages` (the sample's advantage on every token),
`temperatures` (the sampling temperature on every token) and `position_ids` restarting at 0.

Packing per step:

1. samples are spread over the trainer's data-parallel ranks, longest first, each to the rank
   with the fewest tokens so far (balances tokens per rank);
2. on each rank, sequences are packed first-fit-decreasing into micro-batches of at most
   `seq_len` tokens (a sample longer than `seq_len` is cut to `seq_len`, reported as truncated);
3. ranks with fewer micro-batches get padding micro-batches (one token, loss mask 0) so every
   rank runs the same number of forward/backward passes (needed for the gradient all-reduce).

Every token of every sample lands exactly once (token conservation is a unit test).
"""

from dataclasses import dataclass

from rlbus.wire.batches import MicroBatch
from rlbus.wire.rollouts import RolloutSample

PAD_TOKEN_ID = 0


@dataclass
class TrainSample:
    """One sequence ready for packing (all lists aligned to `input_ids`)."""

    input_ids: list[int]
    loss_mask: list[int]
    inference_logprobs: list[float]
    advantage: float
    temperature: float

    def __len__(self) -> int:
        return len(self.input_ids)


def make_train_sample(sample: RolloutSample, advantage: float, seq_len: int) -> TrainSample:
    """The trainer's view of one rollout sample, cut to `seq_len` tokens."""
    num_prompt = len(sample.prompt_token_ids)
    assert (
        len(sample.completion_token_ids)
        == len(sample.completion_logprobs)
        == len(sample.completion_mask)
    )
    return TrainSample(
        input_ids=(sample.prompt_token_ids + sample.completion_token_ids)[:seq_len],
        loss_mask=([0] * num_prompt + list(sample.completion_mask))[:seq_len],
        inference_logprobs=([0.0] * num_prompt + list(sample.completion_logprobs))[:seq_len],
        advantage=advantage,
        temperature=sample.temperature,
    )


def build_micro_batch(samples: list[TrainSample]) -> MicroBatch:
    """Concatenate sequences into one micro-batch."""
    mb = MicroBatch(
        input_ids=[],
        position_ids=[],
        loss_mask=[],
        advantages=[],
        inference_logprobs=[],
        temperatures=[],
        seq_lens=[],
    )
    for s in samples:
        n = len(s)
        mb.input_ids += s.input_ids
        mb.position_ids += list(range(n))
        mb.loss_mask += s.loss_mask
        mb.advantages += [s.advantage] * n
        mb.inference_logprobs += s.inference_logprobs
        mb.temperatures += [s.temperature] * n
        mb.seq_lens.append(n)
    return mb


def padding_micro_batch() -> MicroBatch:
    """A one-token micro-batch that contributes no loss (keeps ranks in lockstep)."""
    return build_micro_batch([TrainSample([PAD_TOKEN_ID], [0], [0.0], 0.0, 1.0)])


def split_over_ranks(samples: list[TrainSample], num_ranks: int) -> list[list[TrainSample]]:
    """Longest-first assignment of samples to the rank with the fewest tokens."""
    ranks: list[list[TrainSample]] = [[] for _ in range(num_ranks)]
    loads = [0] * num_ranks
    for s in sorted(samples, key=len, reverse=True):
        rank = min(range(num_ranks), key=lambda r: (loads[r], len(ranks[r])))
        ranks[rank].append(s)
        loads[rank] += len(s)
    return ranks


def first_fit_decreasing(samples: list[TrainSample], seq_len: int) -> list[list[TrainSample]]:
    """Bins of total length <= seq_len."""
    bins: list[list[TrainSample]] = []
    free: list[int] = []
    for s in sorted(samples, key=len, reverse=True):
        assert len(s) <= seq_len, "samples are cut to seq_len before packing"
        for i, space in enumerate(free):
            if len(s) <= space:
                bins[i].append(s)
                free[i] -= len(s)
                break
        else:
            bins.append([s])
            free.append(seq_len - len(s))
    return bins


def pack(samples: list[TrainSample], *, seq_len: int, num_ranks: int) -> list[list[MicroBatch]]:
    """`micro_batches[rank]`: each rank's packed micro-batches, all ranks of equal count."""
    per_rank = [
        [build_micro_batch(b) for b in first_fit_decreasing(rank, seq_len)]
        for rank in split_over_ranks(samples, num_ranks)
    ]
    num_micro = max(1, max(len(r) for r in per_rank))
    for rank in per_rank:
        rank.extend(padding_micro_batch() for _ in range(num_micro - len(rank)))
    return per_rank
