"""`rl export` refuses, in one line and exit 2, what it cannot export (the export itself is run
in tests/e2e/test_export.py and test_rl_run.py)."""

import pytest
from cli_helpers import run_command


def export_error(tmp_path, *args) -> str:
    result = run_command("rl", "export", *args, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture
def run_dir(tmp_path):
    """A run directory with its trainer config and a complete checkpoint of step 4 only."""
    run = tmp_path / "outputs" / "r"
    (run / "configs").mkdir(parents=True)
    (run / "configs" / "trainer.toml").write_text("max_steps = 4\n")
    (run / "checkpoints" / "step_4" / "trainer").mkdir(parents=True)
    (run / "checkpoints" / "step_4" / "trainer" / "COMPLETE").write_text("")
    (run / "checkpoints" / "step_6" / "trainer").mkdir(parents=True)  # killed midway: no marker
    return run


def test_a_directory_that_is_no_run_is_named(tmp_path):
    line = export_error(tmp_path, "outputs/nothing")
    assert "outputs/nothing is not a run directory" in line


def test_a_step_without_a_complete_checkpoint_lists_the_complete_ones(tmp_path, run_dir):
    line = export_error(tmp_path, str(run_dir), "--step", "6")
    assert "--step 6" in line and "(complete: 4)" in line


def test_a_run_without_checkpoints_says_how_to_keep_them(tmp_path, run_dir):
    for step in ("step_4", "step_6"):
        (run_dir / "checkpoints" / step / "trainer" / "COMPLETE").unlink(missing_ok=True)
    line = export_error(tmp_path, str(run_dir))
    assert "has no complete checkpoint" in line and "ckpt.interval" in line
