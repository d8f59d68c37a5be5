"""`--exit-when-finished` on the orchestrator, as real processes on a real nats-server: once the
trainer marks the run finished, a rollout-worker process and a standby coordinator (a scaled
`orchestrator`) drain and exit 0 by themselves, so a compose stack or a SLURM job ends."""

import subprocess
import uuid

from orch_support import cli_args, kill, make_config, start, wait_for_log

from rlbus.bus import Bus
from rlbus.wire import run
from rlbus.wire.subjects import COORDINATOR_LEADER_KEY


async def connect(nats_server, tmp_path, run_id: str) -> Bus:
    config = make_config(nats_server, run_id)
    return await Bus.connect(config.bus, run_id=run_id, storage_dir=tmp_path, name="test")


def exit_code(proc: subprocess.Popen, timeout_s: float) -> int:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running {timeout_s}s after the run finished") from None


async def test_a_worker_process_exits_0_once_the_run_is_finished(nats_server, tmp_path):
    run_id = f"end_{uuid.uuid4().hex[:8]}"
    bus = await connect(nats_server, tmp_path, run_id)
    config = make_config(nats_server, run_id, role="worker")
    log = tmp_path / "worker.log"
    proc = start(cli_args(config, tmp_path) + ["--exit-when-finished"], log)
    try:
        await wait_for_log(log, "consumer_started", 60, proc)
        assert await bus.run_finished() is None
        await bus.mark_finished(last_step=3)
        assert exit_code(proc, 30) == 0
        assert '"run_finished_seen"' in log.read_text()
    finally:
        kill(proc)
        await bus.close()


async def test_a_standby_coordinator_exits_0_once_the_run_is_finished(nats_server, tmp_path):
    run_id = f"end_{uuid.uuid4().hex[:8]}"
    bus = await connect(nats_server, tmp_path, run_id)
    leader = run.CoordinatorLeader(host="elsewhere", pid=1)
    lease = bus.lease(
        bus.subjects.state_bucket, COORDINATOR_LEADER_KEY, run.encoder.encode(leader), ttl_s=60
    )
    await lease.acquire()
    config = make_config(nats_server, run_id, role="all")
    log = tmp_path / "standby.log"
    proc = start(cli_args(config, tmp_path) + ["--exit-when-finished"], log)
    try:
        await wait_for_log(log, "coordinator_standby", 60, proc)
        await bus.mark_finished(last_step=3)
        assert exit_code(proc, 30) == 0
        assert '"coordinator_leader"' not in log.read_text()  # it never coordinated
    finally:
        kill(proc)
        await lease.release()
        await bus.close()
