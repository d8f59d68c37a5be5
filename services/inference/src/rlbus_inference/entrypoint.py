"""`inference`: parse InferenceConfig, then the service shell (rlbus.lifecycle) runs the replica.

    inference --vllm.model <dir> [--vllm.<any vLLM option> ...] [--server.port 8000]
    inference @ examples/reverse-text/rl.toml [--server.port 8000]   # an `rl` config's server

An `rl` config file (one with `[inference]` or other `rl`-only tables) serves what `rl @ file`
would start: its `[inference]` table plus the model, dtype and seq_len the launcher pushes down,
so a run started with `rl @ file --inference.attach` finds the engine it expects.

Unknown `--vllm.*` options pass through to vLLM. vLLM and torch are imported by
`rlbus_inference.service`, after parsing, so `--help` and config errors are instant.
"""

import os
import sys
import tempfile
import tomllib
from pathlib import Path

from rlbus import lifecycle
from rlbus.configs import InferenceConfig
from rlbus.configs.base import parse_cli
from rlbus.configs.inference import attach_url_flags
from rlbus.configs.paths import exit_if_paths_missing
from rlbus.rundirs import run_id_of, slug

SLURM_SUBMIT = "rlbus_launch.slurm"
"""`inference --slurm` hands its argv to this module (by exec, not import: no service imports a
launcher); it renders and submits the replica's sbatch script (docs/slurm.md)."""


def log_name(config: InferenceConfig) -> str:
    """`inference`, or `inference-<replica>` when the launcher numbered the replicas."""
    return "inference" if config.replica_id is None else f"inference-{slug(config.replica_id)}"


def rl_file_index(args: list[str]) -> int | None:
    """Index of the file in `args` (`@ file` at the root) that is an `rl` config, or None."""
    from rlbus.configs import RLConfig

    own = set(InferenceConfig.model_fields)
    rl_only = set(RLConfig.model_fields) - own
    for i, token in enumerate(args[:-1]):
        if token != "@" or (i > 0 and args[i - 1].startswith("--")):
            continue
        try:
            keys = set(tomllib.loads(Path(args[i + 1]).read_text()))
        except (OSError, tomllib.TOMLDecodeError):
            continue  # parse_cli reports it
        if keys & rl_only:
            return i + 1
    return None


def parse_args(argv: list[str] | None) -> InferenceConfig:
    """The config of `argv`; an `rl` config file stands for its resolved `inference` part (as the
    launcher would write it, without `attach`: this process is the server)."""
    args = attach_url_flags(list(sys.argv[1:] if argv is None else argv), "--attach")
    index = rl_file_index(args)
    if index is None:
        return parse_cli(InferenceConfig, args, prog="inference")
    from rlbus.configs import RLConfig
    from rlbus.configs.base import config_to_toml

    inference = parse_cli(RLConfig, ["@", args[index]], prog="inference").inference
    inference.attach = None
    with tempfile.TemporaryDirectory(prefix="rlbus-inference-") as folder:
        resolved = Path(folder) / "inference.toml"
        resolved.write_text(config_to_toml(inference))
        args[index] = str(resolved)
        return parse_cli(InferenceConfig, args, prog="inference")


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    if config.slurm is not None:  # submit a batch job instead of serving: the launcher's job
        args = sys.argv[1:] if argv is None else argv
        os.execv(sys.executable, [sys.executable, "-m", SLURM_SUBMIT, *args])
    exit_if_paths_missing(config)
    lifecycle.main(
        log_name(config),
        config,
        "rlbus_inference.service",
        command="inference",
        run_dir=config.run_dir,
        run_id=run_id_of(config.bus.run_id, run_dir=config.run_dir),
    )


if __name__ == "__main__":  # vLLM spawns its engine process: keep the guard
    main()
