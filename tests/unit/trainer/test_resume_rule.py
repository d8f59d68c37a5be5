"""rlbus.rundirs.trainer_start: a trainer started again continues from its newest complete
checkpoint even with `resume` unset, and never silently from step 1 once the bus has trained."""

import pytest

from rlbus.rundirs import (
    CHECKPOINT_COMPLETE,
    RunDirError,
    checkpoint_dir,
    never_reread_through,
    trainer_start,
)


def make_checkpoints(run_dir, steps, incomplete=()):
    for step in (*steps, *incomplete):
        checkpoint_dir(run_dir, step).mkdir(parents=True)
    for step in steps:
        (checkpoint_dir(run_dir, step) / CHECKPOINT_COMPLETE).write_text(str(step))


def test_a_fresh_run_starts_from_the_model(tmp_path):
    start = trainer_start(tmp_path, None, bus_version=0)
    assert (start.from_step, start.why) == (0, "fresh_run")


def test_resume_unset_still_continues_from_the_newest_complete_checkpoint(tmp_path):
    make_checkpoints(tmp_path, [2, 4], incomplete=[6])
    for bus_version in (0, 3, 5, 9):
        start = trainer_start(tmp_path, None, bus_version=bus_version)
        assert (start.from_step, start.why) == (4, "latest_checkpoint")


def test_an_explicit_step_is_kept_and_must_be_complete(tmp_path):
    make_checkpoints(tmp_path, [2, 4], incomplete=[6])
    assert trainer_start(tmp_path, 2, bus_version=5).from_step == 2
    with pytest.raises(RunDirError, match="--resume.step 6"):
        trainer_start(tmp_path, 6, bus_version=5)


def test_bus_progress_without_a_checkpoint_is_refused_with_the_fix(tmp_path):
    make_checkpoints(tmp_path, [], incomplete=[3])
    with pytest.raises(RunDirError) as error:
        trainer_start(tmp_path, None, bus_version=7)
    message = str(error.value)
    assert "\n" not in message
    assert "weights version 7" in message
    assert str(tmp_path / "checkpoints") in message
    assert "[ckpt]" in message and "--run.name" in message and "--clean" in message


def test_batches_are_reread_after_the_oldest_checkpoint_or_never_without_checkpoints(tmp_path):
    assert never_reread_through(tmp_path, 7, checkpointing=True) == 0
    make_checkpoints(tmp_path, [4, 6], incomplete=[2])
    assert never_reread_through(tmp_path, 7, checkpointing=True) == 4
    assert never_reread_through(tmp_path, 7, checkpointing=False) == 7
