"""A step's metrics from its counters, its samples and the task ledger."""

import pytest
from coordinator_fakes import make_rollout

from rlbus_orchestrator.state_store import DROP_REASONS, CoordinatorState
from rlbus_orchestrator.step_metrics import StepStats, step_metrics


def make_samples(rewards, version=0):
    return make_rollout("train-0", rewards, version=version).samples


def test_rewards_cover_the_flat_groups_sampled_and_trained_mean_only_the_batch():
    stats = StepStats(no_signal_samples=make_samples([1.0, 1.0]))
    state = CoordinatorState(next_step=2, cursor=3, outstanding={"train-0": 0, "train-2": 2})
    m = step_metrics(
        2,
        make_samples([0.0, 1.0], version=0),
        stats=stats,
        state=state,
        num_pooled=1,
        applied_version=1,
        num_groups=1,
    )
    assert m["reward/mean"] == pytest.approx(0.75) and m["reward/trained_mean"] == 0.5
    assert m["reward/num_samples"] == 4 and m["off_policy_lag/1"] == 2.0
    assert (m["tasks/issued"], m["tasks/trained"], m["tasks/outstanding"]) == (3.0, 1.0, 1.0)
    assert m["tasks/in_flight"] == 1.0 and m["weights/applied_version"] == 1.0


def test_every_drop_reason_is_reported_for_the_step_and_for_the_run():
    stats = StepStats()
    stats.dropped["stale"] += 2
    state = CoordinatorState(dropped={"stale": 5, "error": 1})
    m = step_metrics(
        1, make_samples([0.0, 1.0]), stats=stats, state=state, num_pooled=0, applied_version=0
    )
    assert {k for k in m if k.startswith("dropped/")} == {f"dropped/{r}" for r in DROP_REASONS}
    assert (m["dropped/stale"], m["tasks/dropped/stale"], m["tasks/dropped/error"]) == (2, 5, 1)


def test_reset_starts_the_next_step_from_zero():
    stats = StepStats(own_s=3.0, completion_tokens=7)
    stats.dropped["error"] += 1
    stats.no_signal_samples.append(make_samples([1.0])[0])
    stats.reset()
    assert (stats.own_s, stats.completion_tokens, stats.dropped, stats.no_signal_samples) == (
        0.0,
        0,
        {},
        [],
    )
