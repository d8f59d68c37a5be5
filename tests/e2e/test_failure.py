"""With supervision off, a service that dies takes the run down cleanly: named, its log shown, the
rest stopped, exit != 0 (restarts: tests/e2e/test_supervision.py)."""

import shutil

import pytest
from e2e_support import RlLaunch, alive_groups

pytestmark = pytest.mark.slow


def test_a_dying_trainer_is_named_with_its_log_and_every_other_process_stops(
    tmp_path, starting_model
):
    # A model directory that passes the launch-time check (it has config.json) but holds no
    # weights: the trainer dies only once it loads them (exit 4). A missing directory would be
    # refused before anything starts (tests/cli/test_bad_inputs.py).
    broken = tmp_path / "weightless-model"
    broken.mkdir()
    shutil.copy(starting_model.path / "config.json", broken)
    launch = RlLaunch(
        tmp_path,
        "dies",
        "--model.name",
        str(starting_model.path),
        "--trainer.model.name",
        str(broken),
        "--no-supervision.enabled",  # restarts would fail the same way; tests/e2e/test_supervision.py
    )
    try:
        code = launch.wait(300)
        output = launch.output()
        assert code != 0, output[-3000:]
        assert "trainer exited with code" in output
        assert "--- last lines of" in output and "trainer.log" in output
        assert '"event": "service_failed"' in output
        assert alive_groups(launch.run_dir) == []
    finally:
        launch.kill()
