"""benchmarks/vs_trl.py's pure parts: per-step logs of both tools, time to reward, the table."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlbus import process_marks
from rlbus_launch.plot import read_metrics
from rlbus_orchestrator.envs.reverse_text import ReverseTextEnv

ROOT = Path(__file__).resolve().parents[2]


def load_vs_trl():
    spec = importlib.util.spec_from_file_location("vs_trl", ROOT / "benchmarks" / "vs_trl.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["vs_trl"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


vs_trl = load_vs_trl()
Step, Measures = vs_trl.Step, vs_trl.Measures


def make_steps(rewards: list[float], start_s: float = 10.0, step_s: float = 1.0) -> list:
    return [Step(i + 1, start_s + i * step_s, r) for i, r in enumerate(rewards)]


def make_opts(**overrides) -> SimpleNamespace:
    return SimpleNamespace(
        **{"target": 0.85, "window": 10, "reward_step": 40, "max_steps": 60, **overrides}
    )


def test_time_to_reward_waits_for_the_trailing_window():
    # One step at 1.0 does not lift a 3-step mean of 0.5s over 0.8; three steps at 0.9 do.
    steps = make_steps([0.5, 0.5, 1.0, 0.5, 0.9, 0.9, 0.9])
    assert vs_trl.time_to_reward(steps, 0.8, window=3) == steps[6].elapsed_s
    assert vs_trl.time_to_reward(steps, 0.6, window=3) == steps[2].elapsed_s


def test_time_to_reward_needs_a_full_window_first():
    steps = make_steps([0.9, 0.9, 0.9])
    assert vs_trl.time_to_reward(steps, 0.85, window=4) is None
    assert vs_trl.time_to_reward(steps, 0.85, window=3) == steps[2].elapsed_s


def test_reward_at_is_the_trailing_mean_at_that_step():
    steps = make_steps([0.1 * i for i in range(1, 7)])
    assert vs_trl.reward_at(steps, 5, window=2) == pytest.approx((0.4 + 0.5) / 2)
    assert vs_trl.reward_at(steps, 1, window=2) is None
    assert vs_trl.reward_at(steps, 40, window=2) is None


def test_median_step_skips_the_first_two_and_gaps():
    # Step ends at 10, 20 (start-up, slow first steps), then 1 s apart, then a missing step.
    steps = [Step(1, 10, 0), Step(2, 20, 0), Step(3, 21, 0), Step(4, 22, 0), Step(6, 40, 0)]
    assert vs_trl.median_step_s(steps) == 1.0
    assert vs_trl.median_step_s(steps[:2]) is None


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_rlbus_steps_read_the_sampled_mean_of_joined_rows(tmp_path):
    rows = [
        {"step": 1, "reward/mean": 0.6, "reward/trained_mean": 0.7, "time": 1000.0},
        {"step": 1, "loss": 0.1, "time": 1002.5},  # the trainer's part of the same step
        {"step": 2, "reward/mean": 0.65, "reward/trained_mean": 0.8, "time": 1003.0},
    ]
    metrics = read_metrics(write_jsonl(tmp_path / "metrics.jsonl", rows))
    steps, key = vs_trl.rlbus_steps(metrics, t0=990.0)
    assert key == "reward/mean"
    assert steps == [Step(1, 12.5, 0.6)]  # step 2 has no trainer part yet


def test_an_older_run_is_read_and_named_as_the_trained_mean():
    steps, key = vs_trl.rlbus_steps(
        [{"step": 1, "loss": 0.0, "reward/mean": 0.7, "time": 5.0}], 1.0
    )
    assert key.startswith("reward/mean (an older run")
    assert steps == [Step(1, 4.0, 0.7)]


def test_trl_steps_parse_the_callback_lines():
    text = '{"step": 1, "elapsed_s": 9.5, "step_s": 1.2, "reward": 0.63}\n\n'
    assert vs_trl.trl_steps(text) == [Step(1, 9.5, 0.63)]


def test_table_gives_medians_and_rlbus_over_trl_ratios():
    opts = make_opts()
    trl = [Measures(10.0, 1.0, 50.0, 40.0, 0.88), Measures(12.0, 1.2, 60.0, 45.0, 0.86)]
    rlbus = [Measures(30.0, 2.0, 100.0, 80.0, 0.87), Measures(36.0, 2.4, None, 90.0, 0.85)]
    rows = {row[0]: row[1:] for row in vs_trl.table_rows(trl, rlbus, opts)}
    assert rows["start-up to step 1 (s)"] == ("11.0", "33.0", "3.00x", "3.00x, 3.00x")
    assert rows["median step (s, steps > 2)"] == ("1.10", "2.20", "2.00x", "2.00x, 2.00x")
    # A pair that did not reach the target leaves the median unknown, never a made-up number.
    assert rows["time to 0.85 (s)"] == ("55.0", "not reached in 60 steps", "-", "2.00x, -")
    assert rows["time to 0.80 (s)"] == ("42.5", "85.0", "2.00x", "2.00x, 2.00x")
    assert rows["reward @ step 40"][:2] == ("0.870", "0.860")
    assert "rlbus/TRL" in vs_trl.format_table(vs_trl.table_rows(trl, rlbus, opts))


def test_measure_of_a_run_that_never_trained_is_all_unknown():
    m = vs_trl.measure([], make_opts())
    assert m == Measures(None, None, None, None, None)


def test_trl_job_is_built_from_the_resolved_rl_config(tmp_path):
    opts = vs_trl.parse_args(
        ["--max-steps", "3", "--window", "2", "--", "--trainer.optim.lr", "2e-3"]
    )
    job = vs_trl.trl_job(vs_trl.resolved_config(opts), tmp_path)
    assert (job["prompts_per_step"], job["num_generations"]) == (16, 8)
    assert (job["max_completion_length"], job["temperature"], job["lr"]) == (14, 1.0, 2e-3)
    assert (job["kl_beta"], job["scale_rewards"], job["max_steps"]) == (0.0, "none", 3)
    assert Path(job["model"]) == ROOT / "examples/reverse-text/model"
    assert len(job["examples"]) == 3 * 16
    first = ReverseTextEnv().example("train", 0)
    assert job["examples"][0]["answer"] == first.answer
    assert job["examples"][0]["prompt"][1] == {"role": "user", "content": first.info["text"]}


def test_rl_argv_carries_steps_and_extra_flags(tmp_path):
    argv = vs_trl.rl_argv(
        Path("rl.toml"), tmp_path, "rlbus-0", 60, ["--orchestrator.async-level", "0"]
    )
    assert argv[1:3] == ["@", "rl.toml"]
    assert argv[argv.index("--max-steps") + 1] == "60"
    assert argv[-2:] == ["--orchestrator.async-level", "0"]


def test_trl_venv_pins_the_projects_torch():
    assert vs_trl.trl_requirements()[-1] == f"torch=={vs_trl.version('torch')}"


@pytest.mark.parametrize(
    ("argv", "flag"), [(["--pairs", "0"], "--pairs"), (["--max-steps", "5"], "--window")]
)
def test_bad_flags_get_one_line_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as stop:
        vs_trl.parse_args(argv)
    assert stop.value.code == 2
    assert flag in capsys.readouterr().err.splitlines()[-1]


def is_gone(pid: int) -> bool:
    """No such process, or only a zombie waiting for its new parent to reap it."""
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_stop_group_ends_the_whole_process_group():
    # A shell and its child in their own group: both must be gone after stop_group.
    proc = subprocess.Popen(
        ["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, start_new_session=True
    )
    child = int(proc.stdout.readline())
    try:
        process_marks.stop_group(proc, vs_trl.STOP_WAIT_S)
        assert proc.returncode is not None
        deadline = time.monotonic() + 10  # the child got the signal; give it time to exit
        while not is_gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert is_gone(child)
    finally:
        proc.stdout.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if not is_gone(child):
            os.kill(child, signal.SIGKILL)


def test_a_venv_path_that_is_not_a_venv_is_refused_not_cleared(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as stop:
        vs_trl.ensure_trl_venv(tmp_path, reinstall=False)
    assert "--venv" in str(stop.value.code) and "not a venv" in str(stop.value.code)
    assert (tmp_path / "notes.txt").read_text() == "mine"
