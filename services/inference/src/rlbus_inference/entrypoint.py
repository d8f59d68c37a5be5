"""`inference`: parse InferenceConfig, set up logging, start the inference service.

    inference --vllm.model <dir> [--vllm.<any vLLM option> ...] [--server.port 8000]

Unknown `--vllm.*` options pass through to vLLM. vLLM and torch are imported by
`rlbus_inference.service`, after parsing, so `--help` and config errors are instant.
"""

from rlbus.configs import InferenceConfig
from rlbus.configs.base import parse_cli
from rlbus.launch.entry import load_service_run
from rlbus.obs.logging import setup_logging
from rlbus.runs import slug


def log_name(config: InferenceConfig) -> str:
    """`inference`, or `inference-<replica>` when the launcher numbered the replicas."""
    return "inference" if config.replica_id is None else f"inference-{slug(config.replica_id)}"


def main(argv: list[str] | None = None) -> None:
    config = parse_cli(InferenceConfig, argv, prog="inference")
    setup_logging(
        log_name(config),
        run_dir=config.run_dir,
        run_id=config.bus.run_id,
        level=config.log.level,
        json_console=config.log.json_console,
    )
    run = load_service_run("rlbus_inference.service", command="inference")
    run(config)


if __name__ == "__main__":  # vLLM spawns its engine process: keep the guard
    main()
