"""Rollout intake: quarantine, deduplication and the drop decisions on arrival."""

import asyncio

import msgspec
import pytest
from coordinator_fakes import FakeDelivery, make_parts, make_pooled, make_rollout

from rlbus.wire.rollouts import Rollout
from rlbus_orchestrator.rollout_intake import RolloutIntake


def make_intake(**overrides):
    config, store, pool, stats = make_parts(**overrides)
    return RolloutIntake(store.bus, config, store=store, pool=pool, stats=stats)


def test_stale_error_and_flat_groups_are_dropped_with_a_reason():
    intake = make_intake()
    intake.store.state.next_step = 4
    assert intake.drop_reason(make_rollout("t", [0.0, 1.0], version=1)) == "stale"
    assert intake.drop_reason(make_rollout("t", [0.0, 1.0], version=2)) is None
    assert intake.drop_reason(make_rollout("t", [0.5, 0.5], version=3)) == "zero_advantage"
    assert intake.drop_reason(Rollout(task_id="t", step=1, env_id="x", error="boom")) == "error"
    keep_flat = make_intake(filter_zero_advantage=False)
    assert keep_flat.drop_reason(make_rollout("t", [0.5, 0.5])) is None


def test_a_good_group_is_pooled_unacked_with_its_advantages():
    intake = make_intake()
    intake.store.record_issued({"train-0": 0})
    d = FakeDelivery(make_rollout("train-0", [0.0, 1.0]))
    asyncio.run(intake.accept(d))
    assert not d.acked and intake.pool.groups["train-0"].advantages == [-0.5, 0.5]
    assert intake.stats.completion_tokens == 6 and intake.store.saved == []


def test_a_flat_group_is_dropped_saved_and_acked_and_its_samples_still_count_as_sampled():
    intake = make_intake()
    intake.store.record_issued({"train-0": 0})
    d = FakeDelivery(make_rollout("train-0", [0.5, 0.5]))
    asyncio.run(intake.accept(d))
    assert d.acked and not intake.pool and intake.store.state.dropped == {"zero_advantage": 1}
    assert intake.stats.dropped["zero_advantage"] == 1
    assert [len(r.samples) for r in intake.stats.no_signal] == [2]
    [(saved, _)] = intake.store.saved
    assert saved.dropped == {"zero_advantage": 1}


def test_a_rollout_redelivered_while_pooled_refreshes_the_handle_and_is_not_pooled_twice():
    intake = make_intake()
    intake.store.record_issued({"train-0": 0})
    intake.pool.add(make_pooled("train-0", [0.0, 1.0]))
    again = FakeDelivery(make_rollout("train-0", [0.0, 1.0]))
    asyncio.run(intake.accept(again))
    assert len(intake.pool) == 1 and intake.pool.groups["train-0"].delivery is again
    assert not again.acked


def test_an_invalid_rollout_goes_to_the_dead_letters_and_its_task_is_dropped_as_invalid():
    intake = make_intake()
    intake.store.record_issued({"train-0": 0})
    intake.pool.add(make_pooled("train-0", [0.0, 1.0]))
    bad = make_rollout("train-0", [0.0])  # one sample, group_size is 2
    d = FakeDelivery(bad)
    assert asyncio.run(intake.quarantine_if_invalid(d))
    assert d.termed and not d.acked and not intake.pool
    assert intake.store.state.dropped == {"invalid": 1} and "group_size=2" in intake.bus.dead[0][2]
    good = FakeDelivery(make_rollout("train-0", [0.0, 1.0]))
    assert not asyncio.run(intake.quarantine_if_invalid(good)) and not good.termed


def partial_rollout(task_id, rewards, dropped, env_id="reverse-text"):
    rollout = make_rollout(task_id, rewards)
    return msgspec.structs.replace(rollout, env_id=env_id, dropped=dropped)


def test_a_partial_group_is_pooled_with_the_advantages_of_its_survivors():
    intake = make_intake(group_size=4, batch_size=8)
    intake.store.record_issued({"train-0": 0})
    d = FakeDelivery(partial_rollout("train-0", [0.0, 0.0, 3.0], {"timeout": 1}))
    assert not asyncio.run(intake.quarantine_if_invalid(d))
    asyncio.run(intake.accept(d))
    assert not d.acked and intake.pool.groups["train-0"].advantages == [-1.0, -1.0, 2.0]
    assert intake.stats.episodes_dropped == {("reverse-text", "timeout"): 1}
    assert intake.stats.dropped == {}


@pytest.mark.parametrize(
    ("dropped", "reason"),
    [({"error": 3}, "error"), ({"error": 1, "timeout": 2}, "timeout"), ({}, "error")],
)
def test_a_group_left_with_fewer_than_min_group_size_is_dropped_as_its_main_failure(
    dropped, reason
):
    intake = make_intake(group_size=4, batch_size=8)
    intake.store.record_issued({"train-0": 0})
    rollout = partial_rollout("train-0", [1.0], dropped)
    assert intake.drop_reason(rollout) == reason
    asyncio.run(intake.accept(FakeDelivery(rollout)))
    assert intake.store.state.dropped == {reason: 1}
    assert intake.stats.env_dropped == {("reverse-text", reason): 1}


def test_min_group_size_decides_how_few_survivors_still_train():
    intake = make_intake(group_size=4, batch_size=8, min_group_size=3)
    assert intake.drop_reason(partial_rollout("train-0", [0.0, 1.0], {"error": 2})) == "error"
    keep = partial_rollout("train-0", [0.0, 1.0, 1.0], {"error": 1})
    assert intake.drop_reason(keep) is None


def test_drops_are_counted_per_environment_of_the_task():
    envs = [{"id": "reverse-text", "group_size": 2}, {"id": "reverse-text", "group_size": 4}]
    intake = make_intake(env=envs, batch_size=8)
    intake.store.record_issued({"train-0": 0, "train-1": 1})
    intake.drop("train-1", "timeout")
    intake.drop("train-1", "timeout")  # already ended: not counted twice
    assert intake.stats.env_dropped == {("reverse-text", "timeout"): 1}
    assert intake.store.state.dropped == {"timeout": 1}


def test_groups_dropped_in_a_row_are_reported_with_why_until_one_is_kept(monkeypatch):
    from rlbus_orchestrator import rollout_intake

    warnings = []
    monkeypatch.setattr(rollout_intake, "STALLED_EVERY", 3)
    monkeypatch.setattr(
        rollout_intake.log, "warning", lambda event, **fields: warnings.append((event, fields))
    )
    intake = make_intake()
    intake.store.record_issued({f"train-{i}": 0 for i in range(8)})
    for i in range(6):  # two warnings: after 3 and after 6 flat groups
        asyncio.run(intake.accept(FakeDelivery(make_rollout(f"train-{i}", [0.0, 0.0]))))
    assert [f["dropped_in_a_row"] for _, f in warnings] == [3, 6]
    event, fields = warnings[-1]
    assert event == "no_group_kept" and fields["by_reason"] == {"zero_advantage": 6}
    assert "filter_zero_advantage" in fields["why"]
    asyncio.run(intake.accept(FakeDelivery(make_rollout("train-6", [0.0, 1.0]))))  # kept
    asyncio.run(intake.accept(FakeDelivery(make_rollout("train-7", [0.0, 0.0]))))
    assert len(warnings) == 2 and sum(intake.dropped_in_a_row.values()) == 1
