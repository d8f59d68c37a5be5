"""`orchestrator` service body: `run(config)` starts the coordinator and/or rollout workers.

Roles (`--role`):
- `all` (default): the coordinator plus `num_workers` in-process rollout workers;
- `coordinator`: the coordinator alone (workers run elsewhere);
- `worker`: `num_workers` standalone rollout workers; start N such processes to scale out, they
  share one durable consumer of the tasks stream.

Environments are resolved before connecting to the bus, so a missing environment package fails
at once with the install command. SIGTERM/SIGINT and a `Drain`/`Stop` control request on
`control.orchestrator` stop the service cleanly (see `coordinator` for the order).
"""

import asyncio
import signal

import structlog

from rlbus.configs.orchestrator import OrchestratorConfig

log = structlog.get_logger()


def run_id_of(config: OrchestratorConfig) -> str:
    run_id = config.bus.run_id or config.run.name
    if not run_id:
        raise ValueError(
            "the orchestrator needs a run id: pass --run.name NAME (or --bus.run-id ID)"
        )
    return run_id


def control_handler(stop: asyncio.Event):
    """Drain and Stop end the service (every orchestrator process of the run hears them)."""
    from rlbus.wire import control

    async def handle(request):
        if isinstance(request, control.Drain | control.Stop):
            log.info(
                "orchestrator_stop_requested", request=type(request).__name__, reason=request.reason
            )
            stop.set()
            return control.ControlReply(ok=True, service="orchestrator", state="draining")
        return control.ControlReply(
            ok=False, service="orchestrator", message=f"{type(request).__name__} is not supported"
        )

    return handle


def run(config: OrchestratorConfig) -> None:
    """Run the orchestrator until `max_steps` batches are published (role all/coordinator) or a signal."""
    from rlbus_orchestrator.envs import EnvironmentNotFoundError

    try:
        asyncio.run(serve(config))
    except EnvironmentNotFoundError as error:
        raise SystemExit(f"orchestrator: {error}") from None


async def serve(config: OrchestratorConfig, stop: asyncio.Event | None = None) -> None:
    from rlbus.bus.client import Bus
    from rlbus.obs import tracing
    from rlbus.runs import resolve_run_dir
    from rlbus.wire.events import Lifecycle
    from rlbus_orchestrator.coordinator import Coordinator
    from rlbus_orchestrator.envs import load_environment
    from rlbus_orchestrator.worker import run_workers

    for env in config.env:
        load_environment(env.id, env.args)
    run_id = run_id_of(config)
    run_dir = (
        resolve_run_dir(config.output_dir, config.run.name, config.run.dir)
        if config.run.name
        else None
    )
    tracing.setup_tracing(
        "orchestrator",
        run_dir=run_dir,
        endpoint=config.otel.endpoint,
        enabled=config.otel.enabled,
        run_id=run_id,
    )
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass
    bus = await Bus.connect(
        config.bus, run_id=run_id, storage_dir=run_dir, name=f"orchestrator-{config.role}"
    )
    lifecycle = bus.subjects.lifecycle("orchestrator")
    try:
        await bus.serve_control("orchestrator", control_handler(stop))
        await bus.publish(
            lifecycle, Lifecycle(service="orchestrator", state="started", instance_id=config.role)
        )
        workers_stop = asyncio.Event()
        jobs = []
        if config.role in ("all", "worker"):
            jobs.append(
                asyncio.create_task(
                    run_workers(
                        bus,
                        num_workers=config.num_workers,
                        max_concurrency=config.max_concurrency,
                        group_size=config.group_size,
                        model=config.model.name,
                        static_urls=config.inference_urls,
                        stop=workers_stop,
                    )
                )
            )
        if config.role in ("all", "coordinator"):
            await Coordinator(bus, config).run(stop)
        else:
            await stop.wait()
        workers_stop.set()
        await asyncio.gather(*jobs)
        await bus.publish(
            lifecycle, Lifecycle(service="orchestrator", state="stopped", instance_id=config.role)
        )
    finally:
        await bus.close()
        tracing.shutdown_tracing()
