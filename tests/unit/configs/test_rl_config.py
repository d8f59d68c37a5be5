"""RLConfig pushes shared values down into the service configs; explicit service values win."""

import pytest

from rlbus.configs import RLConfig
from rlbus.configs.base import parse_cli


def make_rl(*args: str) -> RLConfig:
    return parse_cli(RLConfig, list(args))


def test_shared_values_reach_every_service():
    config = make_rl(
        "--model.name", "m", "--seq-len", "256", "--max-steps", "7", "--bus.url", "nats://h:4222"
    )

    assert (
        config.trainer.model.name
        == config.orchestrator.model.name
        == config.inference.vllm.model
        == "m"
    )
    assert (
        config.trainer.seq_len
        == config.orchestrator.seq_len
        == config.inference.vllm.max_model_len
        == 256
    )
    assert config.trainer.max_steps == config.orchestrator.max_steps == 7
    assert config.trainer.model.dtype == config.inference.vllm.dtype == "float32"
    assert make_rl("--model.dtype", "bfloat16").inference.vllm.dtype == "bfloat16"
    assert (
        make_rl("--model.dtype", "bfloat16", "--inference.vllm.dtype", "auto").inference.vllm.dtype
        == "auto"
    )
    assert (
        config.trainer.bus.url
        == config.orchestrator.bus.url
        == config.inference.bus.url
        == "nats://h:4222"
    )


def test_explicit_service_values_win_over_shared_ones():
    config = make_rl(
        "--max-steps", "10", "--trainer.max-steps", "5",
        "--model.dtype", "bfloat16", "--trainer.model.dtype", "float32",
        "--seq-len", "256", "--inference.vllm.max-model-len", "512",
        "--deployment.num-train-gpus", "2", "--orchestrator.num-train-ranks", "1",
    )  # fmt: skip

    assert config.trainer.max_steps == 5 and config.orchestrator.max_steps == 10
    assert config.trainer.model.dtype == "float32" and config.orchestrator.model.dtype == "bfloat16"
    assert config.inference.vllm.max_model_len == 512 and config.trainer.seq_len == 256
    assert config.orchestrator.num_train_ranks == 1


def test_explicit_service_values_from_a_file_win_too(tmp_path):
    path = tmp_path / "rl.toml"
    path.write_text(
        "max_steps = 10\n[orchestrator]\nmax_steps = 3\n[orchestrator.log]\nlevel = 'debug'\n"
    )

    config = make_rl("@", str(path))

    assert config.orchestrator.max_steps == 3 and config.trainer.max_steps == 10
    assert config.orchestrator.log.level == "debug" and config.trainer.log.level == "info"


def test_naming_the_run_pushes_the_name_and_bus_prefix_down_again():
    config = make_rl("--trainer.log.level", "debug").with_run_name("my-run")

    assert config.trainer.run.name == config.orchestrator.run.name == "my-run"
    assert config.trainer.bus.run_id == config.inference.bus.run_id == "my-run"
    assert config.inference.run_dir == "outputs/my-run"
    assert config.trainer.log.level == "debug"  # still the explicit value


def test_services_do_not_share_mutable_sub_configs():
    config = make_rl().with_run_name("r")

    config.trainer.bus.url = "nats://changed"

    assert config.orchestrator.bus.url is None and config.bus.url is None


def test_a_lora_trainer_turns_on_lora_in_the_engine():
    config = make_rl("--trainer.lora", "--trainer.lora.rank", "12")
    assert config.trainer.lora.rank == 12 and config.trainer.lora.target_modules[0] == "q_proj"
    args = config.inference.vllm_cli_args()
    assert "--enable-lora" in args
    assert args[args.index("--max-lora-rank") + 1] == "16"  # the next rank vLLM accepts
    explicit = make_rl("--trainer.lora", "--inference.vllm.max-lora-rank", "64")
    assert explicit.inference.vllm.model_extra["max_lora_rank"] == "64"  # extras stay strings
    assert "--enable-lora" not in make_rl().inference.vllm_cli_args()


def test_the_tool_call_parser_follows_the_model_family_unless_set(tmp_path):
    import json as json_

    from rlbus.configs.inference import InferenceConfig

    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "config.json").write_text(json_.dumps({"model_type": "qwen3"}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json_.dumps({"model_type": "gpt2"}))

    def parser_flags(**vllm):
        args = InferenceConfig(vllm=vllm).vllm_cli_args(on_cpu=True)
        parser = (
            args[args.index("--tool-call-parser") + 1] if "--tool-call-parser" in args else None
        )
        return parser, "--enable-auto-tool-choice" in args

    assert parser_flags(model=str(qwen)) == ("hermes", True)
    assert parser_flags(model=str(other)) == (None, False)  # unknown family: no guess
    assert parser_flags(model="Org/not-on-disk") == (None, False)
    assert parser_flags(model=str(other), tool_call_parser="pythonic") == ("pythonic", True)
    assert parser_flags(model=str(qwen), tool_call_parser="none") == (None, False)


def test_each_environments_max_tokens_and_episode_budget_must_fit_the_engine_context(
    tmp_path, capsys
):
    path = tmp_path / "rl.toml"
    path.write_text(
        "seq_len = 256\n"
        "[[orchestrator.env]]\nid = 'reverse-text'\n"
        "[[orchestrator.env]]\nid = 'reverse-text'\nmax_total_tokens = 512\n"
        "sampling = { max_tokens = 300 }\n"
    )
    with pytest.raises(SystemExit):
        make_rl("@", str(path))
    text = capsys.readouterr().err
    assert "--orchestrator.env[1].sampling.max-tokens" in text
    assert "--orchestrator.env[1].max-total-tokens" in text
    assert "orchestrator.env[0]" not in text
    assert "max_model_len (256" in text

    path.write_text(
        "seq_len = 256\n[[orchestrator.env]]\nid = 'reverse-text'\nmax_total_tokens = 256\n"
        "sampling = { max_tokens = 64 }\n"
    )
    assert make_rl("@", str(path)).orchestrator.env[0].sampling.max_tokens == 64


def test_dr_grpo_normaliser_is_the_orchestrator_token_budget_unless_set():
    pushed = RLConfig.model_validate(
        {"trainer": {"loss": {"type": "dr_grpo"}}, "orchestrator": {"sampling": {"max_tokens": 48}}}
    )
    assert pushed.trainer.loss.max_tokens == 48
    own = RLConfig.model_validate(
        {
            "trainer": {"loss": {"type": "dr_grpo", "max_tokens": 100}},
            "orchestrator": {"sampling": {"max_tokens": 48}},
        }
    )
    assert own.trainer.loss.max_tokens == 100
