"""Shared-prefix packing: a group's prompt once, each completion behind it, nothing lost."""

from rlbus_orchestrator.packing import (
    TrainSample,
    group_sequences,
    pack,
    shared_prefix_len,
)


def sample(prompt: list[int], completion: list[int], advantage: float, temp: float = 1.0):
    n, c = len(prompt), len(completion)
    return TrainSample(
        input_ids=prompt + completion,
        loss_mask=[0] * n + [1] * c,
        inference_logprobs=[0.0] * n + [-0.5 - 0.01 * t for t in completion],
        advantage=advantage,
        temperature=temp,
    )


def group(prompt: list[int], completions: list[list[int]]) -> list[TrainSample]:
    return [sample(prompt, c, float(i) - 1.5, 0.7) for i, c in enumerate(completions)]


def contexts(micro_batches) -> list[tuple]:
    """For every loss token: (its sample's tokens up to it as seen through its ancestors, their
    positions, logprob, advantage, temperature) - what the trainer computes its loss from."""
    seen = []
    for mb in micro_batches:
        parents = mb.parent_ids or None
        start = 0
        for length in mb.seq_lens:
            for i in range(start, start + length):
                if not mb.loss_mask[i]:
                    continue
                chain, j = [], i
                while j >= start and j != -1:
                    chain.append(j)
                    j = parents[j] if parents else (j - 1 if j > start else -1)
                chain.reverse()
                seen.append(
                    (
                        tuple(mb.input_ids[k] for k in chain),
                        tuple(mb.position_ids[k] for k in chain),
                        mb.inference_logprobs[i],
                        mb.advantages[i],
                        mb.temperatures[i],
                    )
                )
            start += length
    return sorted(seen)


def flat(ranks):
    return [mb for rank in ranks for mb in rank]


GROUPS = [
    group([5, 6, 7, 8, 9], [[11, 12], [13], [11, 14, 15], [16, 17]]),
    group([5, 6, 20], [[21, 22, 23], [24]]),
    group([30], [[31], [32, 33]]),  # a one-token prompt is still shared
]


def test_every_loss_token_keeps_its_context_positions_and_values():
    plain = pack(group_sequences(GROUPS, 64, share_prefixes=False), seq_len=64, num_ranks=2)
    shared = pack(group_sequences(GROUPS, 64), seq_len=64, num_ranks=2)
    assert contexts(flat(shared)) == contexts(flat(plain))
    assert len(contexts(flat(plain))) == sum(sum(s.loss_mask) for g in GROUPS for s in g)


def test_the_prompt_is_packed_once_per_group():
    sequences = group_sequences(GROUPS, 64)
    assert len(sequences) == 3
    first = sequences[0]
    assert first.input_ids == [5, 6, 7, 8, 9, 11, 12, 13, 11, 14, 15, 16, 17]
    assert first.position_ids == [0, 1, 2, 3, 4, 5, 6, 5, 5, 6, 7, 5, 6]
    assert first.parent_ids == [-1, 0, 1, 2, 3, 4, 5, 4, 4, 8, 9, 4, 11]
    assert first.loss_mask == [0] * 5 + [1] * 8
    plain_tokens = sum(len(s) for g in GROUPS for s in g)
    assert sum(len(s) for s in sequences) == plain_tokens - (5 * 3 + 3 * 1 + 1 * 1)


def test_a_group_longer_than_a_row_repeats_its_prompt_and_every_row_fits():
    long = group([1, 2, 3, 4], [[10, 11, 12], [13, 14, 15], [16, 17, 18], [19]])
    sequences = group_sequences([long], 10)
    assert [len(s) for s in sequences] == [10, 8]
    assert all(s.input_ids[:4] == [1, 2, 3, 4] for s in sequences)
    plain = pack(group_sequences([long], 10, share_prefixes=False), seq_len=10, num_ranks=1)
    assert contexts(flat(pack(sequences, seq_len=10, num_ranks=1))) == contexts(flat(plain))


def test_the_prefix_ends_where_samples_differ_or_the_loss_starts_and_leaves_each_a_token():
    a = sample([1, 2, 3], [4, 5], 1.0)
    b = sample([1, 2, 9], [4, 5], -1.0)
    assert shared_prefix_len([a, b]) == 2
    # multi-turn: the second turn's context is the same tokens but the first reply is trained
    c = TrainSample([1, 2, 3, 4], [0, 1, 0, 1], [0.0, -1.0, 0.0, -1.0], 1.0, 1.0)
    d = TrainSample([1, 2, 3, 5], [0, 1, 0, 1], [0.0, -1.0, 0.0, -1.0], -1.0, 1.0)
    assert shared_prefix_len([c, d]) == 1
    # a sample that is all prompt keeps its last token as its own
    e = sample([1, 2, 3], [], 0.0)
    assert shared_prefix_len([e, sample([1, 2, 3], [7], 1.0)]) == 2


def test_groups_that_share_nothing_and_single_samples_stay_plain():
    disjoint = [sample([1, 2], [3], 1.0), sample([4, 5], [6], -1.0)]
    for groups in ([disjoint], [[sample([1, 2], [3], 1.0)]]):
        sequences = group_sequences(groups, 16)
        assert all(s.parent_ids is None for s in sequences)
        (mb,) = flat(pack(sequences, seq_len=16, num_ranks=1))
        assert mb.parent_ids == []


def test_plain_sequences_next_to_shared_ones_get_chain_parents():
    groups = [[sample([1, 2], [3], 1.0)], group([8, 9], [[3], [4]])]
    (mb,) = flat(pack(group_sequences(groups, 32), seq_len=32, num_ranks=1))
    assert sorted(mb.seq_lens) == [3, 4]
    start = sum(mb.seq_lens[: mb.seq_lens.index(3)])
    assert mb.parent_ids[start : start + 3] == [-1, start, start + 1]
