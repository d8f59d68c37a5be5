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

BUILT_IN_DATA = "reverse-text"
"""`data.path` of the built-in reverse-text generator (the default data)."""


class ColumnsConfig(BaseConfig):
    """Where a dataset keeps its conversations: a `messages` column (a whole chat), or a prompt
    and a completion column (each a list of messages, or a string: the user's turn and the
    assistant's answer). The messages column wins where a row has both."""

    messages_column: str = "messages"
    """Column holding a whole conversation as a list of `{role, content}` messages."""

    prompt_column: str = "prompt"
    """Column holding the prompt (messages, or a string taken as the user's turn)."""

    completion_column: str = "completion"
    """Column holding the answer (messages, or a string taken as the assistant's turn)."""


class SFTSourceConfig(ColumnsConfig):
    """One dataset of a mixture (`[[data.sources]]`)."""

    name: str | None = None
    """Hugging Face dataset id (`org/dataset`), loaded with `datasets` from the hub or the local
    HF cache (docs/trainer.md, "SFT data")."""

    path: str | None = None
    """A local JSONL/Parquet file or a directory saved with `datasets.Dataset.save_to_disk`."""

    subset: str | None = None
    """The dataset's configuration (subset) name, for `name` only."""

    split: str = "train"
    """The split to read, for `name` only."""

    weight: float = Field(1.0, gt=0)
    """Relative share of the examples drawn from this source."""

    @model_validator(mode="after")
    def _one_origin(self) -> Self:
        if (self.name is None) == (self.path is None):
            raise ValueError(
                "a data source names exactly one of name (a Hugging Face dataset) or path "
                "(a local file or saved dataset)"
            )
        return self

    @property
    def label(self) -> str:
        origin = self.name or self.path or ""
        return (
            origin
            + (f"[{self.subset}]" if self.subset else "")
            + (f":{self.split}" if self.name and self.split != "train" else "")
        )


class FakeDataConfig(BaseConfig):
    """Random token sequences instead of data (`data.type = "fake"`), for trainer throughput runs."""

    length: Literal["fixed", "variable"] = "fixed"
    """`fixed`: every sequence is `seq_len` tokens; `variable`: lengths drawn from 1..seq_len."""

    input_ids: Literal["increasing", "random"] = "random"
    """`random` token ids, or `increasing` (0, 1, 2, ... modulo the vocabulary)."""


class SFTDataConfig(ColumnsConfig):
    """Supervised data in messages format (docs/trainer.md, "SFT data")."""

    type: Literal["sft", "fake"] = "sft"
    """`sft`: conversations from `name`, `path` or `sources`; `fake`: random tokens (`data.fake`),
    no data read, for throughput runs (set max_steps)."""

    path: str | None = None
    """JSONL/Parquet file, a `datasets` dataset saved to disk, or the built-in `reverse-text`
    generator (the default when neither `name` nor `sources` is given)."""

    name: str | None = None
    """A Hugging Face dataset id (`org/dataset`) instead of `path`: loaded with `datasets` from
    the hub when it is reachable, else from the local HF cache."""

    subsets: list[str] | None = None
    """`name`'s subsets (configurations) to mix; default: its default one."""

    splits: list[str] | None = None
    """`name`'s splits to read (paired with `subsets` when both are given); default: `train`."""

    probabilities: list[float] | None = None
    """Shares of the subsets/splits above (default: equal)."""

    sources: list[SFTSourceConfig] = []
    """A mixture of several datasets/files, each with its own weight (`[[data.sources]]`),
    instead of `name`/`path`."""

    fake: FakeDataConfig = FakeDataConfig()
    """Shape of the random data of `type = "fake"`."""

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
        if self.copy_fraction and not self.is_built_in:
            raise ValueError(
                f"data.copy_fraction={self.copy_fraction} only applies to the built-in 'reverse-text' data, "
                f"not {self.label!r}: drop --data.copy-fraction or use --data.path reverse-text"
            )
        return self

    @model_validator(mode="after")
    def _one_origin(self) -> Self:
        errors = []
        if self.name is not None and self.path is not None:
            errors.append(
                (
                    "name",
                    "give data.name (a Hugging Face dataset) or data.path (a local file), not both",
                )
            )
        if self.sources and (self.name is not None or self.path is not None):
            errors.append(
                (
                    "sources",
                    "[[data.sources]] replaces data.name/data.path: move that dataset into the list",
                )
            )
        if self.name is None and (self.subsets or self.splits or self.probabilities):
            errors.append(
                (
                    "subsets" if self.subsets else "splits" if self.splits else "probabilities",
                    "subsets, splits and probabilities choose parts of data.name: set data.name",
                )
            )
        parts = max(len(self.subsets or []), len(self.splits or []))
        if self.subsets and self.splits and len(self.subsets) != len(self.splits):
            errors.append(
                (
                    "splits",
                    f"has {len(self.splits)} entries for {len(self.subsets)} subsets: "
                    "give one split per subset, or a single list",
                )
            )
        elif self.probabilities is not None and len(self.probabilities) != max(parts, 1):
            errors.append(
                (
                    "probabilities",
                    f"has {len(self.probabilities)} entries for {max(parts, 1)} "
                    "subsets/splits: give one share per subset/split",
                )
            )
        if self.probabilities is not None and any(p <= 0 for p in self.probabilities):
            errors.append(("probabilities", "every share must be positive"))
        if errors:
            raise field_errors(self, *errors)
        return self

    def resolved_sources(self) -> list[SFTSourceConfig]:
        """The data as a list of sources (one for `name`/`path`, one per subset/split of `name`,
        or `sources` as given)."""
        if self.sources:
            return list(self.sources)
        if self.name is None:
            return [self.file_source(self.path or BUILT_IN_DATA)]
        columns = self.model_dump(include=set(ColumnsConfig.model_fields))
        subsets: list[str | None] = [*self.subsets] if self.subsets else [None]
        splits = list(self.splits or ["train"])
        if len(subsets) == 1 and len(splits) > 1:
            subsets *= len(splits)
        elif len(splits) == 1 and len(subsets) > 1:
            splits *= len(subsets)
        weights = self.probabilities or [1.0] * len(subsets)
        return [
            SFTSourceConfig(name=self.name, subset=subset, split=split, weight=weight, **columns)
            for subset, split, weight in zip(subsets, splits, weights, strict=True)
        ]

    def file_source(self, path: str) -> SFTSourceConfig:
        """A source reading the file `path` with this table's columns (the data, or val_path)."""
        return SFTSourceConfig(
            path=path, **self.model_dump(include=set(ColumnsConfig.model_fields))
        )

    @property
    def is_built_in(self) -> bool:
        """Whether the data is the built-in reverse-text generator (alone)."""
        sources = self.resolved_sources()
        return self.type == "sft" and len(sources) == 1 and sources[0].path == BUILT_IN_DATA

    @property
    def label(self) -> str:
        """What the run trains on, for its name: the dataset, file, `mixture` or `fake`."""
        if self.type == "fake":
            return "fake"
        if self.sources:
            return self.sources[0].label if len(self.sources) == 1 else "mixture"
        return self.name.rsplit("/", 1)[-1] if self.name else self.path or BUILT_IN_DATA


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

    data: SFTDataConfig = (
        SFTDataConfig()
    )  # sft's own data table (the RL trainer's is TrainerDataConfig)
    """Training data."""

    num_processes: int = Field(1, ge=1)
    """Processes launched by torchrun (one per GPU; on CPU, gloo ranks)."""

    monitors: MonitorsConfig = MonitorsConfig()
    """Metric sinks for the step metrics (rank 0 writes them): metrics.jsonl, and wandb with
    `--monitors.wandb` (needs the wandb package)."""

    slurm: SlurmConfig | None = None
    """Submit the SFT as a SLURM batch job instead of running it here (bare `--slurm` or a
    `[slurm]` table; docs/slurm.md)."""

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
    def _fake_data_ends(self) -> Self:  # replaces the RL trainer's check of its `data.fake`
        if self.data.type == "fake" and self.max_steps is None:
            raise field_errors(
                self, ("max_steps", "fake data never ends: set max_steps (--max-steps N)")
            )
        return self

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
