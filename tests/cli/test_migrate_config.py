"""`rl migrate-config` and `rl @ <prime-rl config>` as a user runs them (docs/migration.md)."""

import tomli
from cli_helpers import REPO, error_text, resolved_config, run_command

FIXTURES = REPO / "tests" / "fixtures" / "prime_rl"


def test_rl_migrate_config_writes_a_config_that_rl_dry_run_takes(tmp_path):
    out = tmp_path / "rl.toml"
    result = run_command(
        "rl", "migrate-config", str(FIXTURES / "reverse-text-rl.toml"), "-o", str(out), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "orchestrator.train.source -> orchestrator.env" in result.stderr
    assert tomli.loads(out.read_text())["orchestrator"]["env"] == [{"id": "reverse-text"}]

    dry = run_command(
        "rl",
        "@",
        str(out),
        "--dry-run",
        "--run.name",
        "m",
        "--monitors.wandb.offline",
        cwd=tmp_path,
    )
    assert dry.returncode == 0, dry.stderr
    assert (tmp_path / "outputs" / "m" / "scripts" / "launch.sh").exists()


def test_rl_migrate_config_exits_2_listing_keys_for_a_human(tmp_path):
    result = run_command(
        "rl", "migrate-config", str(FIXTURES / "multinode-slurm-rl.toml"), cwd=tmp_path
    )
    assert result.returncode == 2
    assert "human    trainer.model.ep needs a human: no equivalent" in result.stderr
    assert "convert  deployment.num_train_nodes -> slurm.nodes" in result.stderr
    assert tomli.loads(result.stdout)["slurm"]["nodes"] == 3  # the rest is converted anyway


def test_rl_loads_a_prime_rl_config_unchanged(tmp_path):
    config = resolved_config("rl", "@", str(FIXTURES / "reverse-text-rl.toml"), cwd=tmp_path)
    assert config["orchestrator"]["sampling"]["max_tokens"] == 96
    assert config["orchestrator"]["env"][0]["id"] == "reverse-text"


def test_sft_names_the_prime_rl_key_it_cannot_read(tmp_path):
    config = tmp_path / "sft.toml"
    config.write_text(
        (FIXTURES / "reverse-text-sft.toml").read_text() + '\n[tokenizer]\nname = "t"\n'
    )
    result = run_command("sft", "@", str(config), cwd=tmp_path)
    assert result.returncode == 2
    assert "--tokenizer: prime-rl key, in rlbus: no equivalent" in error_text(result)
    assert "Traceback" not in result.stderr
