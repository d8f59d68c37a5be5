"""The example bus reader (examples/bus-reader/read_bus.py), written from docs/bus-messages.md and
docs/bus-schema.json alone, reads a live `rl` run: it finds the bus in `<run_dir>/configs/bus.json`,
every message the run has stored by then is valid under the schema, and the run, watched while it
trains, still ends well (the reader takes no work from its queues)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_support import RlLaunch, metrics_lines, wait_for

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
READER = REPO / "examples" / "bus-reader" / "read_bus.py"
STEPS = 8


def read_bus(run_dir: Path) -> list[dict]:
    """One pass of the reader over the run's bus: its JSON lines (it must exit 0)."""
    done = subprocess.run(
        [sys.executable, str(READER), str(run_dir)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_the_example_reader_reads_a_live_run_and_every_stored_message_is_valid(
    tmp_path, starting_model
):
    launch = RlLaunch(
        tmp_path, "read-live", "--model.name", str(starting_model.path), "--max-steps", str(STEPS)
    )
    try:
        wait_for(lambda: len(metrics_lines(launch.run_dir)) >= 2, 300, "two trained steps")
        assert launch.popen.poll() is None, "the run should still be going while it is read"
        records = read_bus(launch.run_dir)
        assert launch.wait() == 0, launch.output()[-4000:]
    finally:
        launch.kill()

    assert [(r["subject"], r["problems"]) for r in records if r["problems"]] == []
    seen = {r["message"] for r in records}
    assert {"TrainBatch", "StepMetrics"} <= seen, seen
    assert len([r for r in records if r["message"] == "TrainBatch"]) >= 2
    assert len(launch.step_lines()) == STEPS  # watched from outside, the run trained every step
