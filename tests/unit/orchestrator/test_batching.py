import pytest

from rlbus.wire.rollouts import RolloutSample
from rlbus_orchestrator.advantages import group_advantages, has_signal
from rlbus_orchestrator.packing import TrainSample, make_train_sample, pack
from rlbus_orchestrator.staleness import (
    is_stale,
    max_allowed_step,
    min_policy_version,
    off_policy_lag,
)


def make_rollout_sample(num_prompt=3, num_completion=4, reward=0.5, temperature=1.0):
    return RolloutSample(
        prompt_token_ids=list(range(100, 100 + num_prompt)),
        completion_token_ids=list(range(200, 200 + num_completion)),
        completion_logprobs=[-0.1] * num_completion,
        completion_mask=[1] * num_completion,
        reward=reward,
        temperature=temperature,
    )


def make_train_samples(lengths):
    return [TrainSample([i] * n, [1] * n, [-1.0] * n, float(i), 1.0) for i, n in enumerate(lengths)]


def test_advantages_are_reward_minus_group_mean():
    assert group_advantages([1.0, 0.0, 0.5]) == pytest.approx([0.5, -0.5, 0.0])


def test_normalized_advantages_have_unit_std():
    adv = group_advantages([1.0, 0.0], normalize=True)
    assert adv == pytest.approx([1.0, -1.0], rel=1e-4)


def test_group_with_equal_rewards_has_no_signal():
    assert not has_signal([0.3, 0.3, 0.3])
    assert has_signal([0.3, 0.3, 0.4])


def test_train_sample_aligns_fields_to_input_ids():
    s = make_train_sample(make_rollout_sample(3, 4, temperature=0.8), advantage=0.25, seq_len=100)
    assert s.input_ids == [100, 101, 102, 200, 201, 202, 203]
    assert s.loss_mask == [0, 0, 0, 1, 1, 1, 1]
    assert s.inference_logprobs == [0.0, 0.0, 0.0, -0.1, -0.1, -0.1, -0.1]
    assert s.temperature == 0.8


def test_train_sample_is_cut_to_seq_len():
    s = make_train_sample(make_rollout_sample(3, 10), advantage=1.0, seq_len=8)
    assert len(s.input_ids) == len(s.loss_mask) == len(s.inference_logprobs) == 8


def test_packing_conserves_every_token_once():
    lengths = [7, 3, 12, 5, 5, 9, 1, 16, 2, 8]
    samples = make_train_samples(lengths)
    ranks = pack(samples, seq_len=16, num_ranks=2)
    seqs = []
    for rank in ranks:
        for mb in rank:
            assert sum(mb.seq_lens) == len(mb.input_ids) <= 16
            n = len(mb.input_ids)
            assert len(mb.position_ids) == len(mb.loss_mask) == len(mb.advantages) == n
            assert len(mb.inference_logprobs) == len(mb.temperatures) == n
            start = 0
            for length in mb.seq_lens:
                assert mb.position_ids[start : start + length] == list(range(length))
                seqs.append(tuple(mb.input_ids[start : start + length]))
                start += length
    real = sorted(s for s in seqs if s != (0,))
    assert real == sorted(tuple(s.input_ids) for s in samples)


def test_packing_balances_tokens_and_micro_batch_counts_across_ranks():
    samples = make_train_samples([10, 9, 8, 7, 6, 5, 4, 3, 2, 1] * 4)
    ranks = pack(samples, seq_len=32, num_ranks=4)
    assert len({len(r) for r in ranks}) == 1
    loads = [sum(sum(mb.loss_mask) for mb in r) for r in ranks]
    assert max(loads) - min(loads) <= 10


def test_padding_micro_batches_carry_no_loss():
    ranks = pack(make_train_samples([16, 16, 16]), seq_len=16, num_ranks=2)
    assert [len(r) for r in ranks] == [2, 2]
    padding = [mb for r in ranks for mb in r if mb.seq_lens == [1]]
    assert len(padding) == 1 and padding[0].loss_mask == [0]


def test_advantage_is_repeated_on_each_token_of_its_sample():
    ranks = pack(make_train_samples([3, 2]), seq_len=8, num_ranks=1)
    (mb,) = ranks[0]
    assert mb.seq_lens == [3, 2]
    assert mb.advantages == [0.0, 0.0, 0.0, 1.0, 1.0]


def test_lag_counts_versions_behind_the_step_base_weights():
    assert off_policy_lag(step=1, policy_version=0) == 0
    assert off_policy_lag(step=5, policy_version=2) == 2


def test_stale_samples_are_older_than_max_off_policy_steps():
    assert not is_stale(step=5, policy_version=2, max_off_policy_steps=2)
    assert is_stale(step=5, policy_version=1, max_off_policy_steps=2)
    assert is_stale(step=3, policy_version=1, max_off_policy_steps=0)


def test_async_level_zero_waits_for_previous_weights():
    assert max_allowed_step(applied_version=0, async_level=0) == 1
    assert max_allowed_step(applied_version=4, async_level=2) == 7


def test_min_policy_version_never_negative():
    assert min_policy_version(step=2, max_off_policy_steps=8) == 0
    assert min_policy_version(step=12, max_off_policy_steps=8) == 3
