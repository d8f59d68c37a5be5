"""Space-separated list values on the command line, wherever the list field lives: at the root,
in a plain sub-config, in an optional sub-config (`X | None`) and in a union variant."""

import pytest

from rlbus.configs import RLConfig, TrainerConfig
from rlbus.configs.base import parse_cli


def test_list_in_an_optional_sub_config_takes_space_separated_values():
    config = parse_cli(RLConfig, ["--monitors.wandb.tags", "a", "b", "--max-steps", "3"])

    assert config.monitors.wandb is not None
    assert config.monitors.wandb.tags == ["a", "b"]
    assert config.max_steps == 3  # the list stopped at the next flag


def test_list_in_a_union_variant_takes_space_separated_values():
    config = parse_cli(TrainerConfig, ["--optim.type", "adamw", "--optim.betas", "0.8", "0.95"])

    assert config.optim.betas == [0.8, 0.95]


def test_list_in_a_union_variant_selected_by_default_tag():
    config = parse_cli(TrainerConfig, ["--optim.betas", "0.5", "0.6", "--seed", "4"])

    assert config.optim.betas == [0.5, 0.6]
    assert config.seed == 4


def test_one_value_and_json_still_work_inside_optional_sub_configs():
    one = parse_cli(RLConfig, ["--monitors.wandb.tags", "solo"])
    as_json = parse_cli(RLConfig, ["--monitors.wandb.tags", '["x", "y"]'])

    assert one.monitors.wandb.tags == ["solo"]
    assert as_json.monitors.wandb.tags == ["x", "y"]


def test_list_in_an_optional_sub_config_stops_before_a_file(tmp_path):
    path = tmp_path / "rl.toml"
    path.write_text("max_steps = 9\n")

    config = parse_cli(RLConfig, ["--monitors.wandb.tags", "a", "b", "@", str(path)])

    assert config.monitors.wandb.tags == ["a", "b"]
    assert config.max_steps == 9


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--orchestrator.inference-urls", "http://a/v1", "http://b/v1"], ["http://a/v1", "http://b/v1"]),
        (["--orchestrator.inference-urls", '["http://c/v1"]'], ["http://c/v1"]),
    ],
)  # fmt: skip
def test_list_in_a_plain_sub_config_is_unchanged(args, expected):
    assert parse_cli(RLConfig, args).orchestrator.inference_urls == expected
