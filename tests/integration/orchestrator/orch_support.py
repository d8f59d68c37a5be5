"""Stand-ins for the other services around a real coordinator (no vLLM, no trainer): a worker that
answers every task at once with a good rollout, and a trainer that "applies" each published batch's
weights. The coordinator under test is real, on a real nats-server; these are the thing around it."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from rlbus.configs.bus import BusConfig
from rlbus.configs.orchestrator import OrchestratorConfig
from rlbus.wire import replicas
from rlbus.wire import tasks as tasks_wire
from rlbus.wire import weights as weights_wire
from rlbus.wire.rollouts import Rollout, RolloutSample
from rlbus.wire.tasks import Task

ORCHESTRATOR = [sys.executable, "-c", "from rlbus_orchestrator.entrypoint import main; main()"]


def good_rollout(task: Task, policy_version: int | None = None) -> Rollout:
    """A valid rollout for `task`: rewards 0..group_size-1 (never zero advantage), sampled with
    `policy_version` (default: the version one step behind the task's step)."""
    version = max(0, task.step - 1) if policy_version is None else policy_version
    samples = [
        RolloutSample(
            prompt_token_ids=[1, 2],
            completion_token_ids=[3, 4],
            completion_logprobs=[-0.1, -0.1],
            completion_mask=[1, 1],
            reward=float(i),
            policy_version=version,
        )
        for i in range(task.group_size)
    ]
    return Rollout(task_id=task.task_id, step=task.step, env_id=task.env_id, samples=samples)


class AnsweringWorker:
    """Consumes the tasks stream and answers each task with `answer(task)` (a good rollout by
    default; return None to leave a task unanswered, acked)."""

    def __init__(self, bus, answer: Callable[[Task], Rollout | None] = good_rollout):
        self.bus = bus
        self.answer = answer
        self.received: list[str] = []
        s = bus.subjects
        self.consumer = bus.consumer(
            s.tasks_stream, s.tasks_durable, tasks_wire.decoder, self.handle, concurrency=16
        )

    async def handle(self, delivery) -> None:
        task = delivery.data
        self.received.append(task.task_id)
        if task.task_id.startswith("eval-"):
            return
        rollout = self.answer(task)
        if rollout is not None:
            await self.bus.publish(self.bus.subjects.rollouts, rollout, msg_id=task.task_id)


async def apply_weights_after_each_batch(
    bus,
    stop: asyncio.Event,
    poll_s: float = 0.2,
    on_applied: Callable[[int], None] | None = None,
    go: asyncio.Event | None = None,
) -> None:
    """The trainer + inference stand-in: once step N's batch is stored, version N is applied
    (then `on_applied(N)`, e.g. to stall the bus right when the coordinator starts issuing).
    While `go` is cleared nothing is applied, so the run cannot advance past async_level."""
    step = 1
    while not stop.is_set():
        if go is not None and not go.is_set():
            await asyncio.sleep(poll_s)
            continue
        try:
            batch = await bus.step_log.read(step)
        except Exception:  # the bus may be stalled on purpose
            batch = None
        if batch is None:
            await asyncio.sleep(poll_s)
            continue
        event = weights_wire.WeightsApplied(version=step, replica_id="stand-in")
        entry = replicas.ReplicaInfo(
            replica_id="stand-in", base_url="http://stand-in/v1", model="m", weights_version=step
        )
        try:  # like a replica: the registry entry (read on start) and the event (fast path)
            await bus.kv(bus.subjects.replicas_bucket).put("stand-in", entry)
            await bus.publish(bus.subjects.weights_applied, weights_wire.encoder.encode(event))
        except Exception:
            await asyncio.sleep(poll_s)
            continue
        if on_applied is not None:
            on_applied(step)
        step += 1


def cli_args(config: OrchestratorConfig, output_dir) -> list[str]:
    """The command line of a coordinator process for `config` (the fields these tests set)."""
    b = config.bus
    args = ["--bus.token", b.token] if b.token else []
    args += ["--run.name", config.run.name, "--output-dir", str(output_dir), "--bus.url", b.url]
    args += ["--bus.ack-wait-s", str(b.ack_wait_s), "--role", config.role]
    args += ["--batch-size", str(config.batch_size), "--group-size", str(config.group_size)]
    args += ["--async-level", str(config.async_level), "--seq-len", str(config.seq_len)]
    args += ["--max-off-policy-steps", str(config.max_off_policy_steps)]
    if config.max_steps is not None:
        args += ["--max-steps", str(config.max_steps)]
    if not config.filter_zero_advantage:
        args.append("--no-filter-zero-advantage")
    return args


def start(args: list[str], log_path) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen(
            ORCHESTRATOR + args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the process group this test started (by its PID)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def wait_for_batch(bus, step: int, timeout_s: float, procs=()):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            batch = await bus.step_log.read(step)
        except Exception:
            batch = None
        if batch is not None:
            return batch
        for p in procs:
            assert p.poll() is None, f"orchestrator exited with {p.returncode}"
        assert time.monotonic() < deadline, f"no batch for step {step} within {timeout_s}s"
        await asyncio.sleep(0.3)


async def wait_for_log(path, event: str, timeout_s: float, proc) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while f'"{event}"' not in path.read_text():
        assert proc.poll() is None, f"exited with {proc.returncode} before logging {event}"
        assert asyncio.get_running_loop().time() < deadline, f"no {event} within {timeout_s}s"
        await asyncio.sleep(0.3)


def make_config(server, run_id: str, **overrides) -> OrchestratorConfig:
    fields = dict(
        role="coordinator",
        run={"name": run_id},
        bus=BusConfig(url=server.url, token=server.token, run_id=run_id, ack_wait_s=3.0),
        batch_size=4,
        group_size=2,
        async_level=0,
        max_off_policy_steps=100,
        seq_len=64,
        filter_zero_advantage=False,
    )
    return OrchestratorConfig(**(fields | overrides))
