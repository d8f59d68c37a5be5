"""Trainer service config (`trainer` command, and the base of `sft`)."""

from typing import Annotated, Any, Literal, Self

from pydantic import ByteSize, Field, field_validator, model_validator

from rlbus.configs.base import BaseConfig
from rlbus.configs.common import ModelConfig, TrainingRunConfig
from rlbus.configs.migrate import migrate_for_load


class FullOffloadConfig(BaseConfig):
    """Optimizer-in-backward with FP32 masters, gradients and optimizer state in host memory."""

    backend: Literal["native", "torch"] = "native"
    """`native`: torch's fused CPU optimizer kernel; `torch`: plain torch ops (debugging)."""

    numa_binding: bool = True
    """Pin the CPU optimizer threads to the NUMA node of the process."""


class TrainerModelConfig(ModelConfig):
    """The trained model and where its state lives."""

    impl: Literal["auto", "rlbus", "transformers"] = "auto"
    """Which implementation of the network trains. `rlbus`: the trainer's own torch module
    (Qwen3ForCausalLM checkpoints on local disk or in the HF cache, default RoPE, full attention;
    no transformers import: the trainer starts ~3 s sooner). `transformers`: AutoModelForCausalLM,
    any architecture. `auto`: rlbus where it covers the model, else transformers. Both have the
    same parameter names, so checkpoints and weight broadcasts do not depend on it."""

    activation_checkpointing: bool = False
    """Recompute activations in backward to save memory."""

    optim_cpu_offload: bool = True
    """Keep optimizer state in host memory (state-only offload)."""

    full_offload: FullOffloadConfig | bool = False
    """FP32 masters, gradients and optimizer state on the host, optimizer step in backward.
    `true` or a table selecting the backend; requires optim_cpu_offload = false and AdamW or
    SignSGD; disables gradient clipping."""

    @property
    def full_offload_config(self) -> FullOffloadConfig | None:
        if self.full_offload is True:
            return FullOffloadConfig()
        return self.full_offload or None

    @model_validator(mode="after")
    def _offload_modes_exclusive(self) -> Self:
        if self.full_offload_config is not None and self.optim_cpu_offload:
            raise ValueError(
                "model.full_offload and model.optim_cpu_offload are mutually exclusive: "
                "set model.optim_cpu_offload = false (--no-model.optim-cpu-offload) to use full_offload"
            )
        return self


class AdamWConfig(BaseConfig):
    """AdamW (torch.optim.AdamW)."""

    type: Literal["adamw"] = "adamw"
    lr: float = Field(1e-5, gt=0)
    """Peak learning rate."""
    weight_decay: float = Field(0.01, ge=0)
    """Decoupled weight decay."""
    betas: list[float] = [0.9, 0.999]
    """Adam betas (two values)."""
    eps: float = Field(1e-8, gt=0)
    """Adam epsilon."""
    max_norm: float | None = Field(1.0, gt=0)
    """Gradient clipping norm (None disables)."""

    @field_validator("betas")
    @classmethod
    def _two_betas_in_unit_interval(cls, betas: list[float]) -> list[float]:
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"must be exactly two values in [0, 1), e.g. [0.9, 0.999] in a file or "
                f"`--optim.betas 0.9 0.999` (got {betas})"
            )
        return betas


class SGDConfig(BaseConfig):
    """SGD with optional momentum (torch.optim.SGD)."""

    type: Literal["sgd"] = "sgd"
    lr: float = Field(1e-3, gt=0)
    """Peak learning rate."""
    momentum: float = Field(0.0, ge=0, lt=1)
    """Momentum factor (in [0, 1))."""
    weight_decay: float = Field(0.0, ge=0)
    """Weight decay."""
    max_norm: float | None = Field(1.0, gt=0)
    """Gradient clipping norm (None disables)."""


class SignSGDConfig(BaseConfig):
    """Sign SGD: p -= lr * sign(grad). Keeps no state."""

    type: Literal["sign_sgd"] = "sign_sgd"
    lr: float = Field(1e-5, gt=0)
    """Peak learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay."""
    max_norm: float | None = Field(1.0, gt=0)
    """Gradient clipping norm (None disables)."""


class MuonConfig(BaseConfig):
    """Muon for 2-D weights (torch.optim.Muon), AdamW for the rest."""

    type: Literal["muon"] = "muon"
    lr: float = Field(2e-2, gt=0)
    """Peak learning rate of the Muon parameter group."""
    adamw_lr: float = Field(1e-5, gt=0)
    """Learning rate of the AdamW group (embeddings, norms, biases)."""
    momentum: float = Field(0.95, ge=0, lt=1)
    """Muon momentum (in [0, 1))."""
    weight_decay: float = Field(0.01, ge=0)
    """Weight decay."""
    max_norm: float | None = Field(1.0, gt=0)
    """Gradient clipping norm (None disables)."""


OptimizerConfig = Annotated[
    AdamWConfig | SGDConfig | SignSGDConfig | MuonConfig, Field(discriminator="type")
]


class ConstantSchedulerConfig(BaseConfig):
    """Constant learning rate after warmup."""

    type: Literal["constant"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps from 0 to the peak lr."""


class LinearSchedulerConfig(BaseConfig):
    """Linear decay after warmup."""

    type: Literal["linear"] = "linear"
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps from 0 to the peak lr."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Final lr as a fraction of the peak."""


class CosineSchedulerConfig(BaseConfig):
    """Cosine decay after warmup."""

    type: Literal["cosine"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps from 0 to the peak lr."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Final lr as a fraction of the peak."""


SchedulerConfig = Annotated[
    ConstantSchedulerConfig | LinearSchedulerConfig | CosineSchedulerConfig,
    Field(discriminator="type"),
]


class LossBaseConfig(BaseConfig):
    """What every loss type shares: the optional KL term to the reference model."""

    ref_kl_coef: float = Field(0.0, ge=0)
    """Weight of a KL penalty to the reference model (the initial weights; the base model with
    the adapters off under LoRA): k3 estimate per loss token, normalised by the step's loss
    tokens, added to the loss. 0 (default): no reference model is kept (docs/algorithms.md)."""


class DefaultLossConfig(LossBaseConfig):
    """Importance-weighted policy gradient with trust-region masking by probability difference."""

    type: Literal["default"] = "default"
    mask_low: float = Field(0.2, ge=0)
    """Mask tokens whose trainer probability is lower than the inference probability by more than this."""
    mask_high: float = Field(0.2, ge=0)
    """Mask tokens whose trainer probability is higher than the inference probability by more than this."""
    kl_tau: float = Field(0.0, ge=0)
    """Weight of the `log_ratio^2` penalty."""


class DrGRPOLossConfig(LossBaseConfig):
    """Dr. GRPO: PPO's clipped ratio objective, token losses summed and divided by a constant
    (samples x max_tokens), with no length normalisation (docs/algorithms.md)."""

    type: Literal["dr_grpo"] = "dr_grpo"
    clip_eps: float = Field(0.2, gt=0, lt=1)
    """The ratio is clipped to [1 - clip_eps, 1 + clip_eps]."""
    max_tokens: int = Field(128, ge=1)
    """The constant length normaliser: the completion token budget. `rl` sets it to
    orchestrator.sampling.max_tokens unless given here."""


class GSPOLossConfig(LossBaseConfig):
    """GSPO: one importance ratio per sample (geometric mean of its token ratios), clipped at
    sample level, loss averaged over the step's samples (docs/algorithms.md)."""

    type: Literal["gspo"] = "gspo"
    eps_low: float = Field(3e-4, gt=0, lt=1)
    """The sample ratio is clipped below at 1 - eps_low."""
    eps_high: float = Field(4e-4, gt=0)
    """The sample ratio is clipped above at 1 + eps_high."""


class DAPOLossConfig(LossBaseConfig):
    """DAPO: PPO's clipped ratio objective with a higher upper clip ("clip-higher"), normalised
    by the step's loss tokens (docs/algorithms.md)."""

    type: Literal["dapo"] = "dapo"
    eps_low: float = Field(0.2, gt=0, lt=1)
    """The ratio is clipped below at 1 - eps_low."""
    eps_high: float = Field(0.28, gt=0)
    """The ratio is clipped above at 1 + eps_high."""


class CustomLossConfig(LossBaseConfig):
    """A user loss function given by import path."""

    type: Literal["custom"] = "custom"
    import_path: str
    """`package.module:function` computing the loss from the micro-batch (see docs/trainer.md)."""
    kwargs: dict[str, float | int | str | bool] = {}
    """Extra keyword arguments passed to the function."""


LossConfig = Annotated[
    DefaultLossConfig | DrGRPOLossConfig | GSPOLossConfig | DAPOLossConfig | CustomLossConfig,
    Field(discriminator="type"),
]


class ReferenceConfig(BaseConfig):
    """The reference model of `loss.ref_kl_coef` (kept only when that is above 0)."""

    offload: bool = False
    """Keep the frozen copy of the initial weights in host memory and move it to the device for
    each forward pass (full fine-tuning on one rank; on several ranks the copy is sharded as the
    model instead. A LoRA run's reference is its base model with the adapters off, which costs
    no memory, so there it changes nothing)."""


class LoRAConfig(BaseConfig):
    """Low-rank adapters on the target Linear layers: the base model is frozen, only the adapters
    train, and only they are published (a PEFT adapter dir through the filesystem; docs/lora.md)."""

    rank: int = Field(8, ge=1, le=512)
    """Adapter rank r (lora_A is [r, in], lora_B is [out, r]); at most 512, the largest rank
    vLLM serves."""

    alpha: float = Field(16.0, gt=0)
    """Scale of the adapter's output: alpha / rank."""

    target_modules: list[str] = [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    """Last name component of every Linear layer that gets an adapter."""

    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input (training only)."""

    name: str = Field("policy", min_length=1, max_length=256)
    """Name the engine serves the adapter under (the `model` of rollout requests)."""

    @field_validator("target_modules")
    @classmethod
    def _some_target(cls, modules: list[str]) -> list[str]:
        if not modules:
            raise ValueError(
                "must name at least one module, e.g. `--lora.target-modules q_proj v_proj`"
            )
        return modules


class FakeRolloutsConfig(BaseConfig):
    """Random rollouts instead of the bus (`[data.fake]`): the trainer alone trains `max_steps`
    steps on random tokens and advantages, to measure its throughput (docs/trainer.md, "Fake
    data"). No bus, orchestrator or inference is needed."""

    batch_size: int = Field(2, ge=1)
    """Samples per step (global), each `seq_len` tokens."""

    generate_samples: bool = False
    """Samples of random lengths (up to `seq_len`), packed into rows the way rollouts are,
    instead of one full-length sample per row."""


class TrainerDataConfig(BaseConfig):
    """Where the trainer's batches come from: the bus (default), or `fake` random rollouts."""

    fake: FakeRolloutsConfig | None = None
    """Train on random rollouts, without the bus (bare `--data.fake` for the defaults)."""


class ExportConfig(BaseConfig):
    """How models are written out: the final `<run_dir>/model/` and `rl export` (docs/export.md)."""

    merge_lora: bool = False
    """A LoRA run exports its adapter (a PEFT directory over `model.name`); true: the model with
    the adapter folded into its weights instead (`rl export --merged` does the same once)."""

    max_shard_size: ByteSize = Field(ByteSize(5 * 1000**3), gt=0)
    """Largest safetensors file of an exported model: bigger ones are split into shards
    (`model-00001-of-0000N.safetensors` and an index), as Hugging Face checkpoints are."""


class TrainerConfig(TrainingRunConfig):
    """The trainer service: consumes step batches, trains, checkpoints, publishes weights."""

    # Run directory, bus, logging, tracing, resume/ckpt/weight_broadcast: the
    # TrainingRunConfig block (`rl` pushes its own values down).

    model: TrainerModelConfig = TrainerModelConfig()
    """Model to train."""

    optim: OptimizerConfig = AdamWConfig()
    """Optimizer (switch with `--optim.type`)."""

    scheduler: SchedulerConfig = ConstantSchedulerConfig()
    """Learning-rate schedule (switch with `--scheduler.type`)."""

    loss: LossConfig = DefaultLossConfig()
    """RL loss (switch with `--loss.type`: default, dr_grpo, gspo, dapo, custom;
    docs/algorithms.md)."""

    reference: ReferenceConfig = ReferenceConfig()
    """Where the reference model of `loss.ref_kl_coef` lives."""

    lora: LoRAConfig | None = None
    """Train LoRA adapters instead of the whole model and publish only them (off by default;
    bare `--lora` enables it with the defaults)."""

    data: TrainerDataConfig = TrainerDataConfig()
    """Batches from the bus, or fake ones for a throughput run (`--data.fake`)."""

    save_final_model: bool = True
    """Write the trained model to `<run_dir>/model/` when the run reaches `max_steps`
    (docs/export.md)."""

    export: ExportConfig = ExportConfig()
    """How the final model and `rl export` write models (LoRA merged or not, shard size)."""

    max_steps: int | None = Field(None, ge=1)
    """Stop after this step (None: run until stopped)."""

    seq_len: int = Field(2048, ge=8)
    """Tokens per packed micro-batch row."""

    tokens_per_forward: int = Field(4096, ge=1)
    """Budget of one forward/backward pass: consecutive packed rows are stacked (padded to the
    longest) while rows x longest row <= this; a longer row goes alone. Many short rows then cost
    one call instead of many (what matters for small models); lower it if activations run out of memory."""

    seed: int = 0
    """Seed for torch and data order."""

    collective_timeout_s: float = Field(1800.0, gt=0)
    """Deadline of one collective between the ranks (all-reduce, barrier, gather): a rank stuck
    longer ends the group with an error naming the collective, never a silent hang. It must cover
    the longest step rank 0 does alone (writing a checkpoint or a broadcast of a large model)."""

    @model_validator(mode="before")
    @classmethod
    def _read_prime_rl_keys(cls, data: Any) -> Any:
        """prime-rl trainer keys are read as their rlbus keys where they map
        (rlbus.configs.migrate; `sft` and `rl` configs have their own tables)."""
        return migrate_for_load(data, "trainer")

    @model_validator(mode="after")
    def _full_offload_rules(self) -> Self:
        if self.model.full_offload_config is None:
            return self
        if self.lora is not None:
            raise ValueError(
                "model.full_offload and lora are mutually exclusive (the adapters are small: "
                "their optimizer state needs no offload): drop one of them"
            )
        if self.optim.type not in ("adamw", "sign_sgd"):
            raise ValueError(
                f"model.full_offload supports optim.type adamw or sign_sgd, not {self.optim.type!r}: "
                "set --optim.type adamw (or sign_sgd), or drop model.full_offload"
            )
        # Gradients are consumed parameter by parameter during backward: no global norm exists.
        if "max_norm" in self.optim.model_fields_set and self.optim.max_norm is not None:
            raise ValueError(
                "model.full_offload disables gradient clipping: drop optim.max_norm "
                "(or set it to None), or turn full_offload off"
            )
        self.optim.max_norm = None
        return self
