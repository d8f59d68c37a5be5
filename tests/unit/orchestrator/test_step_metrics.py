"""A step's metrics from its counters, its samples and the task ledger."""

import msgspec
import pytest
from coordinator_fakes import make_rollout

from rlbus_orchestrator.state_store import DROP_REASONS, CoordinatorState
from rlbus_orchestrator.step_metrics import StepStats, step_metrics


def test_rewards_cover_the_flat_groups_sampled_and_trained_mean_only_the_batch():
    stats = StepStats(no_signal=[make_rollout("train-1", [1.0, 1.0])])
    state = CoordinatorState(next_step=2, cursor=3, outstanding={"train-0": 0, "train-2": 2})
    m = step_metrics(
        2,
        [make_rollout("train-0", [0.0, 1.0], version=0)],
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
        1,
        [make_rollout("train-0", [0.0, 1.0])],
        stats=stats,
        state=state,
        num_pooled=0,
        applied_version=0,
    )
    assert {k for k in m if k.startswith("dropped/")} == {f"dropped/{r}" for r in DROP_REASONS}
    assert (m["dropped/stale"], m["tasks/dropped/stale"], m["tasks/dropped/error"]) == (2, 5, 1)


def test_reset_starts_the_next_step_from_zero():
    stats = StepStats(own_s=3.0, completion_tokens=7)
    stats.dropped["error"] += 1
    stats.count_drop("stale", "reverse-text")
    stats.no_signal.append(make_rollout("train-0", [1.0]))
    stats.reset()
    assert (stats.own_s, stats.completion_tokens, stats.dropped, stats.no_signal) == (
        0.0,
        0,
        {},
        [],
    )
    assert stats.env_dropped == {} and stats.episodes_dropped == {}


def env_rollout(task_id, env_id, rewards, **sample_fields):
    rollout = make_rollout(task_id, rewards)
    samples = [msgspec.structs.replace(s, **sample_fields) for s in rollout.samples]
    return msgspec.structs.replace(rollout, env_id=env_id, samples=samples)


def test_each_environment_of_the_run_gets_its_own_keys_even_without_samples():
    stats = StepStats(no_signal=[env_rollout("train-2", "math", [1.0, 1.0])])
    stats.count_drop("error", "math")
    stats.count_dropped_episodes(msgspec.structs.replace(make_rollout("t", [0.0]), dropped={}))
    stats.count_dropped_episodes(
        msgspec.structs.replace(env_rollout("t", "math", [0.0]), dropped={"timeout": 2})
    )
    batch = [
        env_rollout(
            "train-0", "math", [0.0, 1.0], num_turns=3, num_tool_calls=2, num_tool_errors=1
        ),
        env_rollout("train-1", "reverse-text", [0.5, 0.7]),
    ]
    m = step_metrics(
        1,
        batch,
        stats=stats,
        state=CoordinatorState(),
        num_pooled=0,
        applied_version=0,
        env_ids=["reverse-text", "math", "idle"],
    )
    assert m["env/math/reward/mean"] == pytest.approx(0.75)  # with the flat group, as reward/mean
    assert (m["env/math/samples"], m["env/math/trained_samples"]) == (4.0, 2.0)
    assert m["env/math/num_turns/mean"] == 2.0 and m["env/math/tool_calls/mean"] == 1.0
    assert m["env/math/tool_errors"] == 2.0 and m["env/math/completion_len/mean"] == 3.0
    assert m["env/reverse-text/reward/mean"] == pytest.approx(0.6)
    assert m["env/math/dropped/error"] == 1.0 and m["env/reverse-text/dropped/error"] == 0.0
    assert m["env/math/episodes_dropped/timeout"] == 2.0 and m["episodes_dropped/timeout"] == 2.0
    assert m["env/idle/samples"] == 0.0 and "env/idle/reward/mean" not in m
    assert {k.split("/")[1] for k in m if k.startswith("env/")} == {"reverse-text", "math", "idle"}


def test_multi_turn_episodes_are_counted_by_why_they_ended():
    batch = [
        env_rollout("train-0", "game", [0.0, 1.0], stop_reason="max_turns"),
        env_rollout("train-1", "game", [1.0, 1.0], stop_reason="done"),
        env_rollout("train-2", "reverse-text", [0.5, 0.7]),
    ]
    m = step_metrics(
        1,
        batch,
        stats=StepStats(),
        state=CoordinatorState(),
        num_pooled=0,
        applied_version=0,
        env_ids=["game", "reverse-text"],
    )
    assert (m["env/game/stop/max_turns"], m["env/game/stop/done"]) == (2.0, 2.0)
    assert m["env/game/stop/deadline"] == 0.0
    assert not any(key.startswith("env/reverse-text/stop/") for key in m)  # single-turn: none
