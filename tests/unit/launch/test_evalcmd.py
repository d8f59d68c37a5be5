"""`rl eval`'s inputs: which weights of a run it serves, where the results go, and one line
(exit 2) for what it cannot use. The evaluation itself runs in tests/e2e/test_rl_run.py."""

import json

import pytest

from rlbus.rundirs import BROADCASTS_DIR
from rlbus_launch import evalcmd
from rlbus_launch.evalcmd import EvalCommandError, parse_args, plan, results_table, step_weights


def fake_run(tmp_path, steps=(4, 5)):
    """A run directory as `rl` leaves it: configs, and weights of `steps` in broadcasts/."""
    run_dir = tmp_path / "run"
    (run_dir / "configs").mkdir(parents=True)
    (run_dir / "configs" / "orchestrator.toml").write_text(
        '[model]\nname = "base-model"\n[eval]\ninterval = 2\n[[eval.env]]\nid = "reverse-text"\n'
    )
    (run_dir / "configs" / "inference.toml").write_text('[vllm]\nmodel = "base-model"\n')
    for step in steps:
        weights = run_dir / BROADCASTS_DIR / f"step_{step}"
        weights.mkdir(parents=True)
        (weights / "config.json").write_text("{}")
    (run_dir / BROADCASTS_DIR / "step_9").mkdir(
        parents=True
    )  # a write in progress: no config.json yet
    return run_dir


def test_the_newest_weights_step_0_or_a_given_step_are_served(tmp_path):
    run_dir = fake_run(tmp_path)
    assert step_weights(run_dir, None, "base") == (
        5,
        str((run_dir / "broadcasts/step_5").resolve()),
    )
    assert step_weights(run_dir, 4, "base")[0] == 4
    assert step_weights(run_dir, 0, "base") == (0, "base")
    assert step_weights(fake_run(tmp_path / "empty", steps=()), None, "base") == (0, "base")


def test_a_step_without_weights_is_one_line_listing_the_steps_that_have_them(tmp_path):
    with pytest.raises(
        EvalCommandError,
        match=r"--step 9: .* neither weights \(broadcasts/: steps 0, 4, 5\) nor a complete "
        r"checkpoint \(checkpoints/: none\)",
    ):
        step_weights(fake_run(tmp_path), 9, "base")


def test_a_step_with_a_checkpoint_only_or_asked_for_is_exported(tmp_path):
    run_dir = fake_run(tmp_path)
    for step in (5, 7):
        marker = run_dir / "checkpoints" / f"step_{step}" / "trainer" / "COMPLETE"
        marker.parent.mkdir(parents=True)
        marker.write_text("")
    assert step_weights(run_dir, None, "base") == (7, None)  # the newest of either
    assert step_weights(run_dir, 5, "base", from_checkpoint=True) == (5, None)
    todo = plan(parse_args([str(run_dir), "--step", "7"]))
    assert todo.export and todo.orchestrator.model.name.endswith("step_7/model")
    assert todo.inference.vllm.model == todo.orchestrator.model.name


def test_a_run_is_served_on_free_local_ports_without_a_bus_and_written_beside_its_evals(tmp_path):
    run_dir = fake_run(tmp_path)
    todo = plan(parse_args([str(run_dir)]))
    orchestrator, inference, step, out = todo.orchestrator, todo.inference, todo.step, todo.out
    assert step == 5 and out == run_dir / "evals" / "command" / "step_5"
    assert inference is not None and inference.vllm.model == orchestrator.model.name
    assert orchestrator.model.name.endswith("broadcasts/step_5")
    assert inference.bus.url is None and orchestrator.bus.url is None
    assert orchestrator.inference_urls == [f"http://127.0.0.1:{inference.server.port}/v1"]
    assert [e.id for e in orchestrator.eval.env] == ["reverse-text"]  # the run's own eval config


def test_an_attached_server_starts_nothing(tmp_path):
    args = parse_args(["--model", "m", "--inference-url", "http://h:9/v1", "--out", str(tmp_path)])
    todo = plan(args)
    orchestrator, inference, step, out = todo.orchestrator, todo.inference, todo.step, todo.out
    assert inference is None and orchestrator.inference_urls == ["http://h:9/v1"]
    assert (orchestrator.model.name, step, out) == ("m", 0, tmp_path)


@pytest.mark.parametrize(
    "argv",
    [[], ["run", "--model", "m"], ["--model", "m", "--step", "3"]],
)
def test_conflicting_or_missing_targets_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2 and "rl eval" in capsys.readouterr().err


def test_a_directory_that_is_no_run_is_one_line_and_exit_2(tmp_path, capsys):
    assert evalcmd.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rl eval: ") and "configs/orchestrator.toml" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_the_table_has_a_row_per_environment_and_a_column_per_k(tmp_path):
    results = {
        "step": 5,
        "envs": {
            "a": {"eval/a/reward/mean": 0.5, "eval/a/pass@1": 0.25, "eval/a/pass@10": 0.75},
            "b": {"eval/b/reward/mean": 0.1, "eval/b/failed": 2.0},
        },
    }
    table = results_table(json.loads(json.dumps(results)))
    assert [c.header for c in table.columns] == [
        "env",
        "examples",
        "failed",
        "reward",
        "pass@1",
        "pass@10",
    ]
    assert table.row_count == 2
