"""Rollout validation (rlbus_orchestrator.validation): each fault that would break batching or
training is named; a usable rollout passes."""

import math

import pytest

from rlbus.wire.rollouts import Rollout, RolloutSample
from rlbus_orchestrator.validation import problem


def sample(**overrides) -> RolloutSample:
    fields = dict(
        prompt_token_ids=[1, 2],
        completion_token_ids=[3, 4],
        completion_logprobs=[-0.1, -0.2],
        completion_mask=[1, 1],
        reward=1.0,
        policy_version=2,
    )
    return RolloutSample(**(fields | overrides))


def check(task_id="train-3", samples=None, **kwargs):
    rollout = Rollout(
        task_id=task_id, step=3, env_id="e", samples=samples or [sample(), sample()], **kwargs
    )
    return problem(rollout, issued_cursor=5, group_size=2, next_step=4)


def test_a_usable_rollout_and_a_reported_error_pass():
    assert check() is None
    assert check(samples=[], error="boom") is None
    assert check("eval-2-0-0", samples=[sample()]) is None


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (dict(completion_mask=[1]), "must be equal"),
        (dict(completion_logprobs=[-0.1, -0.1, -0.1]), "must be equal"),
        (dict(completion_token_ids=[3, -4]), "negative token id"),
        (dict(completion_mask=[1, 2]), "0 or 1"),
        (dict(reward=math.nan), "reward is nan"),
        (dict(reward=math.inf), "reward is inf"),
        (dict(reward_components={"fmt": math.nan}), "reward component 'fmt'"),
        (dict(completion_logprobs=[-0.1, math.nan]), "logprob"),
        (dict(completion_logprobs=[-0.1, 3.0]), "logprob"),
        (dict(temperature=-1.0), "temperature"),
        (dict(policy_version=4), "policy_version 4 outside 0..3"),
        (dict(policy_version=-1), "policy_version -1"),
    ],
)
def test_each_sample_fault_is_named(overrides, expected):
    fault = check(samples=[sample(), sample(**overrides)])
    assert fault is not None and fault.startswith("sample 1: ") and expected in fault


def test_task_and_group_faults_are_named():
    assert "unknown task id" in check("my-task")
    assert "never issued" in check("train-5")
    assert "group of 3 samples, expected group_size=2" in check(samples=[sample()] * 3)


def test_a_partial_group_counts_its_left_out_episodes_toward_the_group_size():
    assert check(samples=[sample()], dropped={"timeout": 1}) is None
    nothing_left = Rollout(task_id="train-3", step=3, env_id="e", dropped={"error": 2})
    assert problem(nothing_left, issued_cursor=5, group_size=2, next_step=4) is None
    fault = check(samples=[sample()], dropped={"error": 2})
    assert fault == "group of 1 samples and 2 dropped episodes, expected group_size=2"
    assert "unknown reason 'oom'" in check(samples=[sample()], dropped={"oom": 1})


def test_a_training_rollout_of_another_environment_than_its_task_is_named():
    rollout = Rollout(task_id="train-3", step=3, env_id="e", samples=[sample(), sample()])
    fault = problem(rollout, issued_cursor=5, group_size=2, next_step=4, env_id="reverse-text")
    assert fault == "env_id 'e', but task train-3 is of 'reverse-text'"
    assert problem(rollout, issued_cursor=5, group_size=2, next_step=4, env_id="e") is None
