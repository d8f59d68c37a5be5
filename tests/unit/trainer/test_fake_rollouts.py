"""The trainer's fake rollouts (`[data.fake]`): shapes, per-sample advantages, rank split."""

from rlbus.configs import TrainerConfig
from rlbus_trainer.fake_rollouts import fake_micro_batches


def config(**fake) -> TrainerConfig:
    return TrainerConfig.model_validate({"data": {"fake": fake}, "max_steps": 3, "seq_len": 64})


def test_one_full_length_sample_per_row_with_a_quarter_prompt_and_one_advantage_each():
    rows = fake_micro_batches(config(batch_size=3), 1000, step=1, rank=0, world_size=1)
    assert [r.seq_lens for r in rows] == [[64], [64], [64]]
    for row in rows:
        assert row.loss_mask == [0] * 16 + [1] * 48
        assert len(set(row.advantages)) == 1 and all(0 <= t < 1000 for t in row.input_ids)
        assert set(
            lp for lp, m in zip(row.inference_logprobs, row.loss_mask, strict=True) if m
        ) == {
            -6.907755278982137  # log(1/1000): a uniform policy
        }
    assert rows == fake_micro_batches(config(batch_size=3), 1000, step=1, rank=0, world_size=1)
    assert rows != fake_micro_batches(config(batch_size=3), 1000, step=2, rank=0, world_size=1)


def test_generated_samples_are_packed_and_split_round_robin_over_ranks():
    packed = config(batch_size=8, generate_samples=True)
    whole = fake_micro_batches(packed, 1000, step=1, rank=0, world_size=1)
    assert sum(len(r.seq_lens) for r in whole) == 8 and len(whole) < 8
    assert all(len(r.input_ids) <= 64 for r in whole)
    for row in whole:  # each packed sample keeps its own advantage on all of its tokens
        start = 0
        for n in row.seq_lens:
            assert len(set(row.advantages[start : start + n])) == 1
            start += n
    shares = [fake_micro_batches(packed, 1000, step=1, rank=r, world_size=2) for r in (0, 1)]
    assert [sum(len(r.seq_lens) for r in share) for share in shares] == [4, 4]
    lengths = sorted(n for share in shares for r in share for n in r.seq_lens)
    assert lengths == sorted(n for r in whole for n in r.seq_lens)
