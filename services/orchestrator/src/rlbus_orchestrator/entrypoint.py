"""`orchestrator`: parse OrchestratorConfig, set up logging, start the coordinator and workers.

    orchestrator @ orchestrator.toml --run.name <run> --bus.url nats://host:4222

Started by `rl` with the resolved config from the run directory; by hand, pass `--run.name`
(and the bus) of the run to join.
"""

from rlbus.configs import OrchestratorConfig
from rlbus.configs.base import parse_cli
from rlbus.launch.entry import ensure_run_name, load_service_run
from rlbus.obs.logging import setup_logging


def main(argv: list[str] | None = None) -> None:
    config = parse_cli(OrchestratorConfig, argv, prog="orchestrator")
    run_dir = ensure_run_name(config, "orchestrator")
    service = "orchestrator" if config.role != "worker" else "orchestrator-worker"
    setup_logging(
        service,
        run_dir=run_dir,
        run_id=config.bus.run_id or config.run.name,
        level=config.log.level,
        json_console=config.log.json_console,
    )
    run = load_service_run("rlbus_orchestrator.service", command="orchestrator")
    run(config)


if __name__ == "__main__":
    main()
