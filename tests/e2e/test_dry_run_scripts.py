"""`rl --dry-run` starts nothing; the scripts it writes, run by hand, run the first step."""

import json
import os
import signal
import subprocess

import pytest
from e2e_support import REPO, RlLaunch, wait_for

pytestmark = pytest.mark.slow


def trained_steps(run_dir) -> list[int]:
    """Steps the trainer logged as trained (logs/trainer.log, independent of the monitor)."""
    path = run_dir / "logs" / "trainer.log"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text(errors="replace").splitlines():
        if '"train_step"' in line:
            steps.append(json.loads(line)["step"])
    return steps


def test_dry_run_scripts_run_step_one_through_every_service(tmp_path, starting_model):
    dry = RlLaunch(
        tmp_path, "dry", "--model.name", str(starting_model.path), "--max-steps", "1", "--dry-run"
    )
    assert dry.wait(120) == 0, dry.output()
    run_dir = dry.run_dir
    assert not (run_dir / "logs" / "trainer.log").exists(), "a dry run started the trainer"
    assert not (run_dir / "nats" / "jetstream").exists(), "a dry run started nats-server"

    script = subprocess.Popen(
        ["bash", str(run_dir / "scripts" / "launch.sh")],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        # max_steps = 1: the trainer exits 0 after step 1 and launch.sh then stops the rest.
        wait_for(lambda: script.poll() is not None, 480, "launch.sh to finish after step 1")
        assert trained_steps(run_dir) == [1]
        orchestrator_log = (run_dir / "logs" / "orchestrator.log").read_text(errors="replace")
        assert '"batch_published"' in orchestrator_log
        assert (run_dir / "logs" / "inference.log").exists()
    finally:
        try:
            os.killpg(script.pid, signal.SIGTERM)  # its EXIT trap stops every service group
            script.wait(60)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(script.pid, signal.SIGKILL)
