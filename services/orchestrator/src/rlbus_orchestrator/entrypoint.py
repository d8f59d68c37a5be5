"""`orchestrator`: parse OrchestratorConfig, then the service shell (rlbus.lifecycle) runs the
coordinator and workers.

    orchestrator @ orchestrator.toml --run.name <run> --bus.url nats://host:4222

Started by `rl` with the resolved config from the run directory; by hand, pass `--run.name`
(and the bus) of the run to join.
"""

from rlbus import lifecycle
from rlbus.configs import OrchestratorConfig
from rlbus.configs.base import parse_cli
from rlbus.configs.paths import exit_if_paths_missing
from rlbus.rundirs import ensure_run_name, run_id_of


def main(argv: list[str] | None = None) -> None:
    config = parse_cli(OrchestratorConfig, argv, prog="orchestrator")
    exit_if_paths_missing(config)
    run_dir = ensure_run_name(config, "orchestrator")
    lifecycle.main(
        "orchestrator" if config.role != "worker" else "orchestrator-worker",
        config,
        "rlbus_orchestrator.service",
        command="orchestrator",
        run_dir=run_dir,
        run_id=run_id_of(config.bus.run_id, config.run.name),
    )


if __name__ == "__main__":
    main()
