"""The eval runner: eval tasks out once the step's weights are applied, rollouts in, one result
per environment, with its failures counted and its files written."""

import asyncio
import json

import pytest
from coordinator_fakes import (
    FakeBus,
    FakeDelivery,
    make_config,
    make_rollout,
    make_store,
    make_weights,
)

from rlbus.rundirs import eval_dir
from rlbus.samples import read_records
from rlbus.wire.events import EvalResult
from rlbus_orchestrator.eval_runner import EvalRunner
from rlbus_orchestrator.evaluation import eval_envs

TWO_ENVS = [
    {"id": "reverse-text", "name": "short", "args": {"num_eval": 3}, "num_examples": 2},
    {"id": "reverse-text", "name": "long", "rollouts_per_example": 4, "pass_k": [1, 2]},
]


def make_runner(eval_config, run_dir=None, applied=0, **overrides):
    config = make_config(eval=eval_config, **overrides)
    weights = make_weights(config, make_store())
    weights.applied_version = applied
    return EvalRunner(FakeBus(), config, eval_envs(config), weights=weights, run_dir=run_dir)


def test_each_environment_is_due_at_its_interval_step_zero_and_the_last_step():
    runner = make_runner(
        {
            "interval": 3,
            "env": [{"id": "reverse-text"}, {"id": "reverse-text", "name": "b", "interval": 4}],
        },
        max_steps=10,
    )
    due = {s: [e.label for e in runner.due_envs(s)] for s in range(11) if runner.is_due(s)}
    assert due == {
        0: ["reverse-text", "b"],
        3: ["reverse-text"],
        4: ["b"],
        6: ["reverse-text"],
        8: ["b"],
        9: ["reverse-text"],
        10: ["reverse-text", "b"],
    }
    quiet = make_runner(
        {"interval": 3, "eval_base_model": False, "eval_last_step": False}, max_steps=10
    )
    assert [s for s in range(11) if quiet.is_due(s)] == [3, 6, 9]
    assert not make_runner(None).is_due(3)


def test_without_eval_envs_each_training_environment_is_evaluated_on_its_eval_split():
    runner = make_runner(
        {"num_examples": 5},
        env=[
            {"id": "reverse-text", "args": {"num_eval": 3}},
            {"id": "alphabet-sort", "group_size": 2},
        ],
    )
    assert [(e.label, e.config.split, e.n) for e in runner.envs] == [
        ("reverse-text", "eval", 1),
        ("alphabet-sort", "eval", 1),
    ]
    assert runner.envs[0].num_examples == 3  # capped by the split


async def run_evaluation(runner, step, rollouts):
    """Start the evaluation of `step`, feed `rollouts` once its tasks are out, wait for it."""
    runner.start(step)
    evaluating = asyncio.create_task(runner.evaluate(step))
    while not runner.bus.published_to(runner.bus.subjects.eval_tasks) and not evaluating.done():
        await asyncio.sleep(0.01)
    deliveries = [FakeDelivery(r) for r in rollouts]
    for delivery in deliveries:
        await runner.on_rollout(delivery)
    await evaluating
    return deliveries


def test_tasks_wait_for_the_steps_weights_then_carry_n_samples_and_their_sampling():
    runner = make_runner({"env": TWO_ENVS, "interval": 2}, applied=1)

    async def scenario():
        runner.start(2)
        evaluating = asyncio.create_task(runner.evaluate(2))
        await asyncio.sleep(0.2)
        assert runner.bus.published == []  # version 2 not applied yet
        runner.weights.applied_version = 2
        while not runner.bus.published and not evaluating.done():
            await asyncio.sleep(0.05)
        evaluating.cancel()

    asyncio.run(scenario())
    tasks = runner.bus.published_to(runner.bus.subjects.eval_tasks)
    assert runner.bus.published_to(runner.bus.subjects.tasks) == []  # never the training queue
    ids = [t.task_id for t in tasks]
    assert ids[:2] == ["eval-2-0-0", "eval-2-0-1"] and ids[2] == "eval-2-1-0"
    short, long = tasks[0], tasks[2]
    assert short.group_size == 1 and short.sampling.temperature == 0.0  # greedy: one sample
    assert long.group_size == 4 and long.sampling.temperature == 1.0
    assert all(t.min_policy_version == 2 for t in tasks)


def test_results_per_environment_count_failures_and_are_written_with_the_samples(tmp_path):
    runner = make_runner({"env": TWO_ENVS[:1], "interval": 5}, run_dir=tmp_path, applied=5)
    failed = make_rollout("eval-5-0-1", [])
    failed.error = "boom"
    rollouts = [make_rollout("eval-5-0-0", [1.0]), make_rollout("eval-5-0-0", [0.0]), failed]
    deliveries = asyncio.run(run_evaluation(runner, 5, rollouts))
    assert all(d.acked for d in deliveries)
    [event] = runner.bus.published_to(runner.bus.subjects.evals("orchestrator"))
    assert isinstance(event, EvalResult) and (event.step, event.env) == (5, "short")
    assert event.metrics["eval/short/reward/mean"] == 1.0  # the redelivered duplicate is ignored
    assert event.metrics["eval/short/failed"] == 1.0
    assert event.metrics["eval/short/num_examples"] == 1.0
    results = json.loads((eval_dir(tmp_path, 5) / "results.json").read_text())
    assert results["envs"]["short"] == event.metrics and results["step"] == 5
    [record] = read_records(eval_dir(tmp_path, 5) / "samples.jsonl")
    assert record["env"] == "short" and record["reward"] == 1.0 and record["advantage"] is None
    assert runner.is_recorded(5) and not runner.is_recorded(6) and runner.idle.is_set()


def test_an_evaluation_whose_rollouts_never_come_is_reported_at_its_timeout():
    runner = make_runner({"env": TWO_ENVS[:1], "timeout_s": 0.2, "interval": 1}, applied=1)
    asyncio.run(run_evaluation(runner, 1, [make_rollout("eval-1-0-0", [0.5])]))
    [event] = runner.bus.published_to(runner.bus.subjects.evals("orchestrator"))
    assert event.metrics["eval/short/failed"] == 1.0
    assert event.metrics["eval/short/reward/mean"] == 0.5


@pytest.mark.parametrize("task_id", ["eval-7-0-0", "eval-5-9-0"])
def test_a_rollout_of_no_running_evaluation_is_acked_and_ignored(task_id):
    runner = make_runner({"env": TWO_ENVS[:1], "interval": 5}, applied=9)
    runner.start(5)
    late = FakeDelivery(make_rollout(task_id, [1.0]))
    asyncio.run(runner.on_rollout(late))
    assert late.acked and runner.bus.published == [] and not runner.running[5].rollouts[0]
