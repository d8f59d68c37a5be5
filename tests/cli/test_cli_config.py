"""The config system through the real command line: one test per bullet of the seed's
"Config system at a glance" (docs/configuration.md)."""

import json
import os
import time

from cli_helpers import error_text, resolved_config, run_command, write


def test_config_files_deep_merge_left_to_right_under_cli_flags(tmp_path):
    write(
        tmp_path / "a.toml",
        "max_steps = 10\nseq_len = 512\n[orchestrator]\nbatch_size = 64\ngroup_size = 4\n",
    )
    write(tmp_path / "b.yaml", "max_steps: 20\norchestrator:\n  group_size: 16\n")
    write(tmp_path / "c.json", json.dumps({"orchestrator": {"async_level": 3}}))

    config = resolved_config(
        "rl", "@", "a.toml", "@", "b.yaml", "@", "c.json", "--max-steps", "30", cwd=tmp_path
    )

    assert config["max_steps"] == 30  # CLI beats both files
    assert config["seq_len"] == 512  # only in a.toml
    orchestrator = config["orchestrator"]
    assert orchestrator["batch_size"] == 64  # a.toml, kept by the deep merge
    assert orchestrator["group_size"] == 16  # b.yaml beats a.toml
    assert orchestrator["async_level"] == 3  # c.json
    assert orchestrator["max_off_policy_steps"] == 8  # class default


def test_dotted_kebab_case_flags_set_snake_case_fields(tmp_path):
    write(
        tmp_path / "rl.toml",
        "[orchestrator]\nmax_off_policy_steps = 1\n[trainer.optim]\nweight_decay = 0.1\n",
    )

    config = resolved_config(
        "rl", "@", "rl.toml", "--orchestrator.max-off-policy-steps", "3",
        "--trainer.model.activation-checkpointing", "--inference.server.port", "9000",
        cwd=tmp_path,
    )  # fmt: skip

    assert config["orchestrator"]["max_off_policy_steps"] == 3
    assert config["trainer"]["optim"]["weight_decay"] == 0.1
    assert config["trainer"]["model"]["activation_checkpointing"] is True
    assert config["inference"]["server"]["port"] == 9000


def test_bool_flags_toggle_and_negate_nested(tmp_path):
    write(
        tmp_path / "rl.toml",
        "[inference.vllm]\nenforce_eager = false\n[orchestrator]\nfilter_zero_advantage = true\n",
    )

    config = resolved_config(
        "rl", "@", "rl.toml", "--inference.vllm.enforce-eager", "--no-orchestrator.filter-zero-advantage",
        "--no-trainer.model.optim-cpu-offload", cwd=tmp_path,
    )  # fmt: skip

    assert config["inference"]["vllm"]["enforce_eager"] is True
    assert config["orchestrator"]["filter_zero_advantage"] is False
    assert config["trainer"]["model"]["optim_cpu_offload"] is False


def test_lists_take_space_separated_values_or_json(tmp_path):
    spaced = resolved_config(
        "sft", "--data.loss-roles", "assistant", "user", "--max-steps", "3", cwd=tmp_path
    )
    as_json = resolved_config("sft", "--data.loss-roles", '["system", "tool"]', cwd=tmp_path)

    assert spaced["data"]["loss_roles"] == ["assistant", "user"]
    assert spaced["max_steps"] == 3
    assert as_json["data"]["loss_roles"] == ["system", "tool"]


def test_json_dict_flag_deep_merges_with_file_values(tmp_path):
    write(tmp_path / "orch.toml", "[sampling.extra_body]\nmin_p = 0.1\nkwargs = {a = 1, b = 2}\n")

    config = resolved_config(
        "orchestrator",
        "@",
        "orch.toml",
        "--sampling.extra-body",
        '{"top_k": 5, "kwargs": {"b": 3}}',
        cwd=tmp_path,
    )

    assert config["sampling"]["extra_body"] == {
        "min_p": 0.1,
        "top_k": 5,
        "kwargs": {"a": 1, "b": 3},
    }


def test_optional_subconfig_enables_from_bare_flag_or_file_and_disables(tmp_path):
    write(tmp_path / "wandb.toml", 'project = "from-file"\noffline = true\n')
    write(tmp_path / "with_wandb.toml", '[monitors.wandb]\nproject = "p"\n')

    assert resolved_config("rl", cwd=tmp_path)["monitors"]["wandb"] == "None"  # off by default
    bare = resolved_config("rl", "--monitors.wandb", cwd=tmp_path)["monitors"]["wandb"]
    from_file = resolved_config("rl", "--monitors.wandb", "@", "wandb.toml", cwd=tmp_path)[
        "monitors"
    ]["wandb"]
    disabled = resolved_config("rl", "@", "with_wandb.toml", "--no-monitors.wandb", cwd=tmp_path)[
        "monitors"
    ]

    assert bare["project"] == "rlbus" and bare["offline"] is False
    assert from_file["project"] == "from-file" and from_file["offline"] is True
    assert disabled["wandb"] == "None"


def test_discriminated_union_switches_by_type_tag(tmp_path):
    trainer = resolved_config("trainer", "--optim.type", "muon", "--optim.lr", "0.05", cwd=tmp_path)
    rl = resolved_config(
        "rl", "--trainer.optim.type", "sgd", "--trainer.optim.momentum", "0.9",
        "--trainer.scheduler.type", "cosine", cwd=tmp_path,
    )  # fmt: skip

    assert trainer["optim"]["type"] == "muon" and trainer["optim"]["lr"] == 0.05
    assert "adamw_lr" in trainer["optim"]  # a Muon field, absent from AdamW
    assert rl["trainer"]["optim"] == {
        "type": "sgd",
        "lr": 1e-3,
        "momentum": 0.9,
        "weight_decay": 0.0,
        "max_norm": 1.0,
    }
    assert rl["trainer"]["scheduler"]["type"] == "cosine"


def test_renamed_field_alias_and_legacy_key_remap_still_work(tmp_path):
    write(tmp_path / "old.toml", '[ckpt]\nkeep = 4\n[wandb]\nproject = "legacy"\n')

    from_file = resolved_config("rl", "@", "old.toml", cwd=tmp_path)
    from_flags = resolved_config(
        "rl", "--ckpt.keep", "3", "--wandb.project", "legacy-flag", cwd=tmp_path
    )

    assert from_file["ckpt"]["keep_last"] == 4  # alias `keep` of ckpt.keep_last
    assert (
        from_file["monitors"]["wandb"]["project"] == "legacy"
    )  # [wandb] moved to [monitors.wandb]
    assert "monitors" not in from_file["trainer"]  # only the monitor process reads them
    assert from_flags["ckpt"]["keep_last"] == 3
    assert from_flags["monitors"]["wandb"]["project"] == "legacy-flag"


def test_help_panels_come_from_field_docstrings_without_importing_torch(tmp_path):
    started = time.monotonic()
    result = run_command("rl", "--help", cwd=tmp_path, env={"PYTHONPROFILEIMPORTTIME": "1"})
    elapsed = time.monotonic() - started

    assert result.returncode == 0
    assert "Wipe this run's directory" in result.stdout  # RLConfig.clean's docstring
    assert "trainer.optim variant: MuonConfig" in result.stdout
    imported = {
        line.split("|")[-1].strip().split(".")[0]
        for line in result.stderr.splitlines()
        if "|" in line
    }
    assert not imported & {"torch", "vllm", "transformers"}
    # Not a benchmark: a loose bound that only an import of torch/vllm would break.
    assert elapsed < 10, f"rl --help took {elapsed:.1f}s"


def test_every_command_answers_help_without_heavy_imports(tmp_path):
    for command in ("sft", "trainer", "orchestrator", "inference"):
        result = run_command(command, "--help", cwd=tmp_path, env={"PYTHONPROFILEIMPORTTIME": "1"})
        assert result.returncode == 0, (command, result.stderr[-2000:])
        assert result.stdout.startswith(f"usage: {command}")
        imported = {
            line.split("|")[-1].strip().split(".")[0]
            for line in result.stderr.splitlines()
            if "|" in line
        }
        assert not imported & {"torch", "vllm"}, command


def test_missing_required_field_is_shown_in_a_box(tmp_path):
    result = run_command("trainer", "--loss.type", "custom", cwd=tmp_path)

    assert result.returncode == 2
    assert result.stderr.lstrip().startswith("╭")
    assert "--loss.import-path: required field is missing" in error_text(result)
    assert "Traceback" not in result.stderr


def test_validator_error_names_the_offending_flag(tmp_path):
    field_error = run_command("rl", "--orchestrator.batch-size", "0", cwd=tmp_path)
    model_error = run_command("trainer", "--optim.type", "muon", "--optim.lr", "-1", cwd=tmp_path)

    assert field_error.returncode == 2 and model_error.returncode == 2
    assert (
        "--orchestrator.batch-size: Input should be greater than or equal to 1 (got '0')"
        in error_text(field_error)
    )
    assert "--optim.lr: Input should be greater than 0" in error_text(
        model_error
    )  # no `muon` segment
    assert "Traceback" not in field_error.stderr + model_error.stderr


def test_unknown_flag_gets_did_you_mean_hint(tmp_path):
    nested = run_command("rl", "--trainer.max-step", "5", cwd=tmp_path)
    in_union = run_command(
        "trainer", "--optim.type", "muon", "--optim.adamw-lrr", "1e-3", cwd=tmp_path
    )
    in_optional = run_command("rl", "--monitors.wandbb", cwd=tmp_path)

    assert nested.returncode == in_union.returncode == in_optional.returncode == 2
    assert "did you mean --trainer.max-steps?" in error_text(nested)
    assert "did you mean --optim.adamw-lr?" in error_text(in_union)
    assert "did you mean --monitors.wandb?" in error_text(in_optional)
    assert "Traceback" not in nested.stderr + in_union.stderr + in_optional.stderr


def test_unknown_vllm_options_pass_through_but_other_typos_do_not(tmp_path):
    inference = resolved_config(
        "inference",
        "--vllm.enforce-eager",
        "--vllm.some-option",
        "3",
        "--vllm.kv-cache-dtype",
        "fp8",
        cwd=tmp_path,
    )
    rl = resolved_config(
        "rl", "--inference.vllm.enforce-eager", "--inference.vllm.some-option", "3", cwd=tmp_path
    )
    typo = run_command("inference", "--server.prot", "1", cwd=tmp_path)

    assert inference["vllm"]["enforce_eager"] is True
    assert inference["vllm"]["some_option"] == "3"
    assert inference["vllm"]["kv_cache_dtype"] == "fp8"
    assert (
        rl["inference"]["vllm"]["enforce_eager"] is True
        and rl["inference"]["vllm"]["some_option"] == "3"
    )
    assert typo.returncode == 2 and "did you mean --server.port?" in error_text(typo)


def test_optim_cpu_offload_is_on_by_default(tmp_path):
    model = resolved_config("trainer", cwd=tmp_path)["model"]

    assert model["optim_cpu_offload"] is True and model["full_offload"] is False


def test_full_offload_rules(tmp_path):
    write(tmp_path / "offload.toml", 'backend = "torch"\nnuma_binding = false\n')
    enabled = resolved_config(
        "rl", "--no-trainer.model.optim-cpu-offload", "--trainer.model.full-offload", cwd=tmp_path
    )["trainer"]
    table = resolved_config(
        "trainer", "--no-model.optim-cpu-offload", "--model.full-offload", "@", "offload.toml",
        "--optim.type", "sign_sgd", cwd=tmp_path,
    )  # fmt: skip
    with_state_offload = run_command("trainer", "--model.full-offload", cwd=tmp_path)
    with_muon = run_command(
        "trainer",
        "--no-model.optim-cpu-offload",
        "--model.full-offload",
        "--optim.type",
        "muon",
        cwd=tmp_path,
    )
    with_clipping = run_command(
        "trainer",
        "--no-model.optim-cpu-offload",
        "--model.full-offload",
        "--optim.max-norm",
        "1.0",
        cwd=tmp_path,
    )

    assert enabled["model"]["full_offload"] is True
    assert enabled["optim"]["max_norm"] == "None"  # gradient clipping disabled
    assert table["model"]["full_offload"] == {"backend": "torch", "numa_binding": False}
    assert "mutually exclusive" in error_text(with_state_offload)
    assert "adamw or sign_sgd" in error_text(with_muon)
    assert "disables gradient clipping" in error_text(with_clipping)
    assert {with_state_offload.returncode, with_muon.returncode, with_clipping.returncode} == {2}


def test_config_errors_never_print_a_traceback_for_bad_json_or_files(tmp_path):
    bad_json = run_command("orchestrator", "--sampling.extra-body", "{not json", cwd=tmp_path)
    missing_file = run_command("rl", "@", "nope.toml", cwd=tmp_path)

    assert bad_json.returncode == missing_file.returncode == 2
    assert "JSON" in error_text(bad_json)
    assert "nope.toml" in error_text(missing_file)
    assert "Traceback" not in bad_json.stderr + missing_file.stderr
    assert os.listdir(tmp_path) == []  # nothing written on a config error


def test_file_for_a_kebab_case_sub_tree(tmp_path):
    write(tmp_path / "wb.toml", 'type = "nccl"\ntimeout_s = 60\n')

    config = resolved_config("rl", "--trainer.weight-broadcast", "@", "wb.toml", cwd=tmp_path)

    assert config["trainer"]["weight_broadcast"]["type"] == "nccl"
    assert config["trainer"]["weight_broadcast"]["timeout_s"] == 60
    assert config["weight_broadcast"]["type"] == "filesystem"  # only the trainer's was set


def test_resume_is_a_bare_flag_or_takes_a_step(tmp_path):
    assert resolved_config("rl", cwd=tmp_path)["resume"] == "None"
    assert resolved_config("rl", "--resume", cwd=tmp_path)["resume"] == {"step": "None"}
    stepped = resolved_config("rl", "--resume.step", "40", cwd=tmp_path)

    assert stepped["resume"] == {"step": 40} and stepped["trainer"]["resume"] == {"step": 40}


def test_root_file_after_a_plain_flag_is_still_a_root_file(tmp_path):
    write(tmp_path / "a.toml", "max_steps = 11\nseq_len = 256\n")
    write(tmp_path / "b.toml", "max_steps = 12\n")

    config = resolved_config(
        "rl", "--clean", "@", "a.toml", "--seq-len", "128", "@", "b.toml", cwd=tmp_path
    )

    assert (
        config["clean"] is True and config["seq_len"] == 128
    )  # flags beat files wherever they stand
    assert config["max_steps"] == 12  # files still merge left to right


def test_wandb_monitor_without_the_wandb_package_is_a_config_error(tmp_path):
    # The dev tree has wandb (its tests run it offline): hide it as if it were not installed.
    hide = tmp_path / "hide-wandb"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None\n")
    env = {"PYTHONPATH": str(hide)}
    for command in ("rl", "sft"):
        result = run_command(command, "--monitors.wandb", "--dry-run", cwd=tmp_path, env=env)

        assert result.returncode == 2, result.stderr
        assert "wandb is not installed" in error_text(result)
        assert "--monitors.wandb" in error_text(result) and "Traceback" not in result.stderr
        assert not (tmp_path / "outputs").exists()  # refused before anything was written
