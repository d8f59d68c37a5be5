"""Run-directory rules (rlbus.rundirs), one test per rule of docs/run-directories.md."""

import os
import re

import pytest

from rlbus.rundirs import (
    CHECKPOINT_COMPLETE,
    RunDirError,
    checkpoint_dir,
    prepare_run_dir,
    resolve_run_dir,
    rl_run_name,
    sft_run_name,
)


def make_run(output_dir, name="run", **kwargs):
    return prepare_run_dir(output_dir, name, **kwargs)


def make_checkpoint(run_dir, step, *, complete=True):
    path = checkpoint_dir(run_dir, step)
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"x")
    if complete:
        (path / CHECKPOINT_COMPLETE).write_text("")


def test_rl_run_name_is_envs_model_short_id_and_fresh_per_launch():
    first = rl_run_name(["reverse-text", "gsm8k"], "Qwen/Qwen3-0.6B")
    second = rl_run_name(["reverse-text", "gsm8k"], "Qwen/Qwen3-0.6B")

    assert re.fullmatch(r"reverse-text\+gsm8k--qwen3-0\.6b--[0-9a-f]{6}", first)
    assert first != second


def test_sft_run_name_is_dataset_model_short_id():
    name = sft_run_name("data/My Train.jsonl", "outputs/models/tiny-qwen3/")

    assert re.fullmatch(r"my-train--tiny-qwen3--[0-9a-f]{6}", name)


def test_run_dir_is_output_dir_slash_run_dir_or_run_name(tmp_path):
    assert resolve_run_dir(tmp_path, "name") == tmp_path / "name"
    assert resolve_run_dir(tmp_path, "name", "leaf") == tmp_path / "leaf"

    plan = make_run(tmp_path, "name", run_dir="leaf")

    assert plan.run_dir == tmp_path / "leaf" and (tmp_path / "leaf" / "logs").is_dir()
    assert not (tmp_path / "name").exists()


def test_launch_into_directory_with_artifacts_fails_naming_both_remedies(tmp_path):
    run = make_run(tmp_path).run_dir
    (run / "metrics.jsonl").write_text("{}\n")

    with pytest.raises(RunDirError) as error:
        make_run(tmp_path)

    assert "--resume" in str(error.value) and "--clean" in str(error.value)


def test_existing_empty_directory_is_not_an_artifact(tmp_path):
    (tmp_path / "run").mkdir()

    assert make_run(tmp_path).run_dir == tmp_path / "run"


def test_clean_wipes_only_that_run_directory(tmp_path):
    outside = tmp_path / "keep.txt"
    outside.write_text("mine")
    output = tmp_path / "outputs"
    run = make_run(output, "a").run_dir
    sibling = make_run(output, "b").run_dir
    (run / "old.txt").write_text("old")
    (sibling / "other.txt").write_text("other")

    plan = make_run(output, "a", clean=True)

    assert plan.run_dir == run and not (run / "old.txt").exists() and (run / "logs").is_dir()
    assert (sibling / "other.txt").read_text() == "other"
    assert outside.read_text() == "mine"


def test_resume_reuses_the_named_directory_and_keeps_its_artifacts(tmp_path):
    run = make_run(tmp_path).run_dir
    (run / "metrics.jsonl").write_text("{}\n")

    plan = make_run(tmp_path, resume=True)

    assert plan.run_dir == run and plan.resuming
    assert (run / "metrics.jsonl").read_text() == "{}\n"


def test_resume_loads_latest_checkpoint_or_the_given_step(tmp_path):
    run = make_run(tmp_path).run_dir
    for step in (5, 10, 15):
        make_checkpoint(run, step)

    assert make_run(tmp_path, resume=True).resume_step == 15
    assert make_run(tmp_path, resume=True, resume_step=10).resume_step == 10
    with pytest.raises(RunDirError, match="complete steps: 5, 10, 15"):
        make_run(tmp_path, resume=True, resume_step=7)


def test_resume_ignores_a_checkpoint_whose_save_was_killed_midway(tmp_path):
    run = make_run(tmp_path).run_dir
    make_checkpoint(run, 5)
    make_checkpoint(run, 10, complete=False)  # no COMPLETE marker: a save killed midway

    assert make_run(tmp_path, resume=True).resume_step == 5
    with pytest.raises(RunDirError, match=r"complete steps: 5\)"):
        make_run(tmp_path, resume=True, resume_step=10)


def test_resume_without_ckpt_loads_but_saves_no_new_checkpoints(tmp_path):
    make_checkpoint(make_run(tmp_path).run_dir, 3)

    without_ckpt = make_run(tmp_path, resume=True, ckpt_enabled=False)
    with_ckpt = make_run(tmp_path, resume=True, ckpt_enabled=True)

    assert without_ckpt.resume_step == 3 and without_ckpt.save_checkpoints is False
    assert with_ckpt.resume_step == 3 and with_ckpt.save_checkpoints is True


def test_resume_needs_an_explicit_name_and_an_existing_directory(tmp_path):
    with pytest.raises(RunDirError, match="--run.name"):
        make_run(tmp_path, "generated--name--abc123", resume=True, name_was_given=False)
    with pytest.raises(RunDirError, match="no run directory"):
        make_run(tmp_path, "never-ran", resume=True)


def test_resume_and_clean_together_are_refused(tmp_path):
    make_run(tmp_path)

    with pytest.raises(RunDirError, match="exclude each other"):
        make_run(tmp_path, resume=True, clean=True)


@pytest.mark.parametrize("name", ["..", "../escaped", "a/../../escaped", "/tmp/absolute"])
def test_run_names_that_leave_output_dir_are_refused(tmp_path, name):
    output = tmp_path / "outputs"
    output.mkdir()

    with pytest.raises(RunDirError, match="not inside output_dir"):
        make_run(output, name, clean=True)
    assert tmp_path.exists() and output.exists()


def test_clean_refuses_a_run_directory_that_contains_the_working_directory(tmp_path, monkeypatch):
    run = make_run(tmp_path).run_dir
    (run / "file").write_text("x")
    monkeypatch.chdir(run / "logs")

    with pytest.raises(RunDirError, match="refuses to wipe .* it contains"):
        make_run(tmp_path, clean=True)
    assert (run / "file").exists()


def test_clean_refuses_a_symlinked_run_directory(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "precious").write_text("x")
    output = tmp_path / "outputs"
    output.mkdir()
    os.symlink(target, output / "run")

    with pytest.raises(RunDirError, match="it is a symlink"):
        make_run(output, clean=True)
    assert (target / "precious").exists()


def test_clean_refuses_when_output_dir_is_home_or_root(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "Documents").mkdir(parents=True)
    (home / "Documents" / "thesis.tex").write_text("x")
    monkeypatch.setenv("HOME", str(home))

    with pytest.raises(RunDirError, match="home directory"):
        make_run(home, "Documents", clean=True)
    assert (home / "Documents" / "thesis.tex").exists()
