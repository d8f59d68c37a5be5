"""The monitor writes each evaluation's row to evals.jsonl once, across restarts."""

import asyncio

from rlbus.obs.sinks import JsonlEvalSink
from rlbus.rundirs import EVALS_FILE
from rlbus.wire.events import EvalResult
from rlbus_launch.monitor.service import Monitor, read_rows


class Delivery:
    def __init__(self, data):
        self.data = data
        self.acked = False

    async def ack(self):
        self.acked = True


def result(step, env, reward):
    return EvalResult(
        service="orchestrator", step=step, env=env, metrics={f"eval/{env}/reward/mean": reward}
    )


def monitor_on(run_dir):
    monitor = Monitor([], eval_sinks=[JsonlEvalSink(run_dir)])
    monitor.resume(read_rows(run_dir / "metrics.jsonl"), read_rows(run_dir / EVALS_FILE))
    return monitor


def test_eval_results_are_written_once_per_step_and_environment_across_restarts(tmp_path):
    first = monitor_on(tmp_path)
    deliveries = [Delivery(result(0, "a", 0.1)), Delivery(result(0, "b", 0.2))]
    for delivery in deliveries:
        asyncio.run(first.handle(delivery))
    asyncio.run(first.close())
    assert all(d.acked for d in deliveries)

    second = monitor_on(tmp_path)  # a restarted monitor gets the step-0 rows redelivered
    for event in (result(0, "a", 0.1), result(10, "a", 0.7)):
        asyncio.run(second.handle(Delivery(event)))
    asyncio.run(second.close())

    rows = read_rows(tmp_path / EVALS_FILE)
    assert [(r["step"], r["env"]) for r in rows] == [(0, "a"), (0, "b"), (10, "a")]
    assert rows[2]["eval/a/reward/mean"] == 0.7
