"""The fields every runnable config shares (ServiceConfig < RunnableConfig < TrainingRunConfig,
and LaunchConfig for the launchers)
behave the same on every config: same defaults and --help text, same flags, and under `rl` the
pushed value unless the service sets its own."""

import pytest

from rlbus.configs import (
    InferenceConfig,
    LaunchConfig,
    OrchestratorConfig,
    RLConfig,
    RunnableConfig,
    ServiceConfig,
    SFTConfig,
    TrainerConfig,
    TrainingRunConfig,
)
from rlbus.configs.base import _field_docstrings, config_to_toml, parse_cli

CONFIGS = [
    (RLConfig, TrainingRunConfig),
    (TrainerConfig, TrainingRunConfig),
    (SFTConfig, TrainingRunConfig),
    (RLConfig, LaunchConfig),
    (SFTConfig, LaunchConfig),
    (OrchestratorConfig, RunnableConfig),
    (InferenceConfig, ServiceConfig),
]
IDS = [f"{cls.__name__}-{block.__name__}" for cls, block in CONFIGS]

# One non-default value per shared field, as flags, and the value it must produce.
FLAGS = {
    "bus": (["--bus.url", "nats://h:4222"], lambda c: c.bus.url == "nats://h:4222"),
    "log": (["--log.level", "debug"], lambda c: c.log.level == "debug"),
    "otel": (["--no-otel.enabled"], lambda c: c.otel.enabled is False),
    "metrics": (["--metrics.port", "9100"], lambda c: c.metrics.port == 9100),
    "exit_when_finished": (["--exit-when-finished"], lambda c: c.exit_when_finished is True),
    "output_dir": (["--output-dir", "elsewhere"], lambda c: c.output_dir == "elsewhere"),
    "run": (["--run.name", "r1", "--run.dir", "d1"], lambda c: (c.run.name, c.run.dir) == ("r1", "d1")),
    "clean": (["--clean"], lambda c: c.clean is True),
    "resume": (["--resume.step", "3"], lambda c: c.resume.step == 3),
    "ckpt": (["--ckpt.interval", "5"], lambda c: c.ckpt.interval == 5),
    "weight_broadcast": (["--weight-broadcast.type", "nccl"], lambda c: c.weight_broadcast.type == "nccl"),
    "dry_run": (["--dry-run"], lambda c: c.dry_run is True),
}  # fmt: skip


def test_every_shared_field_has_a_flag_case():
    assert set(FLAGS) == set(TrainingRunConfig.model_fields) | set(LaunchConfig.model_fields)


@pytest.mark.parametrize("cls", [RLConfig, SFTConfig], ids=["RLConfig", "SFTConfig"])
def test_only_the_launchers_take_clean_and_dry_run(cls):
    for name in LaunchConfig.model_fields:
        args, check = FLAGS[name]
        assert check(parse_cli(cls, args)), name
    for service in (TrainerConfig, OrchestratorConfig, InferenceConfig):
        assert not set(LaunchConfig.model_fields) & set(service.model_fields), service.__name__


@pytest.mark.parametrize(("cls", "block"), CONFIGS, ids=IDS)
def test_shared_fields_have_the_block_defaults_and_help(cls, block):
    config = cls()
    for name, finfo in block.model_fields.items():
        assert cls.model_fields[name].annotation == finfo.annotation, name
        assert getattr(config, name) == getattr(block(), name), name
        assert _field_docstrings(cls)[name] == _field_docstrings(block)[name], name


@pytest.mark.parametrize(("cls", "block"), CONFIGS, ids=IDS)
def test_shared_fields_take_the_same_flags_and_round_trip_through_toml(cls, block, tmp_path):
    for name in block.model_fields:
        args, check = FLAGS[name]
        config = parse_cli(cls, args)
        assert check(config), name
        path = tmp_path / f"{name}.toml"
        path.write_text(config_to_toml(config))
        assert check(parse_cli(cls, ["@", str(path)])), name


@pytest.mark.parametrize("service", ["trainer", "orchestrator", "inference"])
def test_rl_pushes_the_shared_block_down_and_an_explicit_service_value_wins(service):
    for name in ServiceConfig.model_fields:
        args, check = FLAGS[name]
        assert check(getattr(parse_cli(RLConfig, args), service)), f"{name} not pushed down"

    config = parse_cli(RLConfig, ["--log.level", "debug", f"--{service}.log.level", "error"])
    assert getattr(config, service).log.level == "error"
    others = {"trainer", "orchestrator", "inference"} - {service}
    assert all(getattr(config, other).log.level == "debug" for other in others)


def test_rl_pushes_the_run_and_training_fields_to_the_services_that_have_them():
    config = parse_cli(
        RLConfig, ["--output-dir", "o", "--run.name", "n", "--clean", "--ckpt.interval", "4"]
    )

    assert config.trainer.output_dir == config.orchestrator.output_dir == "o"
    assert config.trainer.run.name == config.orchestrator.run.name == "n"
    assert config.inference.run_dir == "o/n"
    assert config.trainer.ckpt.interval == 4
    assert config.clean and "clean" not in type(config.trainer).model_fields  # the launcher's
