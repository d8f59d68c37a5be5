"""Trainer test fixtures: one tiny model per session (helpers live in tests/trainer_support.py)."""

import pytest

from rlbus_trainer.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "model", seed=0)
