import json
import subprocess
import sys

import pytest

from rlbus.rundirs import EVALS_FILE
from rlbus_launch.plot import env_series, plot_run, read_metrics


def make_metrics(run_dir, rows):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_read_metrics_joins_rows_of_the_same_step_and_sorts(tmp_path):
    make_metrics(
        tmp_path,
        [
            {"step": 2, "loss": 1.0},
            {"step": 1, "reward/mean": 0.5},
            {"step": 2, "reward/mean": 0.7},
        ],
    )
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1] == {"step": 2, "loss": 1.0, "reward/mean": 0.7}


def test_plot_writes_a_png_per_chart_with_data_only(tmp_path):
    make_metrics(tmp_path, [{"step": s, "reward/mean": s / 10, "loss": 1 / s} for s in range(1, 6)])
    written = plot_run(tmp_path)
    assert sorted(p.name for p in written) == ["loss.png", "reward.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_command_fails_clearly_without_metrics(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "rlbus_launch.plot", str(tmp_path)], capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "metrics.jsonl does not exist" in result.stderr


@pytest.mark.parametrize("rows", [[], [{"step": 1, "unrelated": 3}]])
def test_plot_command_fails_when_no_known_metric(tmp_path, rows):
    make_metrics(tmp_path, rows)
    result = subprocess.run(
        [sys.executable, "-m", "rlbus_launch.plot", str(tmp_path)], capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "no known metric" in result.stderr


def test_mean_lag_is_derived_from_the_orchestrator_histogram(tmp_path):
    make_metrics(tmp_path, [{"step": 1, "off_policy_lag/0": 96, "off_policy_lag/1": 32}])
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert row["lag/mean"] == 0.25
    assert [p.name for p in plot_run(tmp_path)] == ["lag.png"]


def make_evals(run_dir, rows):
    (run_dir / EVALS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))


def make_eval_row(step, env, reward):
    return {
        "step": step,
        "time": 1765000000.0 + step,
        "env": env,
        f"eval/{env}/reward/mean": reward,
    }


def test_env_series_draws_one_line_per_environment():
    rows = [
        {"step": 1, "reward/mean": 0.5, "env/a/reward/mean": 0.25, "env/org/b/reward/mean": 0.75},
        {"step": 2, "env/a/reward/mean": 0.5, "env/a/samples": 8.0},
    ]

    assert env_series(rows, "env/", "/reward/mean") == {
        "a": ([1, 2], [0.25, 0.5]),
        "org/b": ([1], [0.75]),
    }


def test_eval_series_joins_the_rows_of_each_environment_over_steps(tmp_path):
    make_metrics(tmp_path, [{"step": 1, "loss": 1.0}])
    make_evals(
        tmp_path,
        [
            make_eval_row(0, "a", 0.1),
            make_eval_row(0, "b", 0.2),
            make_eval_row(10, "a", 0.4),
            make_eval_row(10, "b", 0.3) | {"eval/b/pass@4": 0.5},
        ],
    )
    rows = read_metrics(tmp_path / EVALS_FILE)

    assert env_series(rows, "eval/", "/reward/mean") == {
        "a": ([0, 10], [0.1, 0.4]),
        "b": ([0, 10], [0.2, 0.3]),
    }


def test_plot_draws_the_per_environment_charts_when_the_run_has_their_keys(tmp_path):
    make_metrics(
        tmp_path,
        [{"step": s, "reward/mean": s / 10, "env/a/reward/mean": s / 20} for s in range(1, 4)],
    )
    assert sorted(p.name for p in plot_run(tmp_path)) == ["env_reward.png", "reward.png"]

    make_evals(tmp_path, [make_eval_row(0, "a", 0.1), make_eval_row(2, "a", 0.3)])
    written = plot_run(tmp_path)

    assert sorted(p.name for p in written) == ["env_reward.png", "eval_reward.png", "reward.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
