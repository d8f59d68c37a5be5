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


class EvalConfig(BaseConfig):
    """Evaluation on the eval split; reported as metrics, never blocks training."""

    interval: int = Field(10, ge=1)
    """Evaluate every N steps."""

    num_examples: int = Field(64, ge=1)
    """Problems per evaluation."""

    greedy: bool = True
    """Greedy decoding (otherwise the training sampling args)."""


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
        errors = self.group_size_errors()
        # Without the orchestrator installed (a launcher-only or trainer image) the group is
        # empty and nothing can be said about ids; the orchestrator checks them when it starts.
        known = known_env_ids()
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
