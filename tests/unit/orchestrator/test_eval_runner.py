"""The eval runner: eval tasks out, rewards in, one result per evaluation."""

import asyncio

from coordinator_fakes import FakeBus, FakeDelivery, make_config, make_rollout

from rlbus_orchestrator.eval_runner import EvalRunner
from rlbus_orchestrator.task_issue import load_run_envs


def make_eval_runner(eval_config, **env_args):
    config = make_config(eval=eval_config, env=[{"id": "reverse-text", "args": env_args}])
    return EvalRunner(FakeBus(), config.eval, config.sampling, load_run_envs(config)[0])


def test_evaluations_are_due_every_interval_and_never_without_an_eval_config():
    runner = make_eval_runner({"interval": 3})
    assert [s for s in range(1, 10) if runner.is_due(s)] == [3, 6, 9]
    assert not make_eval_runner(None).is_due(3)


def test_eval_tasks_are_greedy_single_samples_of_the_eval_split_capped_by_its_size():
    runner = make_eval_runner({"interval": 1, "num_examples": 10}, num_eval=3)
    asyncio.run(runner.publish_tasks(4))
    tasks = runner.bus.published_to(runner.bus.subjects.tasks)
    assert [t.task_id for t in tasks] == ["eval-4-0", "eval-4-1", "eval-4-2"]
    assert all(t.group_size == 1 and t.sampling.temperature == 0.0 for t in tasks)
    assert [msg_id for _, _, msg_id in runner.bus.published] == [t.task_id for t in tasks]


def test_the_result_is_published_once_every_eval_rollout_is_in():
    runner = make_eval_runner({"interval": 1, "num_examples": 2})
    asyncio.run(runner.publish_tasks(2))
    first = FakeDelivery(make_rollout("eval-2-0", [1.0]))
    asyncio.run(runner.on_rollout(first))
    assert first.acked and runner.results == {}
    asyncio.run(runner.on_rollout(FakeDelivery(make_rollout("eval-2-1", [0.0]))))
    assert runner.results[2] == {"eval/reward/mean": 0.5, "eval/num_examples": 2.0}
    [event] = runner.bus.published_to(runner.bus.subjects.metrics("orchestrator"))
    assert event.step == 2 and event.metrics == runner.results[2] and not runner.pending


def test_a_rollout_of_an_evaluation_from_before_a_restart_is_acked_and_ignored():
    runner = make_eval_runner({"interval": 1, "num_examples": 1})
    late = FakeDelivery(make_rollout("eval-7-0", [1.0]))
    asyncio.run(runner.on_rollout(late))
    assert late.acked and runner.results == {} and runner.bus.published == []
