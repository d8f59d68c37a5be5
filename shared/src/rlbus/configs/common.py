"""Config pieces shared by several services: model, run directory, checkpoints, monitors, logs,
and the blocks of top-level fields every runnable config inherits (`ServiceConfig`,
`RunnableConfig`, `TrainingRunConfig`)."""

from typing import Literal

from pydantic import AliasChoices, ByteSize, Field

from rlbus.configs.base import BaseConfig
from rlbus.configs.bus import BusConfig


class ModelConfig(BaseConfig):
    """The model being trained and served."""

    name: str = "Qwen/Qwen3-0.6B"
    """HF model id or local model directory (no hub is needed when this is a local path)."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype used by the trainer and requested from vLLM."""

    trust_remote_code: bool = False
    """Pass trust_remote_code to transformers and vLLM."""


class RunConfig(BaseConfig):
    """Naming of the run directory `<output_dir>/<run.dir or run.name>`."""

    name: str | None = None
    """Run name. Auto-generated as `<envs>--<model>--<short-id>` (SFT: `<dataset>--<model>--<short-id>`)
    when unset; pass it to make the run directory predictable (required to resume)."""

    dir: str | None = None
    """Leaf directory under output_dir when it should differ from the run name."""


class ResumeConfig(BaseConfig):
    """Resume a named run from its checkpoints and bus state."""

    step: int | None = Field(None, ge=0)
    """Checkpoint step to resume from; the latest complete checkpoint when unset."""


class CkptConfig(BaseConfig):
    """Periodic checkpoints under `<run_dir>/checkpoints/step_N/`."""

    interval: int = Field(50, ge=1)
    """Save a checkpoint every `interval` steps (and at the last step)."""

    keep_last: int | None = Field(2, ge=1, validation_alias=AliasChoices("keep_last", "keep"))
    """Keep only the newest N complete checkpoints (None keeps all). Formerly `keep`, which is
    still accepted."""


class FileMonitorConfig(BaseConfig):
    """Step metrics appended as JSON lines to `<run_dir>/metrics.jsonl`."""

    path: str = "metrics.jsonl"
    """File name inside the run directory."""


class WandbMonitorConfig(BaseConfig):
    """Weights & Biases logging: one wandb run per run (needs `uv sync --group wandb`)."""

    project: str = "rlbus"
    """wandb project."""

    name: str | None = None
    """wandb run name (None: the run id, i.e. `bus.run_id` or `run.name`)."""

    entity: str | None = None
    """wandb entity (team or user)."""

    group: str | None = None
    """wandb group, to show several runs together (e.g. an `sft` run and the `rl` runs after it)."""

    tags: list[str] = []
    """Tags added to the wandb run."""

    offline: bool = False
    """Log into `<run_dir>/wandb` without network or login; upload later with
    `wandb sync <run_dir>/wandb/offline-run-*`. WANDB_MODE, when set, wins over this."""


class MonitorsConfig(BaseConfig):
    """Where step metrics go."""

    file: FileMonitorConfig | None = FileMonitorConfig()
    """metrics.jsonl monitor (on by default; `--no-monitors.file` disables)."""

    wandb: WandbMonitorConfig | None = None
    """wandb monitor (off by default; bare `--monitors.wandb` enables it)."""


class LogConfig(BaseConfig):
    """Logging (structlog): pretty on a terminal, JSON in files."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    """Minimum log level."""

    json_console: bool = False
    """Render console logs as JSON even on a terminal."""


class OtelConfig(BaseConfig):
    """OpenTelemetry tracing."""

    endpoint: str | None = None
    """OTLP collector: `http://host:4318` (protocol http/protobuf) or `http://host:4317` (grpc).
    Falls back to OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT; without
    any, spans go to `<run_dir>/traces/<service>.jsonl` as OTLP-JSON (docs/observability.md)."""

    protocol: Literal["grpc", "http/protobuf"] | None = None
    """OTLP transport; unset: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL,
    else http/protobuf. vLLM's engine spans use the same endpoint and protocol."""

    enabled: bool = True
    """Emit spans at all."""


class MetricsConfig(BaseConfig):
    """Prometheus `/metrics` of this process (docs/metrics.md)."""

    host: str = "127.0.0.1"
    """Address the metrics server binds: loopback by default (docs/security.md); `0.0.0.0` where
    a Prometheus on another host or container scrapes it (compose)."""

    port: int = Field(0, ge=0, le=65535)
    """Port of `/metrics`; 0 picks a free one, named in the `metrics_serving` log line. `rl` gives
    every process it starts a port of its own and lists them in `<run_dir>/metrics/targets.json`."""


class WeightBroadcastConfig(BaseConfig):
    """How the trainer moves new weights to inference."""

    type: Literal["filesystem", "nccl"] = "filesystem"
    """`filesystem`: safetensors under `<run_dir>/broadcasts/step_N/`; `nccl`: a process group
    between trainer rank 0 and the inference workers (gloo on CPU)."""

    keep_last: int = Field(2, ge=1)
    """filesystem: broadcasts kept besides those a replica still uses."""

    timeout_s: float = Field(300.0, gt=0)
    """nccl: timeout of every collective; a sync fails loudly instead of hanging."""

    max_shard_size: ByteSize = Field(ByteSize(5 * 1000**3), gt=0)
    """filesystem: largest safetensors file of a version; more weights are split into shards
    with an index, as Hugging Face checkpoints are (the same default as
    `trainer.export.max_shard_size`). Files are written tensor by tensor, so this bounds file
    sizes, not the trainer's memory."""

    bucket_size: ByteSize = Field(ByteSize(256 * 1024**2), gt=0)
    """nccl: most bytes in one broadcast: small tensors are packed into buckets up to this
    size, bigger ones go in chunks of it. Rank 0's extra memory during a broadcast is one
    bucket plus the full tensor being gathered (docs/weights.md). The default is
    `rlbus.broadcast.BUCKET_BYTES` (a test keeps them equal: that module imports torch)."""


class DeploymentConfig(BaseConfig):
    """Where the services run."""

    num_train_gpus: int = Field(1, ge=1)
    """Trainer processes (torchrun --nproc-per-node) on this node."""

    num_infer_replicas: int = Field(1, ge=1)
    """Inference server processes started by the launcher (each of
    `inference.vllm.tensor_parallel_size` GPUs on a GPU host)."""

    num_infer_gpus: int | None = Field(None, ge=1)
    """GPUs for inference (prime-rl's key): num_infer_replicas = num_infer_gpus /
    inference.vllm.tensor_parallel_size. Unset: num_infer_replicas x tensor_parallel_size."""

    gpu_ids: list[int] | None = None
    """The GPUs of this node the run may use, e.g. [0, 1, 2, 3]: inference takes the first ones,
    the trainer the next (rlbus.placement; docs/launcher.md). Default: the GPUs detected
    (CUDA_VISIBLE_DEVICES, else every NVIDIA device); on SLURM 0..slurm.gpus_per_node-1. With an
    explicit list, a CPU host plans (--dry-run) as if it had them."""

    infer_gpu_ids: list[int] | None = None
    """The GPUs of the inference replicas, in order (tensor_parallel_size consecutive ones per
    replica). Default: the first GPUs of gpu_ids."""

    train_gpu_ids: list[int] | None = None
    """The GPUs of the trainer's ranks. Default: the GPUs of gpu_ids after inference's."""

    num_rollout_workers: int = Field(0, ge=0)
    """Rollout-worker processes started besides the orchestrator (`worker-<i>`, each running
    `orchestrator --role worker` with `orchestrator.num_workers` workers inside); they share the
    tasks stream with the orchestrator's in-process workers. 0: only those in-process workers."""

    cpu_binding: Literal["auto", "threads", "off"] = "auto"
    """`auto`: on a host without GPUs, give each inference replica (its whole process tree) and the
    trainer disjoint halves of the cores the launcher may use, so that generation and training
    overlap instead of fighting over the same cores (docs/launcher.md). `threads`: pin only vLLM's
    compute threads and the trainer. `off`: leave placement to the OS."""

    orchestrator_cpus: Literal["os", "inference", "trainer"] = "os"
    """Where the orchestrator and its rollout-worker processes run when cores are split
    (`cpu_binding` `auto` or `threads`): `os` leaves them to the OS, `inference` / `trainer` pins
    them to that half (the first replica's cores for `inference`; docs/benchmarks.md has the
    measurement behind the default)."""


class SupervisionConfig(BaseConfig):
    """How `rl` heals a run: a service that exits unexpectedly is restarted alone, with its
    original command (every service resumes by itself), after a backoff and within a budget."""

    enabled: bool = True
    """Restart services that die (`--no-supervision.enabled`: the first death stops the run)."""

    max_restarts: int = Field(5, ge=0)
    """Restarts allowed per service within `window_s`; one more death stops the run."""

    window_s: float = Field(600.0, gt=0)
    """The sliding window (seconds) the restart budget counts over."""

    backoff_s: float = Field(1.0, ge=0)
    """Wait before the first restart; doubled for each further restart within the window."""

    max_backoff_s: float = Field(30.0, ge=0)
    """Longest wait before a restart."""


class ServiceConfig(BaseConfig):
    """The fields of every command that runs a service: its bus, logging and tracing."""

    bus: BusConfig = BusConfig()
    """NATS bus (`rl` starts an embedded server unless bus.url is set)."""

    log: LogConfig = LogConfig()
    """Logging."""

    otel: OtelConfig = OtelConfig()
    """Tracing."""

    metrics: MetricsConfig | None = MetricsConfig()
    """Prometheus /metrics server (loopback, a free port unless `metrics.port` is set;
    `--no-metrics`: none). Under torchrun only rank 0 serves."""

    exit_when_finished: bool = False
    """Drain and exit 0 once the trainer has marked the run finished (its last step trained).
    Compose and SLURM set it on every long-running service, so the deployment ends by itself;
    `rl` stops its services itself and leaves it off."""


class RunnableConfig(ServiceConfig):
    """A service that names its run directory `<output_dir>/<run.dir or run.name>` itself."""

    output_dir: str = "outputs"
    """Directory that groups runs."""

    run: RunConfig = RunConfig()
    """Run naming: `<output_dir>/<run.dir or run.name>`."""


class TrainingRunConfig(RunnableConfig):
    """A run that trains (`rl`, `trainer`, `sft`): it resumes, checkpoints and publishes weights."""

    resume: ResumeConfig | None = None
    """Resume the named run (bare `--resume`: latest checkpoint; `--resume.step N`)."""

    ckpt: CkptConfig | None = None
    """Checkpointing (without it a resumed run loads but saves no new checkpoints)."""

    weight_broadcast: WeightBroadcastConfig = WeightBroadcastConfig()
    """How new weights reach inference (filesystem | nccl)."""


class LaunchConfig(BaseConfig):
    """What only a launcher (`rl`, `sft`) decides, before it starts anything: a service started by
    it (or by compose or SLURM) never wipes or merely plans its run."""

    clean: bool = False
    """Wipe this run's directory (only it) before starting."""

    dry_run: bool = False
    """Write resolved configs and one launch script per process into the run directory; start nothing."""


SHARED_BLOCKS: tuple[type[ServiceConfig], ...] = (TrainingRunConfig, RunnableConfig, ServiceConfig)
"""The shared blocks, most specific first."""


__all__ = [
    "SHARED_BLOCKS",
    "CkptConfig",
    "DeploymentConfig",
    "FileMonitorConfig",
    "LaunchConfig",
    "LogConfig",
    "MetricsConfig",
    "ModelConfig",
    "MonitorsConfig",
    "OtelConfig",
    "ResumeConfig",
    "RunConfig",
    "RunnableConfig",
    "ServiceConfig",
    "SupervisionConfig",
    "TrainingRunConfig",
    "WandbMonitorConfig",
    "WeightBroadcastConfig",
]
