"""Per-environment settings: `[[orchestrator.env]]` overrides, their config errors, and the
settings each environment's tasks carry (env_mix.py)."""

import pytest
from pydantic import ValidationError

from rlbus.configs.base import format_validation_error
from rlbus.configs.orchestrator import OrchestratorConfig
from rlbus.wire.tasks import EpisodeLimits, SamplingArgs
from rlbus_orchestrator.env_mix import EnvMix, env_settings


def config_error(**fields) -> str:
    """The one-line-per-error message a user sees for an orchestrator config."""
    with pytest.raises(ValidationError) as caught:
        OrchestratorConfig(**fields)
    return format_validation_error(OrchestratorConfig, caught.value)


def test_an_env_without_overrides_takes_the_orchestrator_sampling_group_size_and_seq_len():
    config = OrchestratorConfig(
        group_size=4, batch_size=8, sampling={"temperature": 0.7, "max_tokens": 64}, seq_len=512
    )
    [settings] = env_settings(config)
    assert settings.group_size == 4 and settings.min_group_size == 2
    assert settings.sampling == SamplingArgs(temperature=0.7, max_tokens=64)
    # an episode's tokens are bounded by the sequence it trains as (and the engine's context)
    assert settings.limits == EpisodeLimits(max_total_tokens=512)


def test_env_sampling_fields_replace_the_orchestrators_and_extra_body_is_merged_over_it():
    config = OrchestratorConfig(
        sampling={"temperature": 0.7, "top_p": 0.9, "seed": 3, "extra_body": {"a": 1, "b": 2}},
        env=[
            {"id": "reverse-text", "sampling": {"temperature": 0.2, "stop": ["\n"]}},
            {"id": "reverse-text", "sampling": {"max_tokens": 9, "extra_body": {"b": 5}}},
        ],
    )
    first, second = env_settings(config)
    assert first.sampling == SamplingArgs(
        temperature=0.2, top_p=0.9, stop=["\n"], seed=3, extra={"a": 1, "b": 2}
    )
    assert second.sampling == SamplingArgs(
        temperature=0.7, top_p=0.9, max_tokens=9, seed=3, extra={"a": 1, "b": 5}
    )


def test_episode_limits_of_an_env_fill_its_tasks_limits():
    config = OrchestratorConfig(
        env=[
            {"id": "reverse-text", "max_turns": 3, "max_total_tokens": 900, "episode_timeout_s": 30}
        ]
    )
    [settings] = env_settings(config)
    assert settings.limits == EpisodeLimits(max_turns=3, max_total_tokens=900, deadline_s=30.0)


def test_envs_of_different_group_sizes_need_a_batch_at_least_the_largest_group():
    envs = [{"id": "reverse-text", "group_size": 4}, {"id": "reverse-text", "group_size": 16}]
    message = config_error(env=envs, batch_size=8)
    assert message.splitlines()[1] == (
        "--batch-size: must be at least the largest group size (16, of the group sizes 4, 16 of "
        "the environments): a step takes whole groups (got 8)"
    )
    config = OrchestratorConfig(env=envs, batch_size=20)  # not a multiple of 16: allowed
    assert [s.group_size for s in env_settings(config)] == [4, 16]


def test_one_group_size_for_every_env_keeps_the_multiple_of_group_size_rule():
    envs = [{"id": "reverse-text", "group_size": 4}, {"id": "reverse-text", "group_size": 4}]
    message = config_error(env=envs, group_size=8, batch_size=10)
    assert "--batch-size: must be a multiple of group_size (4)" in message
    assert "use 8 or 12 (got 10)" in message


def test_min_group_size_above_a_group_size_is_one_error_naming_the_field_to_change():
    message = config_error(min_group_size=3, group_size=2, batch_size=4)
    assert message.splitlines()[1].startswith(
        "--min-group-size: group size 2 of env[0] ('reverse-text') is below min_group_size (3)"
    )
    envs = [{"id": "reverse-text", "group_size": 2}, {"id": "reverse-text"}]
    message = config_error(min_group_size=3, env=envs, batch_size=16)
    assert len(message.splitlines()) == 2
    assert message.splitlines()[1].startswith("--env[0].group-size: group size 2 of env[0]")
    assert "--min-group-size" in config_error(min_group_size=0)


def test_the_default_min_group_size_gives_way_to_a_smaller_group():
    config = OrchestratorConfig(group_size=1, batch_size=4)
    assert [s.min_group_size for s in env_settings(config)] == [1]
    envs = [{"id": "reverse-text", "group_size": 1}, {"id": "reverse-text", "group_size": 4}]
    config = OrchestratorConfig(env=envs, batch_size=8, min_group_size=1)
    assert [s.min_group_size for s in env_settings(config)] == [1, 1]


def test_a_bad_env_override_names_the_env_field():
    assert "--env[0].sampling.temperature" in config_error(
        env=[{"id": "reverse-text", "sampling": {"temperature": -1}}]
    )
    assert "--env[0].episode-timeout-s" in config_error(
        env=[{"id": "reverse-text", "episode_timeout_s": 0}]
    )
    assert "--env[0].group-size" in config_error(env=[{"id": "reverse-text", "group_size": 0}])


def test_the_env_of_a_cursor_is_the_same_for_every_part_and_follows_the_weights():
    # two entries of the one built-in id, told apart by their group sizes
    config = OrchestratorConfig(
        env=[
            {"id": "reverse-text", "weight": 3.0},
            {"id": "reverse-text", "weight": 1.0, "group_size": 4},
        ],
        batch_size=16,
    )
    mix = EnvMix(config)
    sizes = [mix.of_cursor(c).group_size for c in range(400)]
    assert 60 < sizes.count(4) < 140  # about a quarter
    assert sizes == [EnvMix(config).of_task(f"train-{c}").group_size for c in range(400)]
    assert mix.of_task("eval-3-1") is None and mix.env_id_of("eval-3-1") == ""
    assert mix.env_ids() == ["reverse-text"]
