"""The group pool: which groups make the next batch, and which became stale."""

from coordinator_fakes import FakeDelivery, make_pooled, make_rollout

from rlbus_orchestrator.group_pool import GroupPool


def make_pool(*groups):
    pool = GroupPool()
    for group in groups:
        pool.add(group)
    return pool


def test_the_oldest_groups_reaching_batch_size_samples_make_the_batch():
    pool = make_pool(*(make_pooled(f"train-{i}", [0.0, 1.0]) for i in range(3)))
    groups = pool.next_batch_groups(batch_size=4, token_budget=None)
    assert [g.task_id for g in groups] == ["train-0", "train-1"]
    assert pool.next_batch_groups(batch_size=7, token_budget=None) is None
    assert pool.num_samples() == 6 and len(pool) == 3  # choosing removes nothing


def test_token_budget_closes_a_batch_by_tokens():
    pool = make_pool(make_pooled("a", [0, 1]), make_pooled("b", [0, 1]))  # 10 tokens each
    groups = pool.next_batch_groups(batch_size=100, token_budget=10)
    assert [g.task_id for g in groups] == ["a"]


def test_stale_groups_are_taken_out_and_fresh_ones_stay():
    pool = make_pool(make_pooled("old", [0, 1], version=0), make_pooled("new", [0, 1], version=2))
    stale = pool.take_stale(step=3, max_off_policy_steps=0)
    assert [g.task_id for g in stale] == ["old"] and "old" not in pool and "new" in pool


def test_a_redelivered_pooled_rollout_keeps_the_newest_handle():
    pool = make_pool(make_pooled("train-0", [0, 1]))
    again = FakeDelivery(make_rollout("train-0", [0, 1]))
    pool.refresh_delivery(again)
    assert pool.groups["train-0"].delivery is again
