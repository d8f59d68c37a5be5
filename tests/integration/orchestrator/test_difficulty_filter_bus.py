"""Difficulty filtering on a real coordinator and nats-server, with the stand-ins of orch_support.py
for the worker and the trainer: a prompt that is always solved stops being issued and the step
metrics count it; a coordinator stopped and started again on the same run keeps the history and
the skips it had (docs/orchestrator.md, "Difficulty filtering")."""

import asyncio
import uuid

import pytest
from orch_support import AnsweringWorker, apply_weights_after_each_batch, good_rollout, make_config

from rlbus.bus import Bus
from rlbus.wire.rollouts import Rollout
from rlbus.wire.tasks import Task
from rlbus_orchestrator.service import serve
from rlbus_orchestrator.state_store import read_saved_state

EASY_EXAMPLE = 0
"""The one example of the four whose every sample earns reward 1."""


class Answers:
    """Answers every task (rewards 1, 1 for EASY_EXAMPLE; 0, 1 for the others) and remembers
    (step, example) of each training task."""

    def __init__(self) -> None:
        self.tasks: list[tuple[int, int]] = []

    def __call__(self, task: Task) -> Rollout:
        self.tasks.append((task.step, task.example_id))
        rollout = good_rollout(task)
        if task.example_id == EASY_EXAMPLE:
            for sample in rollout.samples:
                sample.reward = 1.0
        return rollout


@pytest.fixture
async def run(nats_server, tmp_path):
    """(config factory, bus, answers): a run with four prompts and a worker and trainer around
    whatever coordinator the test serves."""
    run_id = f"diff_{uuid.uuid4().hex[:8]}"

    def config(**overrides):
        return make_config(
            nats_server,
            run_id,
            output_dir=str(tmp_path),
            env=[{"id": "reverse-text", "args": {"num_train": 4}}],
            **overrides,
        )

    bus = await Bus.connect(config().bus, run_id=run_id, storage_dir=tmp_path / run_id, name="t")
    answers = Answers()
    worker = AnsweringWorker(bus, answers)
    stop = asyncio.Event()
    try:
        async with worker.consumer:
            trainer = asyncio.create_task(apply_weights_after_each_batch(bus, stop))
            yield config, bus, answers
            stop.set()
            await trainer
    finally:
        await bus.close()


async def test_a_prompt_always_solved_is_skipped_and_the_step_metrics_count_it(run):
    config, bus, answers = run
    skip_steps = 100
    filtering = {"enabled": True, "consecutive": 2, "skip_steps": skip_steps}
    await asyncio.wait_for(serve(config(max_steps=6, difficulty_filter=filtering)), 60)

    state = await read_saved_state(bus)
    streak, skip_until = state.prompts["reverse-text"][str(EASY_EXAMPLE)]
    assert streak == 2 and skip_until > skip_steps
    skipped_at = skip_until - skip_steps
    easy_steps = [step for step, example in answers.tasks if example == EASY_EXAMPLE]
    assert len(easy_steps) >= 2 and max(easy_steps) <= skipped_at
    later = {example for step, example in answers.tasks if step > skipped_at}
    assert later and EASY_EXAMPLE not in later  # the run went on with the other three
    rows = [(await bus.step_log.read(step)).metrics for step in range(1, 7)]
    assert rows[-1]["difficulty/skipped_easy"] == 1 and rows[-1]["difficulty/skipped_hard"] == 0
    assert sum(r["difficulty/skips"] for r in rows) == state.skipped > 0
    assert rows[-1]["tasks/skipped"] == state.skipped
    assert state.accounting()["unaccounted"] == 0


async def test_a_restarted_coordinator_keeps_the_history_and_skips_until_the_same_step(run):
    config, bus, answers = run
    skip_steps = 7
    filtering = {"enabled": True, "consecutive": 2, "skip_steps": skip_steps}
    first = config(max_steps=5, difficulty_filter=filtering, filter_zero_advantage=True)
    await asyncio.wait_for(serve(first), 60)
    stopped = await read_saved_state(bus)
    _, skip_until = stopped.prompts["reverse-text"][str(EASY_EXAMPLE)]
    assert skip_until > stopped.next_step == 6  # still skipped when the second one starts
    num_before = len(answers.tasks)

    last = skip_until + 3
    second = first.model_copy(update={"max_steps": last})
    await asyncio.wait_for(serve(second), 90)

    resumed = answers.tasks[num_before:]
    easy_steps = [step for step, example in resumed if example == EASY_EXAMPLE]
    assert easy_steps and min(easy_steps) >= skip_until  # skipped until that step, no longer
    assert any(step < skip_until for step, _ in resumed)
    for step in range(6, skip_until):  # from the restarted coordinator's first step on
        assert (await bus.step_log.read(step)).metrics["difficulty/skipped_easy"] == 1
    state = await read_saved_state(bus)
    # eligible again, its streak started from nothing (two more solved visits skip it anew)
    streak, until = state.prompts["reverse-text"][str(EASY_EXAMPLE)]
    assert (streak, until) == (1, 0) or (streak == 2 and until > skip_until)
    assert state.skipped > stopped.skipped and state.accounting()["unaccounted"] == 0
