"""The service shell (rlbus.lifecycle): control semantics, supervised tasks, signals, layering."""

import ast
import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlbus.lifecycle import ServiceState, TaskFailed, TaskSupervisor, control_handler
from rlbus.wire import control

REPO = Path(__file__).resolve().parents[2]


def handle(state: ServiceState, request, *, pausable: bool):
    return asyncio.run(control_handler(state, pausable=pausable)(request))


def test_pause_and_resume_toggle_issuing_only_where_supported():
    trainer = ServiceState("trainer")
    refused = handle(trainer, control.Pause(), pausable=False)
    assert not refused.ok and "Pause is not supported" in refused.message
    assert trainer.mode == "running"

    coordinator = ServiceState("orchestrator")
    assert handle(coordinator, control.Pause(reason="x"), pausable=True).state == "paused"
    assert not coordinator.unpaused.is_set() and not coordinator.ending
    assert handle(coordinator, control.Resume(), pausable=True).state == "running"
    assert coordinator.unpaused.is_set()


def test_drain_then_stop_escalates_and_a_stop_wakes_a_paused_service():
    state = ServiceState("orchestrator")
    woken = []
    state.listeners.append(lambda: woken.append(state.mode))
    handle(state, control.Pause(), pausable=True)

    assert handle(state, control.Drain(reason="user"), pausable=True).state == "draining"
    assert state.stop_requested.is_set() and state.unpaused.is_set() and not state.stop_now
    assert handle(state, control.Stop(), pausable=True).state == "stopping"
    assert state.stop_now and state.reason == "control stop:"
    handle(state, control.Drain(), pausable=True)
    assert state.mode == "stopping"  # a drain never softens a stop
    assert woken == ["draining"]  # listeners hear the first request only


def test_the_drain_budget_counts_from_the_first_request_and_a_stop_does_not_renew_it():
    state = ServiceState("orchestrator")
    assert state.left_of(25.0) == 25.0  # running: the whole budget is ahead
    state.drain("user")
    time.sleep(0.2)
    state.stop("later")
    left = state.left_of(25.0)
    assert 24.0 < left <= 24.8
    assert state.left_of(0.1) == 0.0  # spent: never negative


async def boom():
    await asyncio.sleep(0)
    raise RuntimeError("disk full")


async def test_the_first_failing_task_is_named_and_ends_the_wait():
    forever = asyncio.Event()
    with pytest.raises(TaskFailed) as failure:
        async with TaskSupervisor() as tasks:
            sleeper = tasks.spawn("sleeper", forever.wait())
            tasks.spawn("writer", boom())
            await tasks.wait(forever, timeout_s=5)
    assert failure.value.task == "writer" and "disk full" in str(failure.value)
    assert sleeper.cancelled()


async def test_a_nested_failure_keeps_the_innermost_task_name():
    async def component():
        async with TaskSupervisor() as inner:
            inner.spawn("weights_watch", boom())
            await inner.join()

    with pytest.raises(TaskFailed) as failure:
        async with TaskSupervisor() as outer:
            outer.spawn("weight_agent", component())
            await outer.join()
    assert failure.value.task == "weights_watch"


async def test_a_task_that_outlasts_its_cancel_is_named_before_it_is_waited_for(monkeypatch):
    from structlog.testing import capture_logs

    from rlbus import lifecycle

    monkeypatch.setattr(lifecycle, "SLOW_CANCEL_S", 0.05)

    async def stubborn():
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.shield(asyncio.sleep(0.2))  # cleanup that outlasts the cancel

    with capture_logs() as logs:
        async with TaskSupervisor() as tasks:
            slow = tasks.spawn("stubborn", stubborn())
            await asyncio.sleep(0)
    assert slow.cancelled()
    (warning,) = [e for e in logs if e["event"] == "tasks_slow_to_cancel"]
    assert warning["tasks"] == ["stubborn"] and "stubborn" in warning["stacks"][0]


async def test_join_returns_once_every_task_returned():
    async with TaskSupervisor() as tasks:
        done = [tasks.spawn(f"t{i}", asyncio.sleep(0.01 * i)) for i in range(3)]
        await tasks.join()
    assert all(t.done() and not t.cancelled() for t in done)


SERVICE = """
import asyncio, sys
from rlbus.obs.logging import setup_logging
from rlbus.lifecycle import TaskSupervisor, run_service

setup_logging("demo", json_console=True)

async def failing():
    await asyncio.sleep(0.05)
    raise ValueError("bad frame")

async def body(state):
    mode = sys.argv[1]
    print("ready", flush=True)
    if mode == "task":
        async with TaskSupervisor() as tasks:
            tasks.spawn("weights_loop", failing())
            await tasks.wait(state.stop_requested)
    await state.stop_requested.wait()
    if mode == "stuck":
        await asyncio.Event().wait()  # a drain that never ends
    print("drained", state.reason, flush=True)

run_service("demo", body)
"""


def start_service(tmp_path, mode: str) -> subprocess.Popen:
    script = tmp_path / "service.py"
    script.write_text(SERVICE)
    proc = subprocess.Popen(
        [sys.executable, str(script), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def events(stderr: str) -> list[dict]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def finish(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_failing_task_ends_the_service_with_one_line_and_exit_1(tmp_path):
    proc = start_service(tmp_path, "task")
    out, err = finish(proc)

    assert proc.returncode == 1
    (line,) = [e for e in events(err) if e["level"] == "error"]
    assert line["event"] == "service_task_failed" and line["task"] == "weights_loop"
    assert line["error"] == "ValueError: bad frame" and "in failing" in line["where"]
    assert "Traceback" not in err and "drained" not in out


def test_first_signal_drains_and_exits_0(tmp_path):
    proc = start_service(tmp_path, "drain")
    proc.send_signal(signal.SIGTERM)
    out, err = finish(proc)

    assert proc.returncode == 0, err
    assert "drained signal SIGTERM" in out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_second_signal_exits_now_with_128_plus_signum(tmp_path, sig):
    proc = start_service(tmp_path, "stuck")
    proc.send_signal(sig)
    deadline = time.monotonic() + 10
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.3)  # the first signal was handled: the body is stuck draining
        proc.send_signal(sig)
    out, err = finish(proc)

    assert proc.returncode == 128 + sig
    assert "second_signal_exit_now" in err and "drained" not in out


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_service_imports_the_launchers():
    offenders = {
        str(path.relative_to(REPO)): sorted(
            n
            for n in imported_modules(path)
            if n == "rlbus_launch" or n.startswith("rlbus_launch.")
        )
        for path in (REPO / "services").rglob("*.py")
    }
    assert {path: names for path, names in offenders.items() if names} == {}


FOREIGN_LOOP = """
import asyncio
from rlbus.obs.logging import setup_logging
from rlbus.lifecycle import terminate_on_failure

setup_logging("engine", json_console=True)

async def listener():
    raise OSError("address already in use")

async def server():  # an event loop the shell does not own, like vLLM's API server
    terminate_on_failure(asyncio.get_running_loop().create_task(listener()), "gate_listener")
    await asyncio.sleep(30)

asyncio.run(server())
"""


def test_a_failed_task_in_a_foreign_loop_terminates_the_process_with_one_line(tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(FOREIGN_LOOP)
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=30
    )

    assert result.returncode == -signal.SIGTERM
    (line,) = [e for e in events(result.stderr) if e["level"] == "error"]
    assert line["task"] == "gate_listener" and "address already in use" in line["error"]


async def test_a_task_that_swallows_its_cancel_is_cancelled_again_and_close_returns(monkeypatch):
    from rlbus import lifecycle

    monkeypatch.setattr(lifecycle, "SLOW_CANCEL_S", 0.05)
    swallowed = []

    async def swallows_once():
        while True:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                if swallowed:  # the second cancel ends it
                    raise
                swallowed.append(True)  # as a library that turns a cancel into another error
                asyncio.current_task().uncancel()

    async def supervise() -> asyncio.Task:
        async with TaskSupervisor() as tasks:
            task = tasks.spawn("swallows_once", swallows_once())
            await asyncio.sleep(0)
        return task

    stubborn = await asyncio.wait_for(supervise(), 5)  # close() returns: no wait forever
    assert swallowed == [True] and stubborn.cancelled()
