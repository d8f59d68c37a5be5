"""`inference`: parse InferenceConfig, then the service shell (rlbus.runtime) runs the replica.

    inference --vllm.model <dir> [--vllm.<any vLLM option> ...] [--server.port 8000]

Unknown `--vllm.*` options pass through to vLLM. vLLM and torch are imported by
`rlbus_inference.service`, after parsing, so `--help` and config errors are instant.
"""

import os
import sys

from rlbus import runtime
from rlbus.configs import InferenceConfig
from rlbus.configs.base import parse_cli
from rlbus.configs.paths import exit_if_paths_missing
from rlbus.runs import run_id_of, slug

SLURM_SUBMIT = "rlbus.launch.slurm"
"""`inference --slurm` hands its argv to this module (by exec, not import: no service imports a
launcher); it renders and submits the replica's sbatch script (docs/slurm.md)."""


def log_name(config: InferenceConfig) -> str:
    """`inference`, or `inference-<replica>` when the launcher numbered the replicas."""
    return "inference" if config.replica_id is None else f"inference-{slug(config.replica_id)}"


def main(argv: list[str] | None = None) -> None:
    config = parse_cli(InferenceConfig, argv, prog="inference")
    if config.slurm is not None:  # submit a batch job instead of serving: the launcher's job
        args = sys.argv[1:] if argv is None else argv
        os.execv(sys.executable, [sys.executable, "-m", SLURM_SUBMIT, *args])
    exit_if_paths_missing(config)
    runtime.main(
        log_name(config),
        config,
        "rlbus_inference.service",
        command="inference",
        run_dir=config.run_dir,
        run_id=run_id_of(config.bus.run_id, run_dir=config.run_dir),
    )


if __name__ == "__main__":  # vLLM spawns its engine process: keep the guard
    main()
