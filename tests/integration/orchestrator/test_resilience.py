"""A real coordinator on a real nats-server, with stand-ins for the worker and the trainer
(orch_support.py): it rides out a NATS stall, a SIGKILL + restart with the same command continues
the run (no step twice, none skipped, every task accounted), and poison rollouts are quarantined
while batching goes on."""

import asyncio
import json
import os
import signal
import uuid

import pytest
from orch_support import (
    AnsweringWorker,
    apply_weights_after_each_batch,
    cli_args,
    good_rollout,
    kill,
    make_config,
    start,
    wait_for_batch,
    wait_for_log,
)

from rlbus.bus import Bus
from rlbus_orchestrator.service import serve
from rlbus_orchestrator.state_store import read_saved_state


@pytest.fixture
async def client(nats_server, tmp_path):
    run_id = f"res_{uuid.uuid4().hex[:8]}"
    config = make_config(nats_server, run_id)
    bus = await Bus.connect(
        config.bus.model_copy(update={"publish_retry_s": 60.0}),
        run_id=run_id,
        storage_dir=tmp_path / run_id,
        name="test",
    )
    try:
        yield config, bus
    finally:
        await bus.close()


@pytest.mark.parametrize("stall_s", [10.0, pytest.param(30.0, marks=pytest.mark.slow)])
async def test_issue_loop_rides_out_a_nats_stall_that_starts_while_it_issues(
    nats_server, client, tmp_path, stall_s
):
    config, bus = client
    loop = asyncio.get_running_loop()
    stalled = asyncio.Event()

    def stall_when_step_4_may_start(version: int) -> None:
        # The coordinator is about to save its state and publish step 4's tasks: freeze the
        # server under it (the reported death: the state save timed out and killed issue_tasks).
        if version == 3 and not stalled.is_set():
            os.kill(nats_server.pid, signal.SIGSTOP)
            stalled.set()
            loop.call_later(stall_s, os.kill, nats_server.pid, signal.SIGCONT)

    worker = AnsweringWorker(bus)
    stop = asyncio.Event()
    proc = start(cli_args(config, tmp_path), tmp_path / "coordinator.log")
    try:
        async with worker.consumer:
            trainer = asyncio.create_task(
                apply_weights_after_each_batch(bus, stop, on_applied=stall_when_step_4_may_start)
            )
            await wait_for_batch(bus, 8, 120 + stall_s, [proc])
            stop.set()
            await trainer
        assert stalled.is_set()
        batches = [await bus.step_log.read(step) for step in range(1, 9)]
        assert [b.step for b in batches] == list(range(1, 9))
        task_ids = [t for b in batches for t in b.task_ids]
        assert len(task_ids) == len(set(task_ids)), "a task was trained twice"
        assert proc.poll() is None, "the coordinator died during the stall"
    finally:
        os.kill(nats_server.pid, signal.SIGCONT)  # never leave the server frozen
        kill(proc)
    log_text = (tmp_path / "coordinator.log").read_text()
    assert "service_task_failed" not in log_text


async def test_coordinator_sigkilled_and_restarted_with_its_command_continues_the_run(
    client, tmp_path
):
    config, bus = client
    config = config.model_copy(update={"max_steps": 10})
    args = cli_args(config, tmp_path)
    worker = AnsweringWorker(bus)
    stop = asyncio.Event()
    first = start(args, tmp_path / "coordinator1.log")
    second = None
    try:
        async with worker.consumer:
            trainer = asyncio.create_task(apply_weights_after_each_batch(bus, stop))
            await wait_for_batch(bus, 4, 60, [first])
            kill(first)  # SIGKILL mid-run: tasks in flight, rollouts pooled and unacked
            second = start(args, tmp_path / "coordinator2.log")  # the same command
            await wait_for_batch(bus, 10, 120, [second])
            assert second.wait(30) == 0
            stop.set()
            await trainer
        batches = [await bus.step_log.read(step) for step in range(1, 11)]
        assert [b.step for b in batches] == list(range(1, 11))
        assert await bus.step_log.read(11) is None
        task_ids = [t for b in batches for t in b.task_ids]
        assert len(task_ids) == len(set(task_ids)), "a task was trained twice"
        state = await read_saved_state(bus)
        assert state.next_step == 11
        accounting = state.accounting()
        assert accounting["unaccounted"] == 0, accounting
        assert accounting["trained"] == len(task_ids), accounting
    finally:
        kill(first)
        if second is not None:
            kill(second)
    loaded = [
        json.loads(line)
        for line in (tmp_path / "coordinator2.log").read_text().splitlines()
        if '"coordinator_state_loaded"' in line
    ]
    assert loaded and loaded[0]["next_step"] >= 4


async def test_a_second_coordinator_is_a_standby_and_takes_over_when_the_first_is_killed(
    client, tmp_path
):
    """`--scale orchestrator=2`: one coordinator per run. The second waits (issues nothing) and
    continues the run when the first is SIGKILLed: every step once, no task trained twice."""
    config, bus = client
    config = config.model_copy(update={"max_steps": 8})
    args = cli_args(config, tmp_path)
    worker = AnsweringWorker(bus)
    stop, go = asyncio.Event(), asyncio.Event()
    go.set()
    first = start(args, tmp_path / "coordinator1.log")
    second = None
    try:
        async with worker.consumer:
            trainer = asyncio.create_task(apply_weights_after_each_batch(bus, stop, go=go))
            await wait_for_batch(bus, 2, 60, [first])
            go.clear()  # the run waits for weights: it cannot end before the second is standby
            second = start(args, tmp_path / "coordinator2.log")
            await wait_for_log(tmp_path / "coordinator2.log", "coordinator_standby", 60, second)
            go.set()
            kill(first)
            await wait_for_batch(bus, 8, 120, [second])
            assert second.wait(30) == 0
            stop.set()
            await trainer
        batches = [await bus.step_log.read(step) for step in range(1, 9)]
        assert [b.step for b in batches] == list(range(1, 9))
        task_ids = [t for b in batches for t in b.task_ids]
        assert len(task_ids) == len(set(task_ids)), "a task was trained twice"
        assert (await read_saved_state(bus)).accounting()["unaccounted"] == 0
    finally:
        kill(first)
        if second is not None:
            kill(second)
    events = [json.loads(line).get("event") for line in (tmp_path / "coordinator2.log").open()]
    assert events.index("coordinator_standby") < events.index("coordinator_leader")


def poison_every_third_task(task):
    """A good rollout, except for every third task: logprobs shorter than the tokens (packing
    would fail on it and, redelivered, stall batching forever)."""
    rollout = good_rollout(task)
    if int(task.task_id.split("-")[1]) % 3 == 1:
        rollout.samples[0].completion_logprobs = [-0.1]
    return rollout


async def test_poison_rollouts_are_quarantined_and_accounted_and_batching_goes_on(
    nats_server, client, tmp_path
):
    config, bus = client
    config = config.model_copy(update={"max_steps": 4, "output_dir": str(tmp_path)})
    worker = AnsweringWorker(bus, answer=poison_every_third_task)
    stop = asyncio.Event()
    async with worker.consumer:
        trainer = asyncio.create_task(apply_weights_after_each_batch(bus, stop))
        try:
            await asyncio.wait_for(serve(config), 90)  # returns at max_steps
        finally:
            stop.set()
            await trainer
    batches = [await bus.step_log.read(step) for step in range(1, 5)]
    task_ids = [t for b in batches for t in b.task_ids]
    poisoned = [t for t in worker.received if int(t.split("-")[1]) % 3 == 1]
    assert poisoned and not set(poisoned) & set(task_ids), "a poison rollout was trained"
    state = await read_saved_state(bus)
    assert state.dropped.get("invalid", 0) >= len(poisoned) - len(state.outstanding)
    assert state.accounting()["unaccounted"] == 0 and state.trained == len(task_ids)
    # Each quarantined rollout is in the dead-letter stream with its reason, once.
    sub = await bus.js.subscribe(bus.subjects.dead_all, stream=bus.subjects.dead_stream)
    reasons = []
    try:
        while True:
            msg = await sub.next_msg(timeout=2)
            reasons.append((msg.headers or {}).get("Rlbus-Dead-Reason", ""))
    except Exception:
        pass
    finally:
        await sub.unsubscribe()
    assert len(reasons) == state.dropped["invalid"]
    assert all("completion tokens" in r and "logprobs" in r for r in reasons)
    # Nothing left to redeliver: the rollouts consumer has no pending or unacked messages.
    info = await bus.js.consumer_info(bus.subjects.rollouts_stream, bus.subjects.rollouts_durable)
    assert info.num_pending == 0 and info.num_ack_pending == 0
