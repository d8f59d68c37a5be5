"""A service that keeps dying is restarted within its budget, then takes the run down cleanly:
named, its log shown, the rest stopped, exit != 0."""

import pytest
from e2e_support import RlLaunch, alive_groups

pytestmark = pytest.mark.slow


def test_a_dying_trainer_is_named_with_its_log_and_every_other_process_stops(
    tmp_path, starting_model
):
    launch = RlLaunch(
        tmp_path,
        "dies",
        "--model.name",
        str(starting_model.path),
        "--trainer.model.name",
        str(tmp_path / "no-such-model"),
        "--supervision.max-restarts",
        "1",
    )
    try:
        code = launch.wait(300)
        output = launch.output()
        assert code != 0, output[-3000:]
        assert "trainer died (exit code" in output and "restarting in 1 s (restart 1 of 1" in output
        assert "trainer is back (pid" in output
        assert "giving up; see" in output and "trainer ended (exit code" in output
        assert "--- last lines of" in output and "trainer.log" in output
        assert '"event": "service_failed"' in output
        assert alive_groups(launch.run_dir) == []
    finally:
        launch.kill()
