"""`[slurm]`: run `rl`, `sft` or `inference` as a SLURM batch job instead of on this host.

A `[slurm]` table in the TOML, or the bare `--slurm` flag, turns it on (like `--monitors.wandb`):
the launcher then resolves every config as `--dry-run` would, renders
`<run_dir>/slurm/<name>.sbatch` and submits it with `sbatch` (docs/slurm.md).
"""

from pydantic import Field, model_validator

from rlbus.configs.base import BaseConfig, field_errors


class SlurmConfig(BaseConfig):
    """The batch job: its allocation, its setup, and how it ends (drain on SIGTERM)."""

    job_name: str | None = None
    """`#SBATCH --job-name` (default: the command, e.g. `rl`, and the run name)."""

    partition: str | None = None
    """`#SBATCH --partition` (default: the cluster's default partition)."""

    account: str | None = None
    """`#SBATCH --account`."""

    time: str | None = None
    """`#SBATCH --time` limit, e.g. "04:00:00" or "1-00:00:00" (default: the partition's)."""

    nodes: int = Field(1, ge=1)
    """Nodes of the job. `rl`: 1 runs everything on one node; more splits them into
    `inference_nodes` and trainer nodes. `sft`: one torchrun agent per node. `inference`: one
    replica per node."""

    gpus_per_node: int = Field(0, ge=0)
    """`#SBATCH --gpus-per-node` (0: no GPUs are requested, the services run on CPUs)."""

    inference_nodes: int = Field(1, ge=1)
    """`rl` with nodes > 1: the first this many nodes run inference (the first also NATS, the
    orchestrator and the monitor); the other nodes run one multi-node torchrun."""

    inference_gpus: int | None = Field(None, ge=1)
    """`rl`: the older spelling of `deployment.num_infer_gpus` (GPUs for inference, split into
    replicas of `vllm.tensor_parallel_size`; docs/launcher.md, "GPUs"). Ignored when
    gpus_per_node is 0."""

    exclusive: bool = True
    """`#SBATCH --exclusive`: the job has its nodes to itself (the services size themselves to the
    whole node)."""

    directives: list[str] = []
    """More `#SBATCH` lines, written as given, e.g. ["--qos=high", "--mem=0"]."""

    setup: list[str] = []
    """Shell lines run on the first node before any service starts, e.g.
    ["module load cuda", "source .venv/bin/activate"]."""

    grace_s: int = Field(90, ge=1)
    """Drain time on SIGTERM: each group of services gets this long to exit by itself before it
    is killed; the job asks SLURM for the signal `grace_s` plus a margin before its time limit."""

    requeue: bool = False
    """`#SBATCH --requeue` (else `--no-requeue`): a requeued job resumes the same run (same run
    directory and NATS store; needs `[ckpt]`)."""

    nats_port: int = Field(4222, ge=1, le=65535)
    """Client port of the NATS sidecar on the first node (used when bus.url is unset)."""

    nats_http_port: int = Field(8222, ge=1, le=65535)
    """Monitoring port of the NATS sidecar (its health check)."""

    rdzv_port: int = Field(29500, ge=1, le=65535)
    """torchrun c10d rendezvous port on the first trainer node (multi-node only)."""

    submit: bool = True
    """Submit the script with sbatch (`--no-slurm.submit`, or `--dry-run` on rl/sft: only write it)."""

    @model_validator(mode="after")
    def _sidecar_ports_differ(self) -> "SlurmConfig":
        """The NATS sidecar listens on both ports on the first node."""
        if self.nats_port == self.nats_http_port:
            raise field_errors(
                self,
                (
                    "nats_http_port",
                    f"must differ from slurm.nats_port ({self.nats_port}): the NATS sidecar "
                    "listens on both on the first node",
                ),
            )
        return self
