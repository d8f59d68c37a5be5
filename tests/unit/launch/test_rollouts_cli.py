"""`rl rollouts`: a run's sample records printed as conversations, filtered by env and reward;
a missing run directory or step is one line and exit 2."""

from pathlib import Path
from typing import Any

import pytest

from rlbus.rundirs import EVAL_SAMPLES_FILE, eval_dir, rollouts_file
from rlbus.samples import write_records
from rlbus_launch.rollouts import main


def make_record(**fields: Any) -> dict[str, Any]:
    """A single-turn sample record (rlbus.samples); `fields` override."""
    record = {
        "step": 3,
        "env": "reverse-text",
        "task_id": "train-7",
        "example_id": 7,
        "sample": 0,
        "prompt": [
            {"role": "system", "content": "Reverse the text."},
            {"role": "user", "content": "hello world"},
        ],
        "messages": [],
        "completion": "dlrow olleh",
        "reward": 0.75,
        "reward_components": {"lcs": 0.75},
        "advantage": 0.125,
        "policy_version": 2,
        "num_turns": 1,
        "num_tool_calls": 0,
        "num_tool_errors": 0,
        "stop_reason": None,
        "finish_reason": "stop",
        "is_truncated": False,
        "completion_tokens": 5,
        "trained_tokens": 5,
    }
    return record | fields


def make_tool_record(**fields: Any) -> dict[str, Any]:
    """A multi-turn sample record: one tool call, its result, the final answer."""
    messages = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "21 C, sunny", "tool_call_id": "call_1", "name": "get_weather"},
        {"role": "assistant", "content": "It is 21 C in Paris."},
    ]
    record = make_record(
        env="weather-tools",
        task_id="train-8",
        prompt=[{"role": "user", "content": "What is the weather in Paris?"}],
        messages=messages,
        completion="It is 21 C in Paris.",
        reward=0.25,
        num_turns=2,
        num_tool_calls=1,
        stop_reason="done",
    )
    return record | fields


def make_run(tmp_path: Path, steps: tuple[int, ...] = (3,)) -> Path:
    for step in steps:
        write_records(
            rollouts_file(tmp_path, step),
            [
                make_record(step=step),
                make_record(step=step, sample=1, completion="olleh dlrow", reward=0.5),
                make_tool_record(step=step),
            ],
        )
    return tmp_path


def test_rollouts_prints_prompt_completion_and_header(tmp_path, capsys):
    run_dir = make_run(tmp_path)

    assert main([str(run_dir), "--env", "reverse-text", "--best", "1"]) == 0

    out = capsys.readouterr().out
    assert "step 3 | reverse-text | task train-7 | sample 0 | reward 0.75" in out
    assert "advantage +0.125 | policy v2 | turns 1, tool calls 0 | finish stop" in out
    assert "[system]\n    Reverse the text." in out
    assert "[user]\n    hello world" in out
    assert "[assistant]\n    dlrow olleh" in out
    assert "\x1b[" not in out  # not a terminal: plain text


def test_rollouts_prints_tool_calls_and_results(tmp_path, capsys):
    run_dir = make_run(tmp_path)

    assert main([str(run_dir), "--env", "weather-tools"]) == 0

    out = capsys.readouterr().out
    assert "turns 2, tool calls 1 | stop done" in out
    assert "What is the weather in Paris?" in out
    assert 'get_weather({"city": "Paris"})' in out
    assert "[tool get_weather (call_1)]\n    21 C, sunny" in out
    assert out.index("21 C, sunny") < out.index("It is 21 C in Paris.")
    assert "reverse-text" not in out


def test_rollouts_best_and_worst_keep_the_extreme_rewards(tmp_path, capsys):
    run_dir = make_run(tmp_path)

    assert main([str(run_dir), "--best", "2"]) == 0
    best = capsys.readouterr().out
    assert main([str(run_dir), "--worst", "1"]) == 0
    worst = capsys.readouterr().out

    assert best.count("== step") == 2
    assert best.index("reward 0.75") < best.index("reward 0.5")
    assert "reward 0.25" not in best
    assert worst.count("== step") == 1
    assert "reward 0.25" in worst


def test_rollouts_best_and_worst_are_exclusive(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([str(make_run(tmp_path)), "--best", "1", "--worst", "1"])

    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_rollouts_reads_the_newest_step_by_default(tmp_path, capsys):
    run_dir = make_run(tmp_path, steps=(2, 10))

    assert main([str(run_dir), "--worst", "1"]) == 0
    assert "step 10 |" in capsys.readouterr().out
    assert main([str(run_dir), "--step", "2", "--worst", "1"]) == 0
    assert "step 2 |" in capsys.readouterr().out


def test_rollouts_missing_step_lists_the_steps_there(tmp_path, capsys):
    run_dir = make_run(tmp_path, steps=(2, 10))

    assert main([str(run_dir), "--step", "5"]) == 2

    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().splitlines() == [
        f"rollouts: no rollout samples of step 5 in {run_dir}; steps with samples: 2, 10"
    ]


def test_rollouts_run_dir_without_samples_names_what_writes_them(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere")]) == 2
    missing = capsys.readouterr().err
    assert main([str(tmp_path)]) == 2
    empty = capsys.readouterr().err

    assert "nowhere does not exist" in missing
    assert "orchestrator.samples" in missing
    assert len(empty.strip().splitlines()) == 1
    assert f"has no samples in {tmp_path / 'rollouts'}" in empty


def test_rollouts_unknown_env_lists_the_envs(tmp_path, capsys):
    assert main([str(make_run(tmp_path)), "--env", "nope"]) == 2

    assert "environments here: reverse-text, weather-tools" in capsys.readouterr().err


def test_rollouts_eval_reads_the_evaluation_samples(tmp_path, capsys):
    make_run(tmp_path)
    write_records(
        eval_dir(tmp_path, 4) / EVAL_SAMPLES_FILE,
        [make_record(step=4, task_id="eval-4-0-1", advantage=None, completion="evaluated")],
    )

    assert main([str(tmp_path), "--eval"]) == 0

    out = capsys.readouterr().out
    assert "task eval-4-0-1" in out
    assert "advantage -" in out
    assert "evaluated" in out
