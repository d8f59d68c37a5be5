"""The launcher's progress lines from metrics.jsonl rows."""

import json

import pytest

from rlbus_launch.progress import (
    MetricsTail,
    Progress,
    eta_s,
    format_duration,
    progress_line,
    replica_versions,
    step_line,
)


def make_row(step: int, **values) -> dict:
    return {"step": step, **values}


def test_step_line_has_the_documented_fields():
    row = make_row(
        3,
        **{
            "reward/mean": 0.42125,
            "loss": 0.01234,
            "tokens_per_s": 511.6,
            "orchestrator/tokens_per_s": 90.0,
            "off_policy_lag/0": 8.0,
            "off_policy_lag/1": 24.0,
        },
    )
    line = step_line(3, row, {"vm-8000": 2, "vm-8001": 1})
    assert (
        line
        == "Step 3 | Reward 0.4213 | Loss 0.0123 | Tok/s 512 | Weights v2 (vm-8000: v2, vm-8001: v1) | Lag 0.75"
    )


def test_step_line_uses_the_trainer_tokens_per_s_whichever_service_came_first():
    row = make_row(
        1, **{"reward/mean": 0.5, "loss": 0.1, "tokens_per_s": 90.0, "trainer/tokens_per_s": 700.0}
    )
    assert "Tok/s 700" in step_line(1, row, {})


def test_unknown_values_print_as_a_dash():
    assert (
        step_line(1, make_row(1), {}) == "Step 1 | Reward - | Loss - | Tok/s - | Weights - | Lag -"
    )


def test_tail_reads_only_complete_lines_and_merges_rows_by_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.poll() == []
    path.write_text(json.dumps(make_row(1, loss=0.1)) + "\n" + '{"step": 2, "lo')
    assert tail.poll() == [1]
    with open(path, "a") as f:
        f.write('ss": 0.2}\n' + json.dumps(make_row(1, **{"weights/applied/r0": 3})) + "\n")
    assert tail.poll() == [1, 2]
    assert tail.steps[1] == {"step": 1, "loss": 0.1, "weights/applied/r0": 3}
    assert replica_versions(tail.steps) == {"r0": 3}


def test_progress_prints_each_complete_step_once_and_skips_steps_of_an_earlier_launch(
    tmp_path, capsys
):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(make_row(1, loss=0.1, **{"reward/mean": 0.3})) + "\n")
    progress = Progress(path, tty=False)
    with open(path, "a") as f:
        f.write(json.dumps(make_row(2, loss=0.2)) + "\n")
    progress.update()
    assert capsys.readouterr().out == ""  # step 2 has no orchestrator part yet
    with open(path, "a") as f:
        f.write(json.dumps(make_row(2, **{"reward/mean": 0.4})) + "\n")
    progress.update()
    progress.update()
    assert capsys.readouterr().out.splitlines() == [
        "Step 2 | Reward 0.4000 | Loss 0.2000 | Tok/s - | Weights - | Lag -"
    ]


def test_a_final_row_with_only_weights_acks_is_not_printed_as_a_step(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    progress = Progress(path, tty=False)
    rows = [make_row(5, loss=0.1), make_row(6, **{"weights/applied/r0": 5})]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    progress.close()
    assert capsys.readouterr().out.splitlines() == [
        "Step 5 | Reward - | Loss 0.1000 | Tok/s - | Weights v5 (r0: v5) | Lag -"
    ]


def test_a_run_of_several_environments_shows_each_ones_reward_on_the_same_line():
    row = make_row(
        2,
        **{
            "reward/mean": 0.42125,
            "env/math/reward/mean": 0.514,
            "env/math/samples": 8.0,
            "env/reverse-text/reward/mean": 0.3291,
            "loss": 0.1,
        },
    )
    line = step_line(2, row, {})
    assert line.startswith("Step 2 | Reward 0.4213 (math 0.51, reverse-text 0.33) | Loss 0.1000")
    assert "\n" not in line


def test_one_environment_shows_the_reward_alone():
    row = make_row(1, **{"reward/mean": 0.5, "env/reverse-text/reward/mean": 0.5})
    assert step_line(1, row, {}).startswith("Step 1 | Reward 0.5000 | Loss -")


def test_eta_is_unknown_until_two_steps_are_done():
    assert eta_s([], steps_left=10, now=0.0) is None
    assert eta_s([5.0], steps_left=10, now=5.0) is None


def test_eta_is_the_mean_of_the_last_ten_step_durations_times_the_steps_left():
    slow_start = [0.0, 100.0]  # the first step (with compilation, warm-up) is long
    steady = [100.0 + 2.0 * i for i in range(1, 11)]  # then 10 steps of 2 s
    done = slow_start + steady
    assert eta_s(done, steps_left=5, now=done[-1]) == pytest.approx(10.0)
    assert eta_s(done[:3], steps_left=5, now=done[2]) == pytest.approx(5 * 51.0)


def test_eta_counts_down_between_steps_and_stops_at_zero():
    assert eta_s([0.0, 4.0], steps_left=3, now=7.0) == pytest.approx(9.0)
    assert eta_s([0.0, 4.0], steps_left=1, now=60.0) == 0.0


def test_progress_line_shows_step_of_max_steps_and_the_eta():
    assert progress_line(3, 40, None) == "step 3 of 40 · ETA --"
    assert progress_line(3, 40, 65.2) == "step 3 of 40 · ETA 1m 05s"
    assert progress_line(3, None, None) == "step 3"


def test_durations_read_in_seconds_minutes_or_hours():
    assert [format_duration(s) for s in (0.4, 42, 185, 7380)] == ["0s", "42s", "3m 05s", "2h 03m"]
