"""Orchestrator service config (`orchestrator` command): coordinator and rollout workers."""

import difflib
import importlib.util
from importlib.metadata import entry_points
from typing import Any, Literal

from pydantic import Field, model_validator

from rlbus import envindex
from rlbus.configs.base import BaseConfig, field_errors
from rlbus.configs.common import ModelConfig, RunnableConfig
from rlbus.netutil import check_http_url


class SamplingConfig(BaseConfig):
    """Sampling arguments sent with every completion request."""

    temperature: float = Field(1.0, ge=0)
    """Sampling temperature (the trainer rescales logits by it)."""

    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling."""

    max_tokens: int = Field(128, ge=1)
    """Maximum completion tokens per turn."""

    stop: list[str] = []
    """Stop strings (the completion ends before the first one it produces)."""

    seed: int | None = None
    """Sampling seed (sample i of a group is seeded seed + i); None: unseeded."""

    extra_body: dict[str, Any] = {}
    """Extra fields for the OpenAI request body (deep-merged with file values)."""


class EnvSamplingConfig(BaseConfig):
    """Sampling of one environment: a field set here replaces `orchestrator.sampling`'s for this
    environment's tasks; a field left unset (None) falls back to it."""

    temperature: float | None = Field(None, ge=0)
    """Sampling temperature (None: orchestrator.sampling.temperature)."""

    top_p: float | None = Field(None, gt=0, le=1)
    """Nucleus sampling (None: orchestrator.sampling.top_p)."""

    max_tokens: int | None = Field(None, ge=1)
    """Maximum completion tokens per turn (None: orchestrator.sampling.max_tokens)."""

    stop: list[str] | None = None
    """Stop strings (None: orchestrator.sampling.stop)."""

    seed: int | None = None
    """Sampling seed (None: orchestrator.sampling.seed)."""

    extra_body: dict[str, Any] | None = None
    """Extra request body fields, merged over orchestrator.sampling.extra_body (these win)."""

    def over(self, base: SamplingConfig) -> SamplingConfig:
        """`base` with the fields set here replacing its own (`extra_body` merged key by key)."""
        update = {name: value for name, value in self if value is not None}
        if self.extra_body is not None:
            update["extra_body"] = {**base.extra_body, **self.extra_body}
        return base.model_copy(update=update)


class DifficultyFilterConfig(BaseConfig):
    """Skip prompts that are too easy or too hard for a while (docs/orchestrator.md,
    "Difficulty filtering"): a prompt whose groups came back all solved, or all failed, on
    `consecutive` visits in a row is not issued for `skip_steps` steps, then is eligible again
    with its streak restarted. Only environments with a finite train set are tracked (a
    generated one never repeats a prompt)."""

    enabled: bool = False
    """Track each prompt's outcomes and skip the easy and hard ones (off by default)."""

    consecutive: int = Field(2, ge=1)
    """Visits in a row, each all solved (or each all failed), that make a prompt skipped."""

    skip_steps: int = Field(20, ge=1)
    """Steps a prompt stays skipped: from the step being built when its streak completed."""

    solved_threshold: float = 1.0
    """A sample with reward >= this is solved; a group is all solved when every sample is."""

    failed_threshold: float = 0.0
    """A sample with reward <= this is failed; a group is all failed when every sample is."""

    @model_validator(mode="after")
    def _check_thresholds(self) -> "DifficultyFilterConfig":
        if self.failed_threshold >= self.solved_threshold:
            raise field_errors(
                self,
                (
                    "failed_threshold",
                    f"must be below solved_threshold ({self.solved_threshold}): a sample "
                    "cannot be both solved and failed",
                ),
            )
        return self


class EnvDifficultyFilterConfig(BaseConfig):
    """The difficulty filter of one environment's prompts: a field set here replaces
    `orchestrator.difficulty_filter`'s; a field left unset (None) falls back to it."""

    enabled: bool | None = None
    """Filter this environment's prompts (None: orchestrator.difficulty_filter.enabled)."""

    consecutive: int | None = Field(None, ge=1)
    """Visits in a row that skip a prompt (None: orchestrator.difficulty_filter.consecutive)."""

    skip_steps: int | None = Field(None, ge=1)
    """Steps a prompt stays skipped (None: orchestrator.difficulty_filter.skip_steps)."""

    solved_threshold: float | None = None
    """Solved at reward >= this (None: orchestrator.difficulty_filter.solved_threshold)."""

    failed_threshold: float | None = None
    """Failed at reward <= this (None: orchestrator.difficulty_filter.failed_threshold)."""

    def over(self, base: DifficultyFilterConfig) -> DifficultyFilterConfig:
        """`base` with the fields set here replacing its own (checked by OrchestratorConfig)."""
        return base.model_copy(update={name: value for name, value in self if value is not None})


class EnvConfig(BaseConfig):
    """One environment, found by id: built-in, installed package (entry point), or verifiers."""

    id: str = "reverse-text"
    """Environment id."""

    args: dict[str, Any] = {}
    """Keyword arguments for the environment (JSON on the CLI)."""

    weight: float = Field(1.0, gt=0)
    """Share of tasks drawn from this environment."""

    sampling: EnvSamplingConfig = EnvSamplingConfig()
    """Sampling of this environment's tasks; unset fields fall back to orchestrator.sampling."""

    group_size: int | None = Field(None, ge=1)
    """Samples per problem of this environment (None: orchestrator.group_size)."""

    max_turns: int | None = Field(None, ge=1)
    """Model turns per episode (None: no limit; single-turn environments ignore it)."""

    max_total_tokens: int | None = Field(None, ge=1)
    """Tokens of a whole episode: prompt, completions and environment messages (None:
    orchestrator.seq_len, the sequence it trains as; with `rl`, also the engine's context, where
    a longer request would be refused)."""

    episode_timeout_s: float | None = Field(None, gt=0)
    """Wall-clock seconds per episode, from its first request (None: no limit). An episode still
    running a few seconds past it is cancelled and left out of its group (a partial group,
    docs/orchestrator.md)."""

    difficulty_filter: EnvDifficultyFilterConfig = EnvDifficultyFilterConfig()
    """This environment's difficulty filter; unset fields fall back to
    orchestrator.difficulty_filter."""


ENV_ENTRY_POINT_GROUP = "rlbus.environments"
"""Entry point group of environment factories; the orchestrator registers its built-ins here."""


VF_PREFIX = "vf:"
"""Ids of verifiers 0.4 environments served from their own venv (rlbus_orchestrator.envs.vf_server)."""


def known_env_ids() -> list[str]:
    """Environment ids registered in installed package metadata (nothing is imported)."""
    return sorted({ep.name for ep in entry_points(group=ENV_ENTRY_POINT_GROUP)})


def resolves_in_rlbus_venv(env_id: str, known: list[str]) -> bool:
    """Whether `env_id` is found in rlbus's own venv: an entry point (`known`, built-ins
    included) or an importable verifiers-style module `my_env` (`find_spec`, nothing imported)."""
    if env_id in known:
        return True
    try:
        return importlib.util.find_spec(env_id.replace("-", "_")) is not None
    except (ImportError, ValueError):  # a dotted id whose parent is no package, an empty id
        return False


def unknown_env_error(env_id: str, known: list[str]) -> str | None:
    """Why `env_id` names no environment, or None when it resolves the way the orchestrator's
    registry resolves it (entry point, an importable verifiers-style module `my_env`, or an
    environment `rl env install` recorded in the index, rlbus.envindex).

    Only metadata, `find_spec` and the index file are consulted, so `rl --dry-run` stays fast: a
    module that is found but fails on import still fails later, in the orchestrator, with its
    traceback."""
    if env_id.startswith(VF_PREFIX) or resolves_in_rlbus_venv(env_id, known):
        return None
    try:
        installed = sorted(envindex.read_index())
    except ValueError as error:
        return f"unknown environment {env_id!r}: {error}"
    if env_id in installed:
        return None
    close = difflib.get_close_matches(env_id, known + installed, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    in_venvs = f"; in their own venvs: {', '.join(installed)}" if installed else ""
    return (
        f"unknown environment {env_id!r}; {hint}known ids: {', '.join(known)}{in_venvs}; or "
        f"'{VF_PREFIX}<taskset-id>' for a verifiers 0.4 environment server; install it with "
        f"{envindex.install_command(env_id)} (docs/environments.md)"
    )


class EvalEnvConfig(BaseConfig):
    """One environment to evaluate on (`[[orchestrator.eval.env]]`): its own id, data, sampling
    and schedule; never trained on."""

    id: str = "reverse-text"
    """Environment id (as `orchestrator.env[].id`)."""

    name: str | None = None
    """Name in the metric keys (`eval/<name>/...`) and sample files (None: the id); two entries
    of one id need names of their own."""

    args: dict[str, Any] = {}
    """Keyword arguments for the environment: its data too, for an environment that reads a file
    or a dataset (e.g. `args.data_path`)."""

    split: Literal["train", "eval"] = "eval"
    """Which split of the environment's data to evaluate on."""

    num_examples: int | None = Field(None, ge=1)
    """Problems per evaluation: the first N of the split (None: `eval.num_examples`; never more
    than the split has)."""

    rollouts_per_example: int | None = Field(None, ge=1)
    """Samples per problem, `n` (None: `eval.rollouts_per_example`); pass@k needs k <= n."""

    pass_k: list[int] | None = None
    """The k's of pass@k and mean@k (None: `eval.pass_k`); k's above n are left out."""

    pass_threshold: float | None = None
    """A sample passes when its reward is at least this (None: `eval.pass_threshold`)."""

    interval: int | None = Field(None, ge=1)
    """Evaluate this environment every N steps (None: `eval.interval`)."""

    sampling: EnvSamplingConfig = EnvSamplingConfig()
    """Sampling of this environment's eval requests, over `eval.sampling` (unset fields fall
    back)."""

    max_turns: int | None = Field(None, ge=1)
    """Model turns per episode (None: no limit)."""

    max_total_tokens: int | None = Field(None, ge=1)
    """Tokens of a whole episode (None: orchestrator.seq_len)."""

    episode_timeout_s: float | None = Field(None, gt=0)
    """Wall-clock seconds per episode (None: no limit)."""

    @property
    def label(self) -> str:
        """The name of its metrics and files: `name`, else the id."""
        return self.name or self.id


class EvalConfig(BaseConfig):
    """Evaluations during training (docs/evaluating.md): reported as `eval/<env>/*`, written to
    `<run_dir>/evals/`, never trained on, never in the way of training."""

    interval: int = Field(10, ge=1)
    """Evaluate every N steps (an environment may set its own)."""

    eval_base_model: bool = True
    """Evaluate the weights the run starts from, as step 0."""

    eval_last_step: bool = True
    """Evaluate the last step (`max_steps`) too, whatever the interval; the run ends once it is in."""

    env: list[EvalEnvConfig] = []
    """Environments to evaluate on (empty: the eval split of each training environment)."""

    num_examples: int = Field(64, ge=1)
    """Problems per evaluation of an environment that sets none."""

    rollouts_per_example: int = Field(1, ge=1)
    """Samples per problem of an environment that sets none."""

    pass_k: list[int] = [1]
    """The k's of pass@k and mean@k reported (k's above an environment's n are left out)."""

    pass_threshold: float = 1.0
    """A sample passes (pass@k) when its reward is at least this."""

    greedy: bool = True
    """Decode greedily (temperature 0) an environment sampled once per problem whose temperature
    neither `eval.sampling` nor its own sampling sets; otherwise the sampling below applies."""

    sampling: EnvSamplingConfig = EnvSamplingConfig()
    """Sampling of every eval request, over orchestrator.sampling (unset fields fall back)."""

    max_concurrency: int = Field(64, ge=1)
    """Eval samples in flight per rollout worker, on top of (never taken from) the training
    budget `max_concurrency`."""

    timeout_s: float = Field(900.0, gt=0)
    """An evaluation whose rollouts are not all back this long after its tasks went out is
    reported with the missing ones counted as failed."""

    def envs(self, train: list[EnvConfig]) -> list[EvalEnvConfig]:
        """The environments to evaluate: `env`, else one per training environment (its id,
        args, episode limits and sampling, on its eval split)."""
        if self.env:
            return self.env
        return [
            EvalEnvConfig(
                id=e.id,
                args=e.args,
                sampling=e.sampling,
                max_turns=e.max_turns,
                max_total_tokens=e.max_total_tokens,
                episode_timeout_s=e.episode_timeout_s,
            )
            for e in train
        ]

    def env_interval(self, env: EvalEnvConfig) -> int:
        return env.interval or self.interval

    def is_due(self, env: EvalEnvConfig, step: int, max_steps: int | None) -> bool:
        """Whether `env` is evaluated on the weights of `step` (0: the starting weights)."""
        if step == 0:
            return self.eval_base_model
        if step == max_steps and self.eval_last_step:
            return True
        return step % self.env_interval(env) == 0

    def label_errors(self) -> list[tuple[str, str]]:
        labels = [e.label for e in self.env]
        return [
            (
                f"eval.env.{i}.name",
                f"{label!r} names two eval environments: give each entry of one id its own name",
            )
            for i, label in enumerate(labels)
            if label in labels[:i]
        ]


class SamplesConfig(BaseConfig):
    """Rollout samples kept for people to read (`rl rollouts`, a wandb table): every `interval`
    steps, `per_env` samples of each environment of the step's batch go to
    `<run_dir>/rollouts/step_<N>.jsonl` (rlbus.samples)."""

    interval: int = Field(10, ge=1)
    """Keep samples of every N-th step (and of step 1)."""

    per_env: int = Field(8, ge=1)
    """Samples per environment: one of each group first, then second ones, and so on."""


class InferenceHttpConfig(BaseConfig):
    """Deadlines and back-off of the rollout workers' HTTP calls to inference replicas."""

    connect_timeout_s: float = Field(5.0, gt=0)
    """Connecting to a replica (also the write and connection-pool timeouts)."""

    read_timeout_s: float = Field(300.0, gt=0)
    """Waiting for a replica's answer: a completion is one response, so this bounds one turn."""

    max_attempts: int = Field(4, ge=1)
    """Replicas tried for one request before the task waits for a replica."""

    backoff_s: float = Field(1.0, gt=0)
    """A replica that fails (connection error, timeout, 5xx) is skipped this long ..."""

    backoff_max_s: float = Field(30.0, gt=0)
    """... doubling at each further failure up to this; one success resets it."""

    no_replica_wait_s: float = Field(60.0, ge=0)
    """With every replica down, a task waits this long for one (registry re-read meanwhile)
    before it is nak'ed for later."""

    @model_validator(mode="after")
    def _check_backoff(self) -> "InferenceHttpConfig":
        if self.backoff_max_s < self.backoff_s:
            raise ValueError(
                f"http.backoff_max_s ({self.backoff_max_s}) must be >= http.backoff_s "
                f"({self.backoff_s}): the back-off doubles from backoff_s up to backoff_max_s"
            )
        return self


class OrchestratorConfig(RunnableConfig):
    """The orchestrator: task coordinator, rollout workers, advantages, batch assembly."""

    # Run directory, bus, logging, tracing: the RunnableConfig block (`rl` pushes its own values
    # down). Step metrics go on the bus; `rl`'s monitor process writes them (RLConfig.monitors).

    role: Literal["all", "coordinator", "worker"] = "all"
    """`all`: coordinator with in-process workers; `coordinator`: the coordinator alone;
    `worker`: standalone rollout workers. A run has one coordinator: a second `all` or
    `coordinator` process waits as a standby (its workers run) and takes over when the first
    one ends or dies (docs/orchestrator.md, "One coordinator per run")."""

    leader_ttl_s: int = Field(10, ge=1)
    """TTL of the coordinator's leader lease: a standby takes over at most this long after the
    leader died (at once when it ends cleanly, or died on the same host)."""

    model: ModelConfig = ModelConfig()
    """Model name sent to inference."""

    env: list[EnvConfig] = Field([EnvConfig()], min_length=1)
    """Environments to train on (at least one)."""

    sampling: SamplingConfig = SamplingConfig()
    """Sampling arguments."""

    batch_size: int = Field(128, ge=1)
    """Rollouts (samples) per training step."""

    group_size: int = Field(8, ge=1)
    """Samples per problem (GRPO group); an environment may set its own (env[].group_size)."""

    min_group_size: int = Field(2, ge=1)
    """A group whose failed or timed-out episodes leave fewer samples than this is dropped
    whole; with at least this many it trains on the survivors. At most every group size (a
    group smaller than the default 2 uses its own size as the minimum)."""

    token_budget: int | None = Field(None, ge=1)
    """Assemble a step by token count instead of batch_size."""

    async_level: int = Field(1, ge=0)
    """Steps the orchestrator may run ahead of the newest weights inference applied (0: synchronous)."""

    max_off_policy_steps: int = Field(8, ge=0)
    """Drop rollouts generated by weights older than this many steps (counted and reported)."""

    task_timeout_s: float | None = Field(900.0, gt=0)
    """A training task whose rollout has not come back this long after it was issued is dropped
    (counted as `timeout`) and replaced, so a task lost anywhere never stalls the run; a rollout
    arriving later is ignored. None: wait forever."""

    normalize_advantages: bool = False
    """Divide advantages by the group reward std."""

    filter_zero_advantage: bool = True
    """Drop groups whose rewards are all equal (no learning signal)."""

    difficulty_filter: DifficultyFilterConfig = DifficultyFilterConfig()
    """Skip prompts solved, or failed, by every sample of their last groups for a while (off
    unless `enabled`)."""

    seq_len: int = Field(2048, ge=8)
    """Micro-batch row length (tokens) when packing for the trainer."""

    share_prefixes: bool = True
    """Pack a group's shared prompt once, followed by its samples' completions (same loss and
    gradients on fewer trained tokens; docs/orchestrator.md "Packing"). False: one sequence per
    sample."""

    num_train_ranks: int = Field(1, ge=1)
    """Trainer data-parallel ranks to pack for."""

    num_workers: int = Field(1, ge=1)
    """In-process rollout workers (role `all`)."""

    max_concurrency: int = Field(256, ge=1)
    """Samples in flight per worker. vLLM generates faster the more sequences it can batch: the
    reverse-text example stepped ~10 % faster with 256 than with 32 (docs/orchestrator.md,
    "Rollout workers")."""

    inference_urls: list[str] = []
    """Static OpenAI API roots (e.g. http://host:8000/v1) used instead of the replica registry."""

    http: InferenceHttpConfig = InferenceHttpConfig()
    """Timeouts and replica back-off of the calls to inference."""

    max_steps: int | None = Field(None, ge=1)
    """Stop after this many steps."""

    seed: int = 0
    """Data order seed."""

    eval: EvalConfig | None = None
    """Evaluation (off unless set)."""

    samples: SamplesConfig | None = SamplesConfig()
    """Samples of the batches written for reading (None: none)."""

    def env_group_size(self, env: EnvConfig) -> int:
        """Samples per problem of `env` (its own group_size, else the orchestrator's)."""
        return env.group_size or self.group_size

    def env_min_group_size(self, env: EnvConfig) -> int:
        """Fewest samples a group of `env` trains with; the default 2 gives way to a smaller
        group (a group of 1 is trained whole or dropped), a value set explicitly does not."""
        group_size = self.env_group_size(env)
        if "min_group_size" in self.model_fields_set:
            return self.min_group_size
        return min(self.min_group_size, group_size)

    def env_difficulty_filter(self, env: EnvConfig) -> DifficultyFilterConfig:
        """The difficulty filter of `env`'s prompts (its own fields over the orchestrator's)."""
        return env.difficulty_filter.over(self.difficulty_filter)

    def difficulty_filter_errors(self) -> list[tuple[str, str]]:
        """An environment's thresholds, resolved against the orchestrator's, in the wrong order."""
        errors = []
        for i, env in enumerate(self.env):
            resolved = self.env_difficulty_filter(env)
            own = env.difficulty_filter
            if resolved.failed_threshold < resolved.solved_threshold:
                continue
            name = "failed_threshold" if own.failed_threshold is not None else "solved_threshold"
            errors.append(
                (
                    f"env.{i}.difficulty_filter.{name}",
                    f"env[{i}] ({env.id!r}) would call a sample failed at reward <= "
                    f"{resolved.failed_threshold} and solved at >= {resolved.solved_threshold}: "
                    "failed_threshold must be below solved_threshold",
                )
            )
        return errors

    def group_size_errors(self) -> list[tuple[str, str]]:
        """The batch size against the group sizes, and the group sizes against min_group_size
        (docs/orchestrator.md, "Several environments")."""
        errors = []
        sizes = sorted({self.env_group_size(env) for env in self.env})
        if self.token_budget is None and len(sizes) == 1 and self.batch_size % sizes[0]:
            size, num = sizes[0], self.batch_size // sizes[0]
            errors.append(
                (
                    "batch_size",
                    f"must be a multiple of group_size ({size}): a step takes whole groups, so "
                    f"{self.batch_size} samples cannot be filled exactly; use "
                    f"{num * size or size} or {(num + 1) * size}",
                )
            )
        elif self.token_budget is None and self.batch_size < sizes[-1]:
            errors.append(
                (
                    "batch_size",
                    f"must be at least the largest group size ({sizes[-1]}, of the group sizes "
                    f"{', '.join(map(str, sizes))} of the environments): a step takes whole groups",
                )
            )
        for i, env in enumerate(self.env):
            size = self.env_group_size(env)
            where = f"env.{i}.group_size" if env.group_size else "min_group_size"
            if size < self.env_min_group_size(env) and where not in dict(errors):
                errors.append(
                    (
                        where,
                        f"group size {size} of env[{i}] ({env.id!r}) is below min_group_size "
                        f"({self.min_group_size}): its groups could never train; lower "
                        "min_group_size or raise the group size",
                    )
                )
        return errors

    def cross_field_errors(self) -> list[tuple[str, str]]:
        """(field, message) for each rule between fields that this config breaks."""
        errors = self.group_size_errors() + self.difficulty_filter_errors()
        if self.eval is not None:
            errors += self.eval.label_errors()
        # Without the orchestrator installed (a launcher-only or trainer image) the group is
        # empty and nothing can be said about ids; the orchestrator checks them when it starts.
        known = known_env_ids()
        eval_envs = self.eval.env if self.eval is not None else []
        for i, eval_env in enumerate(eval_envs if known else []):
            message = unknown_env_error(eval_env.id, known)
            if message:
                errors.append((f"eval.env.{i}.id", message))
        for i, env in enumerate(self.env if known else []):
            message = unknown_env_error(env.id, known)
            if message:
                errors.append((f"env.{i}.id", message))
            elif env.id.startswith(VF_PREFIX) and not ({"python", "address"} & env.args.keys()):
                errors.append(
                    (
                        f"env.{i}.args",
                        f"{env.id!r} is served from its own venv: set args.python (that venv's "
                        "interpreter) or args.address (a running verifiers EnvServer); see "
                        "docs/environments.md",
                    )
                )
        for i, url in enumerate(self.inference_urls):
            try:
                check_http_url(url, example="an OpenAI API root such as http://host:8000/v1")
            except ValueError as error:
                errors.append(("inference_urls", f"entry {i}: {error}"))
        return errors

    @model_validator(mode="after")
    def _check_cross_fields(self) -> "OrchestratorConfig":
        errors = self.cross_field_errors()
        if errors:
            raise field_errors(self, *errors)
        return self
