"""SFT's evaluation settings: which steps evaluate, the config the evaluator runs with, the
server `sft` starts, and the line a config without eval environments gets."""

import pytest
import torch
from pydantic import ValidationError

from rlbus.configs import SFTConfig
from rlbus.configs.base import parse_cli
from rlbus.configs.orchestrator import OrchestratorConfig
from rlbus_launch.sft import eval_server_config
from rlbus_trainer.engine import World
from rlbus_trainer.sft_eval import SFTEvaluator

EVAL = {"interval": 3, "num_examples": 4, "env": [{"id": "reverse-text", "name": "r"}]}


def sft_config(**eval_fields):
    return SFTConfig.model_validate({"seq_len": 96, "eval": EVAL | eval_fields})


def test_steps_0_every_interval_and_the_last_evaluate(tmp_path):
    world = World(rank=1, world_size=2, device=torch.device("cpu"))  # not main: writes nothing
    evaluator = SFTEvaluator(sft_config(), tmp_path, world, num_steps=10)
    assert [s for s in range(11) if evaluator.is_due(s)] == [0, 3, 6, 9, 10]
    quiet = SFTEvaluator(
        sft_config(eval_base_model=False, eval_last_step=False), tmp_path, world, num_steps=10
    )
    assert [s for s in range(11) if quiet.is_due(s)] == [3, 6, 9]


def test_the_evaluator_runs_the_eval_config_against_the_server(tmp_path):
    config = sft_config(inference_url="http://127.0.0.1:9/v1")
    orchestrator = config.eval.orchestrator("my/model", config.seq_len)
    assert isinstance(orchestrator, OrchestratorConfig)
    assert orchestrator.model.name == "my/model" and orchestrator.seq_len == 96
    assert orchestrator.inference_urls == ["http://127.0.0.1:9/v1"]
    assert [e.label for e in orchestrator.eval.env] == ["r"]
    assert orchestrator.eval.interval == 3 and orchestrator.eval.num_examples == 4


def test_sft_starts_a_server_on_free_local_ports_unless_one_is_attached(tmp_path):
    config = sft_config()
    server = eval_server_config(config, tmp_path)
    assert server is not None and server.vllm.model == config.model.name
    assert server.run_dir == str(tmp_path) and server.bus.url is None
    assert config.eval.inference_url == f"http://127.0.0.1:{server.server.port}/v1"
    assert config.eval.admin_url == f"http://127.0.0.1:{server.backend_port}"
    assert eval_server_config(sft_config(inference_url="http://h:8000/v1"), tmp_path) is None


def test_an_eval_without_environments_is_one_line_naming_the_field(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_cli(SFTConfig, ["--eval.interval", "5"], prog="sft")
    assert exit_info.value.code == 2
    assert "eval.env" in capsys.readouterr().err
    with pytest.raises(ValidationError, match="names two eval environments"):
        SFTConfig.model_validate({"eval": {"env": [{"id": "reverse-text"}] * 2}})
