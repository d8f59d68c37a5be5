"""A classic verifiers environment in a real run: environments/count_up_classic (it requires
verifiers 0.1.3) installed by `rl env install` into a venv of its own, named by its id
(`count-up`) in the debug config, played turn by turn by the run's rollout workers against the
vLLM-CPU replica through rlbus's classic env server, and trained on."""

import pytest
from e2e_support import DEBUG_RL, REPO, alive_groups, finished_launch, run_rows
from vf_support import rl_env_install, vf_env_dir

from rlbus import envindex

pytestmark = pytest.mark.slow

MAX_STEPS = 2
NUM_TURNS = 3


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, starting_model):
    directory = vf_env_dir()
    install = rl_env_install(directory, REPO / "environments" / "count_up_classic")
    assert install.returncode == 0, install.stdout + install.stderr
    root = tmp_path_factory.mktemp("e2e-classic")
    config = root / "rl.toml"
    env = f'id = "count-up"\nargs = {{ num_turns = {NUM_TURNS} }}'
    config.write_text(DEBUG_RL.read_text().replace('id = "reverse-text"', env))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(envindex.ENV_DIR_VAR, str(directory))
        args = ["--model.name", str(starting_model.path), "--max-steps", str(MAX_STEPS)]
        args += ["--orchestrator.batch-size", "16", "--orchestrator.group-size", "4"]
        # the reverse-text model cannot count: its groups all score 0, which the zero-advantage
        # filter would drop forever; and three turns need more than the debug seq_len of 128
        args += ["--orchestrator.filter-zero-advantage", "false", "--seq-len", "256"]
        with finished_launch(root, "e2e-classic", *args, config=config) as launch:
            yield launch


def test_classic_run_exits_0_and_leaves_no_process_behind(finished_run):
    assert finished_run.exit_code == 0, finished_run.output()[-4000:]
    assert alive_groups(finished_run.run_dir) == []


def test_every_step_trains_on_multi_turn_classic_episodes(finished_run):
    rows = run_rows(finished_run.run_dir)
    assert [s for s in sorted(rows) if "loss" in rows[s]] == list(range(1, MAX_STEPS + 1))
    turns = [rows[s]["env/count-up/num_turns/mean"] for s in range(1, MAX_STEPS + 1)]
    assert all(t > 1 for t in turns), turns  # the environment answered between model turns
    assert all("reward/right_share/mean" in rows[s] for s in range(1, MAX_STEPS + 1))
