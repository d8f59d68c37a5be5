"""`rl` launcher config: the three service configs plus the values they share.

Shared values (model, seq_len, max_steps, run directory, bus, monitors, ...) are set once at the top
and pushed down into `trainer`, `orchestrator` and `inference`; a value set explicitly on a
service (`--trainer.max-steps 5`) wins over the pushed one.
"""

from typing import Any, Self

from pydantic import BaseModel, Field, model_validator

from rlbus.configs.base import field_errors
from rlbus.configs.common import (
    SHARED_BLOCKS,
    DeploymentConfig,
    LaunchConfig,
    ModelConfig,
    MonitorsConfig,
    ServiceConfig,
    SupervisionConfig,
    TrainingRunConfig,
)
from rlbus.configs.inference import InferenceConfig
from rlbus.configs.migrate import migrate_for_load
from rlbus.configs.orchestrator import OrchestratorConfig
from rlbus.configs.slurm import SlurmConfig
from rlbus.configs.trainer import TrainerConfig
from rlbus.placement import GpuPlacement, PlacementError, place_gpus
from rlbus.rundirs import resolve_run_dir

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts for --max-lora-rank (vllm/config/lora.py, MaxLoRARanks)."""


def push_down(target: BaseModel, field: str, value: object) -> None:
    """Set `target.field = value` unless the user set that field on `target` explicitly."""
    assert field in type(target).model_fields, f"{type(target).__name__} has no field {field!r}"
    if field in target.model_fields_set:
        return
    object.__setattr__(target, field, value)


def push_down_model(target: BaseModel, field: str, source: BaseModel) -> None:
    """Push every field of the `source` sub-config into `target.field`, field by field, so an
    explicitly set sub-field on the service (`--trainer.model.dtype`) still wins."""
    sub = getattr(target, field)
    for name in type(source).model_fields:
        if name in type(sub).model_fields:
            push_down(sub, name, getattr(source, name))


def push_down_block(target: ServiceConfig, source: "RLConfig") -> None:
    """Push every field of the shared block `target` inherits (TrainingRunConfig,
    RunnableConfig or ServiceConfig) from `source`, each service getting its own copy."""
    block = next(b for b in SHARED_BLOCKS if isinstance(target, b))
    for field in block.model_fields:
        value = getattr(source, field)
        push_down(
            target, field, value.model_copy(deep=True) if isinstance(value, BaseModel) else value
        )


class RLConfig(TrainingRunConfig, LaunchConfig):
    """Asynchronous RL: inference + orchestrator + trainer over a NATS JetStream bus."""

    # Run directory, bus, logging, tracing, resume/ckpt/weight_broadcast: the TrainingRunConfig
    # block, pushed down to the services below; clean/dry_run (LaunchConfig) stay here.

    model: ModelConfig = ModelConfig()
    """Model trained and served (pushed down to every service)."""

    seq_len: int = Field(2048, ge=8)
    """Max tokens per sample / packed row (trainer, orchestrator, vLLM max_model_len)."""

    max_steps: int | None = Field(None, ge=1)
    """Training steps (None: until stopped)."""

    monitors: MonitorsConfig = MonitorsConfig()
    """Metric sinks (the monitor process joins every service's step metrics into them)."""

    deployment: DeploymentConfig = DeploymentConfig()
    """How many processes of each service run, and where their CPUs come from."""

    slurm: SlurmConfig | None = None
    """Submit the run as a SLURM batch job instead of starting it here (bare `--slurm` or a
    `[slurm]` table turns it on; docs/slurm.md)."""

    supervision: SupervisionConfig = SupervisionConfig()
    """Restarts of services that die (launcher only; docs/launcher.md, "Supervision")."""

    trainer: TrainerConfig = TrainerConfig()
    """Trainer service."""

    orchestrator: OrchestratorConfig = OrchestratorConfig()
    """Orchestrator service."""

    inference: InferenceConfig = InferenceConfig()
    """Inference service."""

    @model_validator(mode="before")
    @classmethod
    def _remap_legacy_keys(cls, data: Any) -> Any:
        """Older configs had a top-level `[wandb]` table (and `--wandb` flag); it now lives under
        `[monitors.wandb]`. Move it there so those configs keep working. prime-rl keys are read
        as their rlbus keys where they map (rlbus.configs.migrate)."""
        data = migrate_for_load(data, "rl")
        if not isinstance(data, dict) or "wandb" not in data:
            return data
        legacy = data.pop("wandb")
        monitors = dict(data.get("monitors") or {})
        if legacy is True or legacy == {}:
            legacy = {}
        elif legacy in (False, None, "None"):
            legacy = None
        current = monitors.get("wandb")
        if isinstance(legacy, dict) and isinstance(current, dict):
            legacy = {**legacy, **current}  # the new spelling wins over the legacy one
        monitors["wandb"] = legacy
        data["monitors"] = monitors
        return data

    @model_validator(mode="after")
    def _push_shared_values_down(self) -> Self:
        if errors := inference_gpu_errors(self):
            raise field_errors(self, *errors)
        self.push_shared_values_down()
        errors = [
            *placement_errors(self),
            *self._pushed_value_errors(),
            *self._replica_port_errors(),
            *self._algorithm_errors(),
            *self._fake_data_errors(),
        ]
        if errors:
            raise field_errors(self, *errors)
        return self

    def _fake_data_errors(self) -> list[tuple[str, str]]:
        """`trainer.data.fake` is the trainer's stand-alone throughput mode (`trainer @ FILE`): in
        a run its batches come from the bus."""
        if self.trainer.data.fake is None:
            return []
        why = (
            "the trainer of an `rl` run trains on the orchestrator's batches: drop it, or run the "
            "trainer alone on fake data with `trainer @ FILE` and [data.fake] (docs/trainer.md)"
        )
        return [("trainer.data.fake", why)]

    def _pushed_value_errors(self) -> list[tuple[str, str]]:
        """Completions must fit the engine's context (`inference.vllm.max_model_len`, pushed from
        `seq_len`): vLLM refuses every request whose prompt plus max_tokens exceed it. That holds
        for the run's sampling and for each environment's own."""
        context = self.inference.vllm.max_model_len
        if context is None:
            return []
        why = (
            f"must not exceed inference.vllm.max_model_len ({context}, from seq_len unless set): "
            "vLLM refuses every request whose prompt plus max_tokens exceed it"
        )
        errors = []
        if self.orchestrator.sampling.max_tokens > context:
            errors.append(("orchestrator.sampling.max_tokens", why))
        for i, env in enumerate(self.orchestrator.env):
            if env.sampling.max_tokens is not None and env.sampling.max_tokens > context:
                errors.append((f"orchestrator.env.{i}.sampling.max_tokens", why))
            if env.max_total_tokens is not None and env.max_total_tokens > context:
                errors.append(
                    (
                        f"orchestrator.env.{i}.max_total_tokens",
                        f"must not exceed inference.vllm.max_model_len ({context}, from seq_len "
                        "unless set): an episode is one sequence of the engine's context",
                    )
                )
        return errors

    def _algorithm_errors(self) -> list[tuple[str, str]]:
        """Loss and advantage settings the two services must agree on (docs/algorithms.md)."""
        errors = []
        loss = self.trainer.loss
        if loss.type == "dr_grpo" and self.orchestrator.normalize_advantages:
            why = (
                "must be false with trainer.loss.type = 'dr_grpo': Dr. GRPO drops the group std "
                "normalisation of advantages (use another loss type to keep it)"
            )
            errors.append(("orchestrator.normalize_advantages", why))
        num_ranks = self.deployment.num_train_gpus
        full_ft_reference = loss.ref_kl_coef > 0 and self.trainer.lora is None
        if full_ft_reference and self.trainer.reference.offload and num_ranks > 1:
            why = (
                f"needs deployment.num_train_gpus = 1 (got {num_ranks}: a sharded reference stays "
                "on the device, 1/N of the weights per rank): drop it, or train LoRA adapters "
                "(--trainer.lora, whose reference costs nothing)"
            )
            errors.append(("trainer.reference.offload", why))
        return errors

    def _replica_port_errors(self) -> list[tuple[str, str]]:
        """Replica i serves on server.port + i and backend_port + i (rlbus_launch.plan), so with
        explicit ports the two ranges must not overlap, nor leave the port range; ports left
        unset are picked free per replica."""
        count = self.deployment.num_infer_replicas
        if count == 1:
            return []
        inference = self.inference
        ports = {}  # the explicit ones
        if "port" in inference.server.model_fields_set:
            ports["inference.server.port"] = inference.server.port
        if "backend_port" in inference.model_fields_set:
            ports["inference.backend_port"] = inference.backend_port
        errors = []
        for field, port in ports.items():
            if port == 0:
                why = (
                    f"0 cannot be a base port for {count} replicas (replica i serves on port + i): "
                    "leave it unset (each replica gets free ports) or give a base port"
                )
                errors.append((field, why))
            elif port + count - 1 > 65535:
                why = (
                    f"replica {count - 1} would serve on {port + count - 1} (port + i), past 65535"
                )
                errors.append((field, why + ": lower the base port"))
        if len(ports) == 2 and not errors:
            port, backend = ports.values()
            if abs(port - backend) < count:
                why = (
                    f"the engine ports {backend}..{backend + count - 1} overlap the public ports "
                    f"{port}..{port + count - 1} of the {count} replicas (replica i serves on "
                    f"server.port + i and backend_port + i): keep them at least {count} apart"
                )
                errors.append(("inference.backend_port", why))
        return errors

    def push_shared_values_down(self) -> None:
        """Copy the shared values into the service configs, except where a service sets its own.
        Idempotent: called on validation and again once the launcher has named the run."""
        for service in (self.trainer, self.orchestrator, self.inference):
            push_down_block(service, self)
        for service in (self.trainer, self.orchestrator):
            push_down_model(service, "model", self.model)
            for field in ("seq_len", "max_steps"):
                push_down(service, field, getattr(self, field))
        push_down(self.orchestrator, "num_train_ranks", self.deployment.num_train_gpus)
        if self.trainer.loss.type == "dr_grpo":  # its constant normaliser is the token budget
            push_down(self.trainer.loss, "max_tokens", self.orchestrator.sampling.max_tokens)
        push_down(self.inference.vllm, "model", self.model.name)
        # The engine samples in the trainer's dtype: vLLM's "auto" downcasts a float32 checkpoint
        # to bfloat16 on CPU, and the sampled tokens' logprobs would then disagree with the trainer's.
        push_down(self.inference.vllm, "dtype", self.model.dtype)
        push_down(self.inference.vllm, "max_model_len", self.seq_len)
        push_down(self.inference, "weight_broadcast", self.weight_broadcast.model_copy(deep=True))
        if self.trainer.lora is not None:
            self._enable_engine_lora(self.trainer.lora.rank)
        if self.run.name is not None:
            push_down(
                self.inference,
                "run_dir",
                str(resolve_run_dir(self.output_dir, self.run.name, self.run.dir)),
            )

    def _enable_engine_lora(self, rank: int) -> None:
        """A LoRA trainer publishes adapters: vLLM must start with `--enable-lora` and a
        `--max-lora-rank` that fits them (vLLM takes only VLLM_LORA_RANKS); values set under
        `[inference.vllm]` win."""
        extra = self.inference.vllm.model_extra
        assert extra is not None  # VLLMConfig allows extra keys
        extra.setdefault("enable_lora", True)
        # LoRAConfig.rank <= 512, vLLM's largest: one always fits
        extra.setdefault("max_lora_rank", next(r for r in VLLM_LORA_RANKS if r >= rank))

    def env_ids(self) -> list[str]:
        """Environment ids of the run (for the run name)."""
        return [env.id for env in self.orchestrator.env]

    def with_run_name(self, name: str) -> "RLConfig":
        """A copy whose run is named `name` (and bus subjects prefixed by it unless `bus.run_id`
        is set), pushed down again to every service."""
        config = self.model_copy(deep=True)
        # Assign whole sub-configs so `run` and `bus` count as explicitly set (model_fields_set):
        # the name is part of what the launcher writes to configs/rl.toml.
        config.run = config.run.model_copy(update={"name": name})
        if config.bus.run_id is None:
            config.bus = config.bus.model_copy(update={"run_id": name})
        config.push_shared_values_down()
        return config


def gpu_placement(config: RLConfig, gpu_ids: list[int]) -> GpuPlacement:
    """The run's GPU split over `gpu_ids` (rlbus.placement.place_gpus with the run's counts);
    with only explicit per-service lists and no gpu_ids, those lists are the node's GPUs."""
    deployment = config.deployment
    if not gpu_ids:
        named = [*(deployment.infer_gpu_ids or ()), *(deployment.train_gpu_ids or ())]
        gpu_ids = list(dict.fromkeys(named))  # a device in both lists is place_gpus's error
    return place_gpus(
        gpu_ids,
        num_replicas=deployment.num_infer_replicas,
        tensor_parallel_size=config.inference.vllm.tensor_parallel_size,
        num_train_gpus=deployment.num_train_gpus,
        infer_gpu_ids=deployment.infer_gpu_ids,
        train_gpu_ids=deployment.train_gpu_ids,
    )


def inference_gpu_errors(config: RLConfig) -> list[tuple[str, str]]:
    """prime-rl counts inference in GPUs (`deployment.num_infer_gpus`, or the older
    `slurm.inference_gpus`), rlbus in replicas of tensor_parallel_size GPUs: the GPU count
    sets the replicas, and an explicit replica count must agree with it."""
    deployment, tp = config.deployment, config.inference.vllm.tensor_parallel_size
    legacy = config.slurm.inference_gpus if config.slurm is not None else None
    gpus, field = deployment.num_infer_gpus, "deployment.num_infer_gpus"
    if legacy is not None:
        if gpus is not None and gpus != legacy:
            return [("slurm.inference_gpus", f"must equal {field} ({gpus}): drop one")]
        gpus, field = legacy, "slurm.inference_gpus"
    if gpus is None:
        return []
    if gpus % tp:
        why = f"must be a multiple of inference.vllm.tensor_parallel_size ({tp})"
        return [(field, f"{why}: each replica runs on tensor_parallel_size GPUs")]
    replicas = gpus // tp
    if "num_infer_replicas" in deployment.model_fields_set:
        if deployment.num_infer_replicas != replicas:
            why = (
                f"must be {field} / inference.vllm.tensor_parallel_size = {gpus} / {tp} = "
                f"{replicas}: give them agreeing values or only one (prime-rl's "
                "inference.parallel.dp / data_parallel_size set the replicas too)"
            )
            return [("deployment.num_infer_replicas", why)]
    else:
        deployment.num_infer_replicas = replicas
    return []


def placement_errors(config: RLConfig) -> list[tuple[str, str]]:
    """A GPU split named in the config (`deployment.gpu_ids`, `infer_gpu_ids`,
    `train_gpu_ids`) is checked here, with the launcher's own function (rlbus.placement);
    detected GPUs are checked when the run is planned."""
    deployment = config.deployment
    named = (deployment.gpu_ids, deployment.infer_gpu_ids, deployment.train_gpu_ids)
    if all(ids is None for ids in named):
        return []
    try:
        gpu_placement(config, deployment.gpu_ids or [])
    except PlacementError as error:
        return [(error.field, error.reason)]
    return []
