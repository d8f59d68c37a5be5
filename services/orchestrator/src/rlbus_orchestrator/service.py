"""`orchestrator` service body: `run(config)` starts the coordinator and/or rollout workers.

Roles (`--role`):
- `all` (default): the coordinator plus `num_workers` in-process rollout workers;
- `coordinator`: the coordinator alone (workers run elsewhere);
- `worker`: `num_workers` standalone rollout workers; start N such processes to scale out, they
  share one durable consumer of the tasks stream.

Environments are resolved before connecting to the bus, so a missing environment package fails
at once with the install command. Signals and control requests on `control.orchestrator` reach
the `ServiceState` of the service shell (rlbus.lifecycle); docs/orchestrator.md has the semantics:
- SIGTERM/SIGINT and `Drain`: stop issuing, let in-flight rollouts come back and be batched, exit 0;
- `Stop`: exit now (in-flight tasks and pooled rollouts are redelivered to the next orchestrator);
- `Pause`/`Resume`: the coordinator stops/restarts issuing tasks; workers finish what was issued.
"""

import asyncio

import structlog

from rlbus.bus.client import Bus
from rlbus.configs.orchestrator import OrchestratorConfig
from rlbus.lifecycle import (
    ServiceState,
    TaskSupervisor,
    control_handler,
    drain_when_finished,
    run_service,
)
from rlbus.rundirs import run_dir_of, run_id_of
from rlbus.wire.events import Lifecycle
from rlbus_orchestrator.coordinator import Coordinator
from rlbus_orchestrator.envs import EnvironmentNotFoundError, load_environment
from rlbus_orchestrator.leader import become_leader, watch_lease
from rlbus_orchestrator.metrics import poll_stream_stats
from rlbus_orchestrator.worker import run_workers

log = structlog.get_logger()


def require_run_id(config: OrchestratorConfig) -> str:
    """The run id (rlbus.rundirs.run_id_of); the orchestrator cannot run without one."""
    run_id = run_id_of(config.bus.run_id, config.run.name)
    if not run_id:
        raise ValueError(
            "the orchestrator needs a run id: pass --run.name NAME (or --bus.run-id ID)"
        )
    return run_id


def run(config: OrchestratorConfig) -> None:
    """Run the orchestrator until `max_steps` batches are published (role all/coordinator) or a signal."""
    try:
        run_service("orchestrator", lambda state: serve(config, state))
    except EnvironmentNotFoundError as error:
        raise SystemExit(f"orchestrator: {error}") from None


async def serve(config: OrchestratorConfig, state: ServiceState | None = None) -> None:
    """The service body; without `state` (tests, benchmarks) it runs until `max_steps`."""
    for env in config.env:
        load_environment(env.id, env.args)
    run_id = require_run_id(config)
    run_dir = run_dir_of(config) if config.run.name else None
    state = state or ServiceState("orchestrator")
    bus = await Bus.connect(
        config.bus, run_id=run_id, storage_dir=run_dir, name=f"orchestrator-{config.role}"
    )
    lifecycle = bus.subjects.lifecycle("orchestrator")
    try:
        pausable = config.role in ("all", "coordinator")
        await bus.serve_control("orchestrator", control_handler(state, pausable=pausable))
        await bus.publish(
            lifecycle, Lifecycle(service="orchestrator", state="started", instance_id=config.role)
        )
        await run_roles(bus, config, state)
        await bus.publish(
            lifecycle,
            Lifecycle(
                service="orchestrator",
                state="stopped",
                instance_id=config.role,
                reason=state.reason or "max_steps",
            ),
        )
    finally:
        await bus.close()


async def run_roles(bus: Bus, config: OrchestratorConfig, state: ServiceState) -> None:
    """The workers and/or the coordinator of `config.role`, until they end or a stop request."""
    workers_stop = asyncio.Event()
    async with TaskSupervisor() as tasks:
        watchers = []  # end with the service: cancelled before the join below
        if config.exit_when_finished:
            watchers.append(tasks.spawn("finish_watch", drain_when_finished(bus, state)))
        if config.role in ("all", "worker"):
            tasks.spawn("rollout_workers", start_workers(bus, config, state, workers_stop))
        if config.role in ("all", "coordinator"):
            # queue depth and consumer lag for Prometheus (never raises)
            watchers.append(tasks.spawn("stream_stats", poll_stream_stats(bus)))
            await coordinate_while_leader(tasks, bus, config, state)
        else:
            await tasks.wait(state.stop_requested)
        workers_stop.set()
        for watcher in watchers:
            watcher.cancel()
        await tasks.join()


async def start_workers(
    bus: Bus, config: OrchestratorConfig, state: ServiceState, stop: asyncio.Event
) -> None:
    await run_workers(
        bus,
        num_workers=config.num_workers,
        max_concurrency=config.max_concurrency,
        group_size=min(config.env_group_size(env) for env in config.env),
        model=config.model.name,
        static_urls=config.inference_urls,
        stop=stop,
        state=state,
        http_config=config.http,
        eval_concurrency=config.eval.max_concurrency if config.eval is not None else None,
    )


async def coordinate_while_leader(
    tasks: TaskSupervisor, bus: Bus, config: OrchestratorConfig, state: ServiceState
) -> None:
    """Wait as a standby until this process holds the run's leader lease (or is asked to stop),
    then run the coordinator while the lease is ours; release it at the end, so a standby takes
    over at once (and finds the run done)."""
    leader = tasks.spawn("coordinator_leader", become_leader(bus, config.leader_ttl_s, state))
    await tasks.wait(leader)
    lease = leader.result()
    if lease is None:
        return
    lease_watch = tasks.spawn("leader_lease", watch_lease(lease))
    coordinator = tasks.spawn("coordinator", Coordinator(bus, config).run(state))
    await tasks.wait(coordinator)
    lease_watch.cancel()
    await lease.release()
