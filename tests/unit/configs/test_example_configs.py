"""Every TOML under examples/ and configs/ parses into the config of its command."""

from pathlib import Path

import pytest

from rlbus.configs import InferenceConfig, OrchestratorConfig, RLConfig, SFTConfig, TrainerConfig
from rlbus.configs.base import parse_cli

REPO = Path(__file__).resolve().parents[3]
CONFIG_FOR_STEM = {
    "rl": RLConfig,
    "sft": SFTConfig,
    "trainer": TrainerConfig,
    "orchestrator": OrchestratorConfig,
    "inference": InferenceConfig,
}
TOML_FILES = sorted([*REPO.glob("examples/**/*.toml"), *REPO.glob("configs/**/*.toml")])


def config_class(path: Path):
    """By file name: `rl.toml`, `rl-big.toml`, `sft_debug.toml` -> RLConfig / SFTConfig, ..."""
    stem = path.stem.replace("_", "-").split("-")[0]
    assert stem in CONFIG_FOR_STEM, (
        f"{path}: name it after its command ({', '.join(CONFIG_FOR_STEM)})"
    )
    return CONFIG_FOR_STEM[stem]


def test_examples_and_debug_configs_exist():
    names = {str(p.relative_to(REPO)) for p in TOML_FILES}

    assert {"examples/reverse-text/rl.toml", "examples/reverse-text/sft.toml"} <= names
    assert {"configs/debug/rl.toml", "configs/debug/sft.toml"} <= names


@pytest.mark.parametrize("path", TOML_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_config_file_parses(path):
    cls = config_class(path)

    assert type(parse_cli(cls, ["@", str(path)])) is cls
