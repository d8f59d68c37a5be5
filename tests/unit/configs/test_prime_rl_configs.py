"""prime-rl configs (tests/fixtures/prime_rl/, written after prime-rl's documented layout) load
where their keys map, fail with one line per key that needs a human, and `rl migrate-config`
turns each into an rlbus config (rlbus.configs.migrate, docs/migration.md)."""

from pathlib import Path

import pytest
import tomli

from rlbus.configs import RLConfig, SFTConfig
from rlbus.configs import orchestrator as orchestrator_config
from rlbus.configs.base import known_flag_paths, parse_cli
from rlbus.configs.migrate import RL_RULES, SFT_RULES, migrate
from rlbus_launch.migrate_config import guess_kind, main

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "prime_rl"


@pytest.fixture(autouse=True)
def any_env_id(monkeypatch):
    """The fixtures name prime-rl's envs (wordle, math-env, ...), which are not installed here:
    the id check is skipped as on an image without the orchestrator (it is not what is tested)."""
    monkeypatch.setattr(orchestrator_config, "known_env_ids", lambda: [])
    monkeypatch.setattr(orchestrator_config, "resolves_in_rlbus_venv", lambda env_id, known: False)


def load(cls, name: str):
    return parse_cli(cls, ["@", str(FIXTURES / name)])


def load_error(cls, name: str, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        load(cls, name)
    assert exit_info.value.code == 2
    return " ".join(capsys.readouterr().err.replace("│", " ").split())


def migrate_fixture(name: str, capsys, tmp_path) -> tuple[int, dict, str]:
    """(exit code, the written config, the report) of `rl migrate-config <fixture> -o OUT`."""
    out = tmp_path / "out.toml"
    code = main([str(FIXTURES / name), "-o", str(out)])
    report = capsys.readouterr().err
    return code, tomli.loads(out.read_text()), report


def test_reverse_text_rl_loads_unchanged_with_one_line_per_renamed_key(capsys):
    config = load(RLConfig, "reverse-text-rl.toml")

    assert config.orchestrator.sampling.max_tokens == 96
    assert config.orchestrator.sampling.temperature == 0.9
    assert [env.id for env in config.orchestrator.env] == ["reverse-text"]
    assert config.orchestrator.env[0].args == {}
    assert config.trainer.optim.lr == 2e-6
    assert config.monitors.wandb.name == "reverse-run"
    assert config.max_steps == config.trainer.max_steps == 40
    assert config.ckpt is not None
    err = capsys.readouterr().err
    assert "prime-rl key orchestrator.train.sampling.max_completion_tokens -> orchestrator.sampling.max_tokens" in err  # fmt: skip
    assert "prime-rl key orchestrator.renderer ignored" in err
    assert len(err.strip().splitlines()) == 4


def test_wordle_rl_loads_with_inference_gpus_as_replicas():
    config = load(RLConfig, "wordle-rl.toml")

    assert config.deployment.num_infer_replicas == 4
    assert config.deployment.num_train_gpus == config.orchestrator.num_train_ranks == 2
    assert "data_parallel_size" not in (config.inference.vllm.model_extra or {})
    assert config.orchestrator.env[0].id == "wordle"
    assert config.orchestrator.sampling.max_tokens == 768
    assert config.inference.vllm.max_model_len == 4096


def test_lora_rl_loads_with_the_adapter_under_trainer_lora():
    config = load(RLConfig, "alphabet-sort-lora-rl.toml")

    lora = config.trainer.lora
    assert (lora.rank, lora.alpha, lora.dropout) == (16, 32.0, 0.05)
    assert lora.target_modules == ["q_proj", "v_proj"] and lora.name == "sort-adapter"
    assert config.trainer.model.impl == "transformers"
    assert config.trainer.model.activation_checkpointing is True
    assert (config.trainer.loss.mask_low, config.trainer.loss.mask_high) == (0.1, 0.3)
    env = config.orchestrator.env[0]
    # not installed here: a verifiers 0.4 environment, its taskset keys under args.env.taskset
    assert (env.id, env.weight, env.args) == ("alphabet-sort", 2.0, {"env": {"taskset": {"min_turns": 2, "max_turns": 4}}})  # fmt: skip
    assert config.orchestrator.max_concurrency == 64
    assert config.ckpt.keep_last == 3


def test_eval_sources_load_as_eval_environments():
    config = load(RLConfig, "math-eval-rl.toml")

    [aime] = config.orchestrator.eval.env
    assert (aime.id, aime.label, aime.rollouts_per_example) == ("aime24", "aime", 16)
    assert config.orchestrator.eval.interval == 40


def test_multi_node_rl_names_each_key_without_an_equivalent(capsys):
    error = load_error(RLConfig, "multinode-slurm-rl.toml", capsys)

    assert "1 invalid value for RLConfig" in error
    assert "--trainer.model.ep: prime-rl key, in rlbus: no equivalent: the rlbus trainer is data-parallel only" in error  # fmt: skip


def test_reverse_text_sft_reads_its_dataset_by_name_and_its_eval():
    config = parse_cli(SFTConfig, ["@", str(FIXTURES / "reverse-text-sft.toml")])

    assert config.data.name == "someone/reverse-paragraphs" and config.seq_len == 2048
    assert [env.id for env in config.eval.env] == ["reverse-text"]  # [eval] source -> eval.env


def test_migrate_config_converts_reverse_text_rl_and_exits_0(capsys, tmp_path):
    code, out, report = migrate_fixture("reverse-text-rl.toml", capsys, tmp_path)

    assert code == 0
    assert out["orchestrator"]["env"] == [{"id": "reverse-text"}]
    assert out["orchestrator"]["sampling"] == {"max_tokens": 96, "temperature": 0.9}
    assert "train" not in out["orchestrator"] and "renderer" not in out["orchestrator"]
    assert "move     orchestrator.train.sampling.temperature -> orchestrator.sampling.temperature" in report  # fmt: skip
    assert "drop     orchestrator.renderer ignored" in report
    assert RLConfig.model_validate(out).orchestrator.batch_size == 64


def test_migrate_config_lists_what_needs_a_human_and_exits_2(capsys, tmp_path):
    code, out, report = migrate_fixture("multinode-slurm-rl.toml", capsys, tmp_path)

    assert code == 2
    assert "human    trainer.model.ep needs a human: no equivalent" in report
    assert out["slurm"]["nodes"] == 3 and out["slurm"]["inference_nodes"] == 1
    assert out["slurm"]["setup"] == ["source .venv/bin/activate"]
    assert out["weight_broadcast"] == {"type": "nccl", "timeout_s": 900}
    assert out["trainer"]["metrics"] == {"port": 9100}
    assert out["trainer"]["model"] == {"impl": "rlbus", "activation_checkpointing": True}
    config = RLConfig.model_validate(out)  # the output leaves the human keys out, so it loads
    assert config.slurm.nodes == 3 and config.trainer.model.activation_checkpointing


@pytest.mark.parametrize(
    ("name", "code", "changed"),
    [
        ("reverse-text-rl.toml", 0, ["orchestrator.train.source", "orchestrator.renderer"]),
        ("wordle-rl.toml", 0, ["inference.vllm.data_parallel_size"]),
        ("alphabet-sort-lora-rl.toml", 0, ["trainer.model.lora", "orchestrator.model.lora.name"]),
        ("math-eval-rl.toml", 0, ["orchestrator.eval.source", "trainer.scheduler.min_lr"]),
        ("multinode-slurm-rl.toml", 2, ["deployment.num_train_nodes", "trainer.model.compile"]),
        ("reverse-text-sft.toml", 0, ["data.seq_len", "eval.source", "inference"]),
    ],
)
def test_migrate_config_output_is_an_rlbus_config(name, code, changed, capsys, tmp_path):
    got, out, report = migrate_fixture(name, capsys, tmp_path)

    assert got == code
    cls = SFTConfig if guess_kind(tomli.loads((FIXTURES / name).read_text())) == "sft" else RLConfig
    cls.model_validate(out)
    for key in changed:
        assert f" {key} " in report, key


def test_migrated_values_are_right_for_math_and_sft(capsys, tmp_path):
    _, math, _ = migrate_fixture("math-eval-rl.toml", capsys, tmp_path)
    assert math["trainer"]["seq_len"] == 8192
    assert math["trainer"]["scheduler"]["min_lr_ratio"] == pytest.approx(0.1)
    assert math["deployment"] == {"num_train_gpus": 2, "num_infer_gpus": 2}
    assert math["orchestrator"]["eval"] == {
        "interval": 40,
        "env": [{"id": "aime24", "name": "aime", "rollouts_per_example": 16}],
    }
    assert math["orchestrator"]["env"][0]["args"] == {
        "env": {"taskset": {"dataset_name": "openai/gsm8k", "dataset_subset": "main"}}
    }

    _, sft, _ = migrate_fixture("reverse-text-sft.toml", capsys, tmp_path)
    assert sft["seq_len"] == 2048 and sft["num_processes"] == 2
    assert sft["data"] == {"name": "someone/reverse-paragraphs", "batch_size": 16}
    assert sft["optim"] == {"lr": 1e-5}
    assert "inference" not in sft and "deployment" not in sft
    assert sft["eval"] == {
        "interval": 20,
        "num_examples": 16,
        "sampling": {"max_tokens": 512},
        "env": [{"id": "reverse-text", "name": "reverse"}],
    }


def test_rlbus_spelling_wins_over_the_prime_rl_one():
    data = {
        "orchestrator": {
            "sampling": {"max_tokens": 50},
            "train": {"sampling": {"max_completion_tokens": 99}},
        }
    }
    migrated, changes = migrate(data, "rl")

    assert migrated == {"orchestrator": {"sampling": {"max_tokens": 50}}}
    assert [c.prime for c in changes] == ["orchestrator.train.sampling.max_completion_tokens"]


def test_prime_rl_defaults_of_unmappable_keys_are_dropped_not_refused():
    migrated, changes = migrate({"trainer": {"model": {"cp": 1, "ep": "auto"}}}, "rl")

    assert migrated == {} and {c.status for c in changes} == {"drop"}


def test_every_rule_names_its_rlbus_key_or_why_not():
    for rule in [*RL_RULES, *SFT_RULES]:
        assert rule.rlbus or rule.note, rule.prime
        if rule.status in ("move", "convert"):
            assert rule.rlbus, rule.prime


def test_rules_leave_rlbus_keys_alone():
    """A rule on a key rlbus also has would change rlbus configs: only `trainer.model.impl`
    (whose prime-rl values hf/custom are converted, rlbus values kept) and vLLM's pass-through
    data_parallel_size (rlbus scales inference by replicas) may be both, and `orchestrator.env`
    and `orchestrator.eval.env` / sft's `eval.env` (prime-rl's entries lose the id's `owner/`, `name` is dropped from
    training entries; rlbus entries are kept)."""
    both = {
        "trainer.model.impl",
        "inference.vllm.data_parallel_size",
        "model.impl",
        "orchestrator.env",
        "orchestrator.eval.env",
        "eval.env",
    }
    for cls, rules in ((RLConfig, RL_RULES), (SFTConfig, SFT_RULES)):
        known = {path.replace("-", "_") for path in known_flag_paths(cls)}
        for rule in rules:
            assert rule.prime in both or rule.prime not in known, rule.prime


def test_docs_table_names_every_rule():
    text = (Path(__file__).resolve().parents[3] / "docs" / "migration.md").read_text()
    for rule in RL_RULES:
        assert f"`{rule.prime}`" in text, rule.prime
    for rule in SFT_RULES:  # the trainer rows of the rl table apply at the top of sft
        assert f"`{rule.prime}`" in text or f"`trainer.{rule.prime}`" in text, rule.prime
