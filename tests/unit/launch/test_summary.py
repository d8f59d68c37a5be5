"""The summary `rl` prints when a run ends (rlbus_launch.summary), read from a run directory."""

import json
from pathlib import Path

from rlbus_launch.summary import outcome_of, run_summary


def write_jsonl(path: Path, *rows: dict) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def make_run_dir(tmp_path: Path) -> Path:
    """A finished 3-step run: metrics, two evaluations of two environments, broadcasts, samples."""
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    write_jsonl(
        run_dir / "metrics.jsonl",
        {"step": 1, "loss": 0.3, "reward/mean": 0.61},
        {"step": 2, "loss": 0.2, "reward/mean": 0.7},
        {"step": 3, "loss": 0.1},
        {"step": 3, "reward/mean": 0.875},  # an older monitor's second row for the step
    )
    write_jsonl(
        run_dir / "evals.jsonl",
        {"step": 0, "env": "reverse-text", "eval/reverse-text/reward/mean": 0.2},
        {
            "step": 3,
            "time": 1765000000.0,
            "env": "reverse-text",
            "eval/reverse-text/reward/mean": 0.41,
            "eval/reverse-text/pass@1": 0.25,
            "eval/reverse-text/num_examples": 16,
            "eval/reverse-text/failed": 0,
        },
        {"step": 3, "env": "math", "eval/math/reward/mean": 0.5},
    )
    for step in (2, 3):
        (run_dir / "broadcasts" / f"step_{step}").mkdir(parents=True)
    (run_dir / "broadcasts" / "step_4.tmp").mkdir()  # a write under way is not the model
    (run_dir / "rollouts").mkdir()
    return run_dir


def test_summary_of_a_finished_run_has_steps_rewards_last_eval_and_where_things_are(tmp_path):
    run_dir = make_run_dir(tmp_path)
    text = run_summary(run_dir, outcome="finished", wall_s=95.0, max_steps=3)
    assert text.splitlines() == [
        f"run finished after 1m 35s: {run_dir}",
        "  steps    3 of 3",
        "  reward   0.6100 at step 1, 0.8750 at step 3",
        "  eval     step 3, reverse-text: reward/mean 0.41, num_examples 16, failed 0, pass@1 0.25",
        "           step 3, math: reward/mean 0.5",
        f"  model    {run_dir}/broadcasts/step_3",
        f"  samples  {run_dir}/rollouts",
        f"  logs     {run_dir}/logs",
    ]


def test_without_broadcasts_the_model_is_the_newest_complete_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    for step, complete in ((2, True), (4, False)):
        trainer = run_dir / "checkpoints" / f"step_{step}" / "trainer"
        trainer.mkdir(parents=True)
        if complete:
            (trainer / "COMPLETE").touch()
    text = run_summary(run_dir, outcome="finished", wall_s=1.0, max_steps=4)
    assert f"  model    {run_dir}/checkpoints/step_2" in text.splitlines()


def test_a_finished_run_s_model_is_its_final_model_directory(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "broadcasts" / "step_4").mkdir(parents=True)
    (run_dir / "model").mkdir()
    text = run_summary(run_dir, outcome="finished", wall_s=1.0, max_steps=4)
    assert f"  model    {run_dir}/model" in text.splitlines()


def test_a_run_that_failed_before_any_step_says_so_plainly(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    text = run_summary(run_dir, outcome=outcome_of(1), wall_s=3.0, max_steps=None)
    assert text.splitlines() == [
        f"run failed (exit code 1) after 3s: {run_dir}",
        "  steps    0",
        "  reward   none reported",
        "  eval     no eval",
        "  model    none saved",
        "  samples  none kept",
        f"  logs     {run_dir}/logs",
    ]


def test_the_outcome_names_the_signal_that_stopped_the_run():
    assert outcome_of(0) == "finished"
    assert outcome_of(130, stopped_by="Ctrl-C") == "stopped (Ctrl-C)"
    assert outcome_of(143) == "failed (exit code 143)"  # a service killed by SIGTERM
