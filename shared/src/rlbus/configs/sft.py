"""SFT config (`sft` command): the trainer fed from local files instead of the bus."""

from typing import Any, Literal, Self

from pydantic import Field, model_validator

from rlbus.configs.base import BaseConfig, field_errors
from rlbus.configs.common import LaunchConfig, ModelConfig, MonitorsConfig
from rlbus.configs.inference import InferenceConfig
from rlbus.configs.migrate import migrate_for_load
from rlbus.configs.orchestrator import EvalConfig, OrchestratorConfig
from rlbus.configs.slurm import SlurmConfig
from rlbus.configs.trainer import TrainerConfig


class SFTDataConfig(BaseConfig):
    """Supervised data in messages format."""

    path: str = "reverse-text"
    """JSONL/Parquet file, a `datasets` dataset saved to disk, or the built-in `reverse-text` generator."""

    loss_roles: list[str] = ["assistant"]
    """Roles whose turns carry loss."""

    batch_size: int = Field(32, ge=1)
    """Sequences per optimizer step (global)."""

    pack: bool = True
    """Pack sequences into rows of seq_len."""

    val_path: str | None = None
    """Validation data (same formats); validation loss every ckpt/eval interval."""

    val_interval: int = Field(50, ge=1)
    """Validation every N steps."""

    copy_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    """Built-in `reverse-text` only: the share of demonstrations that copy the text instead of
    reversing it (mixed-quality data). The reverse-text example uses 0.4, so that its SFT model
    knows the reversal (greedy) but samples it noisily, which is what RL then fixes."""

    @model_validator(mode="after")
    def _copy_fraction_needs_built_in_data(self) -> Self:
        if self.copy_fraction and self.path != "reverse-text":
            raise ValueError(
                f"data.copy_fraction={self.copy_fraction} only applies to the built-in 'reverse-text' data, "
                f"not data.path={self.path!r}: drop --data.copy-fraction or use --data.path reverse-text"
            )
        return self


class SFTEvalConfig(EvalConfig):
    """Evaluation on environments during SFT (docs/evaluating.md, "During SFT"): at step 0, every
    `interval` steps and at the last step, the weights go to an inference server and
    `[[eval.env]]` is evaluated with the code of the in-run evaluations; `eval/<env>/*` joins the
    step's row (beside `val_loss`) and `evals.jsonl`."""

    inference: InferenceConfig = InferenceConfig()
    """The inference server `sft` starts for the evaluations (its vLLM settings; the model is
    `model.name`, then each evaluated step's weights)."""

    inference_url: str | None = None
    """An OpenAI API root of a running server to evaluate on instead (`sft` starts none); it must
    serve `model.name` and load weights from this run's `broadcasts/` (its
    `--admin.weights-root`)."""

    admin_url: str | None = None
    """That server's engine (admin) port, for /update_weights (default: port 8100 of its host)."""

    def orchestrator(self, model: str, seq_len: int) -> OrchestratorConfig:
        """The orchestrator config `rlbus_orchestrator.evaluate` runs an evaluation with."""
        eval_config = EvalConfig.model_validate(
            self.model_dump(exclude={"inference", "inference_url", "admin_url"})
        )
        return OrchestratorConfig(
            model=ModelConfig(name=model),
            eval=eval_config,
            seq_len=seq_len,
            inference_urls=[self.inference_url] if self.inference_url else [],
        )


class SFTConfig(TrainerConfig, LaunchConfig):
    """Supervised fine-tuning with the trainer's model, optimizer, checkpoints and offload."""

    data: SFTDataConfig = SFTDataConfig()
    """Training data."""

    num_processes: int = Field(1, ge=1)
    """Processes launched by torchrun (one per GPU; on CPU, gloo ranks)."""

    monitors: MonitorsConfig = MonitorsConfig()
    """Metric sinks for the step metrics (rank 0 writes them): metrics.jsonl, and wandb with
    `--monitors.wandb` (needs the wandb package)."""

    slurm: SlurmConfig | None = None
    """Submit the SFT as a SLURM batch job instead of running it here (bare `--slurm` or a
    `[slurm]` table; docs/slurm.md)."""

    save_final_model: bool = True
    """Write an HF model directory `<run_dir>/model/` at the end."""

    eval: SFTEvalConfig | None = None
    """Evaluation on environments (off unless set; `[[eval.env]]` names them)."""

    kind: Literal["sft"] = "sft"
    """Fixed tag for run naming."""

    @model_validator(mode="before")
    @classmethod
    def _read_prime_rl_keys(cls, data: Any) -> Any:
        """prime-rl keys are read as their rlbus keys where they map (rlbus.configs.migrate)."""
        return migrate_for_load(data, "sft")

    @model_validator(mode="after")
    def _eval_names_its_environments(self) -> "SFTConfig":
        if self.eval is not None and not self.eval.env:
            raise field_errors(
                self,
                (
                    "eval.env",
                    "SFT has no training environments to evaluate on: list them as "
                    '[[eval.env]] tables (e.g. id = "reverse-text")',
                ),
            )
        if self.eval is not None:
            labels = self.eval.label_errors()
            if labels:
                raise field_errors(self, *labels)
        return self

    @model_validator(mode="after")
    def _every_rank_gets_data(self) -> "SFTConfig":
        if self.data.batch_size < self.num_processes:
            raise field_errors(
                self,
                (
                    "data.batch_size",
                    f"must be at least num_processes ({self.num_processes}): the batch is "
                    "split between the ranks, and each needs one sequence or more",
                ),
            )
        return self
