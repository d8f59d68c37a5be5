"""Stop the debug run mid-way with SIGTERM to the launcher, then `--resume` it to the end."""

import signal

import pytest
from e2e_support import RlLaunch, alive_groups, steps_with, wait_for

pytestmark = pytest.mark.slow

MAX_STEPS = 20  # still mid-run when the SIGTERM lands after step 2 (~0.5 s per step)


def test_sigterm_then_resume_continues_the_step_numbers_without_gap_or_repeat(
    tmp_path, starting_model
):
    args = (
        "--model.name",
        str(starting_model.path),
        "--max-steps",
        str(MAX_STEPS),
        "--ckpt.interval",
        "1",
    )
    first = RlLaunch(tmp_path, "resume", *args)
    try:
        wait_for(
            lambda: len(steps_with(first.run_dir, "loss")) >= 2 or first.popen.poll() is not None,
            480,
            "two trained steps",
        )
        assert first.popen.poll() is None, f"rl exited early:\n{first.output()[-3000:]}"
        first.popen.send_signal(signal.SIGTERM)
        assert first.wait(120) == 143, first.output()[-3000:]
        assert alive_groups(first.run_dir) == []
    finally:
        first.kill()
    trained_before = steps_with(first.run_dir, "loss")
    assert trained_before == list(range(1, len(trained_before) + 1))
    assert len(trained_before) < MAX_STEPS, (
        "the run finished before SIGTERM: nothing left to resume"
    )

    second = RlLaunch(tmp_path, "resume", *args, "--resume")
    try:
        assert second.wait() == 0, second.output()[-4000:]
        assert alive_groups(second.run_dir) == []
    finally:
        second.kill()
    assert steps_with(second.run_dir, "loss") == list(range(1, MAX_STEPS + 1))
    resumed_lines = [int(line.split()[1]) for line in second.step_lines()]
    assert (
        resumed_lines
        and resumed_lines[0] == len(trained_before) + 1
        and resumed_lines[-1] == MAX_STEPS
    )
