import json
import subprocess
import sys

import pytest

from rlbus_launch.plot import plot_run, read_metrics


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
