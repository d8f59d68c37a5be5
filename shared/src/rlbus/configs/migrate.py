"""prime-rl configs in rlbus: one table of prime-rl keys and what each becomes here.

The table is used twice (docs/migration.md):
- loading unchanged (`rl @ prime-rl.toml`, `sft @ ...`): `RLConfig` and `SFTConfig` call
  `migrate_for_load` in a `model_validator(mode="before")`. Keys that map are moved (one stderr
  line each), keys meaningless here are dropped (one line each), and a key that needs a human
  stops the load with one line naming it and its rlbus equivalent;
- `rl migrate-config IN.toml [-o OUT.toml]` (`main`): writes the converted config and reports
  every key it moved, dropped or left for a human (exit 0: converted, 2: some keys need a human).

A rule names a prime-rl key; it covers the key and everything under it. Keys the table does not
name are left alone: they are rlbus keys already (most of prime-rl's layout is: `model.name`,
`max_steps`, `seq_len`, `[ckpt]`, `[monitors.wandb]`, `orchestrator.batch_size`, ...), or
unknown ones, which validation reports with a "did you mean".
"""

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Status = Literal["move", "convert", "drop", "human"]

_UNSET = object()


class Unmappable(ValueError):
    """A value under a converted key that has no rlbus meaning: `key` (a prime-rl path) and why."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"{key}: {why}")
        self.key = key
        self.why = why


@dataclass(frozen=True)
class Rule:
    """What one prime-rl key becomes: `move` to `rlbus`, `convert` with `convert` into `rlbus`,
    `drop` (meaningless here; `note` says why), or `human` (`rlbus` names what to set instead,
    or starts with "no equivalent:"). A `human` key whose value is `harmless` (prime-rl's
    default, which is also what rlbus does) is dropped instead."""

    prime: str
    status: Status
    rlbus: str = ""
    note: str = ""
    convert: Callable[[Any, dict], Any] | None = None
    harmless: Any = _UNSET


@dataclass(frozen=True)
class Change:
    """One key of a migration: what happened to it (`Rule.status`), and where it went or why."""

    prime: str
    status: Status
    rlbus: str = ""
    note: str = ""

    def line(self) -> str:
        if self.status in ("move", "convert"):
            return f"{self.prime} -> {self.rlbus}" + (f" ({self.note})" if self.note else "")
        if self.status == "drop":
            return f"{self.prime} ignored: {self.note}"
        return f"{self.prime} needs a human: {self.rlbus}" + (
            f" ({self.note})" if self.note else ""
        )


# --- nested-dict paths ------------------------------------------------------------------------


def get_path(data: dict, path: str) -> Any:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return _UNSET
        node = node[part]
    return node


def pop_path(data: dict, path: str) -> Any:
    """Remove `path` and return its value; parent tables emptied by the removal go too."""
    parts = path.split(".")
    parents = [data]
    for part in parts[:-1]:
        parents.append(parents[-1][part])
    value = parents[-1].pop(parts[-1])
    for parent, part in zip(reversed(parents[:-1]), reversed(parts[:-1]), strict=True):
        if parent[part] == {}:
            del parent[part]
    return value


def set_path(data: dict, path: str, value: Any) -> None:
    """Set `path` to `value`; a value already there wins (the rlbus spelling over the prime-rl
    one), tables are merged key by key."""
    parts = path.split(".")
    node = data
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}  # absent, or a bare `--slurm` (true): the empty table
        node = node[part]
    current = node.get(parts[-1], _UNSET)
    if current is _UNSET:
        node[parts[-1]] = value
    elif isinstance(current, dict) and isinstance(value, dict):
        node[parts[-1]] = {**value, **current}


# --- conversions ------------------------------------------------------------------------------


def _impl(value: Any, data: dict) -> Any:
    return {"hf": "transformers", "custom": "rlbus"}.get(value, value)


def _enabled(value: Any, data: dict) -> bool:
    return value not in (None, "None", False)


def _single(value: Any, data: dict) -> list:
    return [value]


def _min_lr_ratio(prefix: str) -> Callable[[Any, dict], float]:
    def convert(value: Any, data: dict) -> float:
        lr = get_path(data, f"{prefix}optim.lr")
        if lr is _UNSET:
            raise Unmappable(
                f"{prefix}scheduler.min_lr",
                f"set {prefix}scheduler.min_lr_ratio (min_lr / optim.lr): optim.lr is not set here",
            )
        return float(value) / float(lr)

    return convert


def _loss_roles(value: Any, data: dict) -> list[str]:
    """prime-rl's `data.loss_mask` (a flag per role, assistant only by default) as the roles that
    carry loss."""
    if not isinstance(value, dict):
        raise Unmappable("data.loss_mask", 'give data.loss_roles (e.g. ["assistant"])')
    flags = {"system": False, "user": False, "assistant": True, "tool": False} | value
    return [role for role, on in flags.items() if on]


def _needs_slurm(key: str, data: dict) -> None:
    if not isinstance(get_path(data, "slurm"), dict):
        raise Unmappable(
            key, "slurm.nodes: rlbus runs on several nodes only as a SLURM job; add [slurm]"
        )


def _num_infer_nodes(data: dict) -> int:
    nodes = get_path(data, "deployment.num_infer_nodes")
    if nodes is _UNSET:
        raise Unmappable(
            "deployment.num_infer_nodes",
            "slurm.inference_nodes (set it: prime-rl took it from inference.deployment)",
        )
    replicas = get_path(data, "deployment.num_infer_replicas")
    return int(nodes) * (1 if replicas is _UNSET else int(replicas))


def _slurm_nodes(value: Any, data: dict) -> int:
    """All nodes of the job: prime-rl's train nodes plus inference nodes (per replica)."""
    _needs_slurm("deployment.num_train_nodes", data)
    return int(value) + _num_infer_nodes(data)


def _slurm_inference_nodes(value: Any, data: dict) -> int:
    _needs_slurm("deployment.num_infer_nodes", data)
    return _num_infer_nodes(data)


SOURCE_DROPPED = ("name", "serve", "curriculum")
"""Keys of a prime-rl train env or source with no meaning here: the env id names it, and rlbus
has no curriculum gates (`orchestrator.filter_zero_advantage` drops groups without signal)."""

SOURCE_KEPT = ("id", "args")
"""Keys of an entry that are already rlbus's and may meet a converted taskset (its id, its args)."""

VF_ROLES = ("agent", "player")
VF_CONFIG_KEYS = ("taskset", "harness", "runtime", *VF_ROLES)
"""Keys of a verifiers 0.4 environment config, which prime-rl's newest layouts write directly
in the entry (`taskset = {...}`, `harness = {...}`) or under its `env`."""

VF_DEFAULT_ROLE = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}
"""A verifiers agent/player that rlbus's verifiers 0.4 envs use anyway (vf_server's defaults)."""

SAMPLING_KEYS = {"max_completion_tokens": "max_tokens", "max_tokens": "max_tokens"}
"""prime-rl sampling keys whose rlbus name differs; the others (temperature, top_p, stop, seed,
extra_body) are the same."""


def prime_env_id(raw: str) -> str:
    """The id a prime-rl environment has here: hub ids `owner/name[@version]` install (`prime env
    install`, `rl env install`) as the package `name`, found by that id."""
    if raw.startswith("vf:"):
        return raw
    return raw.rsplit("/", 1)[-1].split("@", 1)[0]


def _is_default_role(name: str, settings: Any) -> bool:
    """Whether one role setting is what vf_server uses anyway: the null harness (with or without
    the subprocess runtime inside it) or the subprocess runtime."""
    if name == "harness" and isinstance(settings, dict):
        runtime = settings.get("runtime", VF_DEFAULT_ROLE["runtime"])
        rest = {k: v for k, v in settings.items() if k != "runtime"}
        return rest == VF_DEFAULT_ROLE["harness"] and runtime == VF_DEFAULT_ROLE["runtime"]
    return VF_DEFAULT_ROLE.get(name) == settings


def _source_env(key: str, value: dict) -> dict:
    """`taskset.id` -> id; the rest is a verifiers 0.4 `EnvConfig` (taskset fields, harness,
    agent or player).

    Where the id resolves in rlbus's venv (a built-in, an entry point, a module) the other
    taskset keys become its flat `args` (the keys of a nested `task` table too) and the harness
    and roles are dropped. Otherwise it is a verifiers 0.4 environment (installed or to be
    installed in its own venv by `rl env install`): the config goes to `args.env`, which its env
    server deep-merges onto the default null harness and subprocess runtime
    (docs/environments.md); settings equal to those defaults are left out."""
    from rlbus.configs import orchestrator as orchestrator_config

    config = _deep_copy(value)
    taskset = config.get("taskset", {})
    if "id" not in taskset:
        raise Unmappable(f"{key}.taskset.id", "orchestrator.env[].id (set it)")
    env_id = prime_env_id(taskset.pop("id"))
    if orchestrator_config.resolves_in_rlbus_venv(env_id, orchestrator_config.known_env_ids()):
        task = taskset.pop("task", None)
        args = {**taskset, **(task if isinstance(task, dict) else {})}
        return {"id": env_id, **({"args": args} if args else {})}
    for name in ("harness", "runtime"):
        if name in config and _is_default_role(name, config[name]):
            config.pop(name)
    for role in VF_ROLES:
        settings = config.get(role)
        if isinstance(settings, dict):
            for name in list(settings):
                if _is_default_role(name, settings[name]):
                    settings.pop(name)
            if not settings:
                config.pop(role)
    if not taskset:
        config.pop("taskset")
    return {"id": env_id, **({"args": {"env": config}} if config else {})}


def _sampling(key: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise Unmappable(key, "orchestrator.env[].sampling (a table)")
    return {SAMPLING_KEYS.get(name, name): setting for name, setting in value.items()}


def _train_env(key: str, entry: Any) -> Any:
    """One entry of prime-rl's `orchestrator.train.env` / `.source` / `orchestrator.env`, in any
    of its layouts, as an `orchestrator.env[]` entry: `{id, name, args}` (older: the owner and the
    display name dropped), `env = {taskset, agent | player}`, or `taskset` and `harness` written
    in the entry itself; `ratio` -> weight, per-source `sampling` and `group_size` kept."""
    if not isinstance(entry, dict):
        return entry
    env: dict[str, Any] = {}
    vf_config = {name: entry[name] for name in VF_CONFIG_KEYS if name in entry}
    if isinstance(entry.get("env"), dict):
        vf_config = {**vf_config, **entry["env"]}
    if vf_config:
        env.update(_source_env(key, vf_config))
    for name, value in entry.items():
        if name == "ratio":
            env["weight"] = value
        elif name in SOURCE_KEPT:
            if name == "id" and isinstance(value, str):
                value = prime_env_id(value)
            if name == "args" and isinstance(env.get("args"), dict) and isinstance(value, dict):
                value = {**env["args"], **value}
            env[name] = value
        elif name == "sampling":
            env["sampling"] = _sampling(f"{key}.sampling", value)
        elif name not in (*SOURCE_DROPPED, "env", *VF_CONFIG_KEYS):
            env[name] = value  # rlbus's own (weight, group_size, limits) or a typo it names
    return env


def _each_entry(
    path: str, entry_of: Callable[[str, Any], Any] = _train_env
) -> Callable[[Any, dict], Any]:
    """A converter of the list at `path`: `entry_of` applied to each entry (not a list: kept)."""

    def convert(value: Any, data: dict) -> Any:
        if not isinstance(value, list):
            return value
        return [entry_of(f"{path}[{i}]", entry) for i, entry in enumerate(value)]

    return convert


def _train_envs(path: str) -> Callable[[Any, dict], Any]:
    return _each_entry(path, _train_env)


def _eval_env(key: str, entry: Any) -> Any:
    """One entry of prime-rl's `orchestrator.eval.env` / `.source` as an
    `orchestrator.eval.env[]` entry: as a training entry (`_train_env`), with its `name` kept (the
    name of its metrics) and its `group_size` / `rollouts_per_example` as `rollouts_per_example`."""
    env = _train_env(key, entry)
    if not isinstance(env, dict) or not isinstance(entry, dict):
        return env
    env.pop("weight", None)
    if isinstance(entry.get("name"), str):
        env["name"] = entry["name"]
    for name in ("group_size", "rollouts_per_example"):
        if name in env:
            env["rollouts_per_example"] = env.pop(name)
    return env


def _eval_envs(path: str) -> Callable[[Any, dict], Any]:
    return _each_entry(path, _eval_env)


def _skip_to_base(value: Any, data: dict) -> Any:
    return not value if isinstance(value, bool) else value


def _environment_to_envs(value: Any, data: dict) -> list:
    return [_train_env("orchestrator.environment", value)]


def _entry_env_id(entry: Any) -> Any:
    """The raw id an entry of any layout names (None when it names none)."""
    if not isinstance(entry, dict):
        return None
    for taskset in (entry.get("taskset"), get_path(entry, "env.taskset")):
        if isinstance(taskset, dict) and "id" in taskset:
            return taskset["id"]
    return entry.get("id")


def prime_env_sources(data: dict) -> dict[str, str]:
    """Environment id -> what installs it (`rl env install <it>`), for every environment a prime-rl
    config names, in any of its layouts: the hub id `owner/name[@version]` where it gives one."""
    entries: list[Any] = [get_path(data, "orchestrator.environment")]
    for path in ("orchestrator.env", "orchestrator.train.env", "orchestrator.train.source"):
        found = get_path(data, path)
        if isinstance(found, list):
            entries += found
    raw = [_entry_env_id(entry) for entry in entries]
    return {prime_env_id(r): r for r in raw if isinstance(r, str) and not r.startswith("vf:")}


# --- the table --------------------------------------------------------------------------------

RENDERER = "rlbus samples through vLLM's OpenAI chat API with the model's chat template"
TRAINER_DP_ONLY = "no equivalent: the rlbus trainer is data-parallel only (one rank per GPU)"


def _trainer_rules(prefix: str) -> list[Rule]:
    """Rules of prime-rl's trainer config, under `trainer.` (rl) or at the top (sft)."""
    p = prefix
    return [
        Rule(f"{p}model.impl", "convert", f"{p}model.impl", "hf -> transformers, custom -> rlbus", _impl),
        Rule(f"{p}model.seq_len", "move", f"{p}seq_len"),
        Rule(
            f"{p}model.ac", "convert", f"{p}model.activation_checkpointing",
            "full recompute; mode/freq/targets are not tunable", _enabled,
        ),
        Rule(f"{p}model.ac_offloading", "drop", note="rlbus does not offload activations"),
        Rule(f"{p}model.compile", "drop", note="the rlbus trainer runs eagerly"),
        Rule(f"{p}model.attn", "drop", note="the model implementation picks the attention kernel"),
        Rule(f"{p}model.reshard_after_forward", "drop", note="no FSDP in the rlbus trainer"),
        Rule(f"{p}model.reduce_dtype", "drop", note="gradients are reduced in the parameter dtype"),
        Rule(f"{p}model.lora.modules_to_save", "human", "no equivalent: LoRA trains adapters only", harmless=[]),
        Rule(f"{p}model.lora", "move", f"{p}lora", "rank, alpha, dropout, target_modules"),
        Rule(f"{p}model.full_offload.cpu_optimizer_backend", "move", f"{p}model.full_offload.backend"),
        Rule(f"{p}model.full_offload.numa_bind", "move", f"{p}model.full_offload.numa_binding"),
        Rule(f"{p}model.cp", "human", TRAINER_DP_ONLY, harmless=1),
        Rule(f"{p}model.tp", "human", TRAINER_DP_ONLY, harmless=1),
        Rule(f"{p}model.ep", "human", TRAINER_DP_ONLY, harmless="auto"),
        Rule(f"{p}model.dp_replicate", "human", TRAINER_DP_ONLY, harmless=1),
        Rule(
            f"{p}model.fsdp_cpu_offload", "human",
            f"{p}model.full_offload (parameters, gradients and optimizer state on the host)",
            harmless=False,
        ),
        Rule(f"{p}model.optimization_dtype", "human", f"{p}model.dtype", harmless="float32"),
        Rule(f"{p}model.quantization", "human", "no equivalent: rlbus trains unquantized"),
        Rule(f"{p}model.vlm", "human", "no equivalent: rlbus trains text-only models"),
        Rule(f"{p}optim.mu", "move", f"{p}optim.momentum"),
        Rule(f"{p}optim.betas1", "human", f"{p}optim.betas = [betas1, betas2]", harmless=0.9),
        Rule(f"{p}optim.betas2", "human", f"{p}optim.betas = [betas1, betas2]", harmless=0.999),
        Rule(f"{p}optim.nesterov", "human", "no equivalent: rlbus SGD has no Nesterov momentum", harmless=False),
        Rule(f"{p}scheduler.min_lr", "convert", f"{p}scheduler.min_lr_ratio", "min_lr / optim.lr", _min_lr_ratio(p)),
        Rule(f"{p}scheduler.decay_steps", "human", "no equivalent: rlbus decays until max_steps"),
        Rule(f"{p}loss.dppo_mask_low", "move", f"{p}loss.mask_low"),
        Rule(f"{p}loss.dppo_mask_high", "move", f"{p}loss.mask_high"),
        Rule(f"{p}loss.adv_tau", "human", "no equivalent: advantages enter the loss unscaled", harmless=1.0),
        Rule(f"{p}metrics_server", "move", f"{p}metrics", "host, port of /metrics"),
        Rule(f"{p}dist_timeout_seconds", "move", f"{p}collective_timeout_s"),
        Rule(f"{p}log.ranks_filter", "drop", note="every rank logs to its own file"),
        Rule(f"{p}tokenizer", "human", "no equivalent: the tokenizer is the model's (model.name)"),
        *(
            Rule(f"{p}{key}", "drop", note="no rlbus counterpart; training is unchanged")
            for key in (
                "gc", "matmul_precision", "memory_profiler_path", "trace_path", "heartbeat",
                "enable_router_replay", "enable_token_export", "rollout_transport",
            )
        ),
    ]  # fmt: skip


def _shared_rules(prefix: str) -> list[Rule]:
    """Rules of the blocks every prime-rl launcher config has (`prefix`: where they sit)."""
    p = prefix
    return [
        Rule(f"{p}log.json_logging", "move", f"{p}log.json_console", "files are always JSON"),
        *(
            Rule(f"{p}log.{key}", "drop", note="rlbus has one log level per process")
            for key in ("vf_level", "log_data", "interval")
        ),
        Rule(f"{p}ckpt.keep_interval", "human", "no equivalent: ckpt.keep_last keeps the newest N"),
        Rule(f"{p}ckpt.output_dir", "human", "no equivalent: checkpoints live in <run_dir>/checkpoints"),
        *(
            Rule(f"{p}ckpt.{key}", "drop", note="a resume restores the whole state")
            for key in ("skip_progress", "skip_scheduler", "skip_dataloader", "skip_optimizer")
        ),
        Rule(f"{p}ckpt.wait_for_weights_timeout", "drop", note="no rlbus counterpart"),
        Rule(f"{p}resume.dir", "human", "no equivalent: --run.name NAME --resume resumes <output_dir>/NAME"),
        Rule(f"{p}monitors.prime", "drop", note="no Prime Intellect platform monitor here"),
        Rule(f"{p}env_vars", "human", "no equivalent: export them in the shell (or slurm.setup)", harmless={}),
    ]  # fmt: skip


def _eval_rules(p: str) -> list[Rule]:
    """Rules of prime-rl's eval config, at `orchestrator.eval` (rl) or `eval` (sft)."""
    return [
        Rule(f"{p}.source", "convert", f"{p}.env",
             "as a training source; name kept, group_size -> rollouts_per_example",
             _eval_envs(f"{p}.source")),
        Rule(f"{p}.env", "convert", f"{p}.env",
             "owner/ of the id dropped; group_size -> rollouts_per_example", _eval_envs(f"{p}.env")),
        Rule(f"{p}.sampling.max_completion_tokens", "move", f"{p}.sampling.max_tokens"),
        Rule(f"{p}.group_size", "move", f"{p}.rollouts_per_example"),
        Rule(f"{p}.skip_first_step", "convert", f"{p}.eval_base_model",
             "skip_first_step = true -> eval_base_model = false", _skip_to_base),
        Rule(f"{p}.retrigger_on_resume", "drop", note="rlbus evaluates step 0 and the last "
             "step again after a restart unless their results are written (docs/evaluating.md)"),
    ]  # fmt: skip


def _launcher_rules() -> list[Rule]:
    """Top-level keys of prime-rl's `rl` and `sft`: deployment, SLURM, weight transfer."""
    return [
        Rule("model.vlm", "human", "no equivalent: rlbus trains text-only models"),
        Rule("tokenizer", "human", "no equivalent: the tokenizer is the model's (model.name)"),
        Rule("rollout_transport", "drop", note="rollouts travel over the NATS bus"),
        Rule("deployment.type", "drop", note="rlbus runs on several nodes when slurm.nodes > 1"),
        Rule("deployment.gpus_per_node", "human", "slurm.gpus_per_node (under [slurm]; locally every visible GPU)", harmless=8),
        Rule("deployment.num_train_nodes", "convert", "slurm.nodes",
             "train nodes + num_infer_nodes x num_infer_replicas", _slurm_nodes),
        Rule("deployment.num_infer_nodes", "convert", "slurm.inference_nodes",
             "num_infer_nodes x num_infer_replicas", _slurm_inference_nodes),
        Rule("deployment.nodes_per_fsdp_group", "human", TRAINER_DP_ONLY),
        Rule("deployment.orchestrator_on_inference", "drop",
             note="the orchestrator always runs on the first inference node"),
        Rule("slurm.pre_run_command", "convert", "slurm.setup", "a list of shell lines", _single),
        Rule("slurm.nodelist", "human", 'slurm.directives = ["--nodelist=..."]'),
        Rule("slurm.exclude", "human", 'slurm.directives = ["--exclude=..."]'),
        Rule("slurm.template_path", "human", "no equivalent: rlbus renders its own sbatch script"),
        Rule("slurm.project_dir", "drop", note="the job runs in the directory it is submitted from"),
        Rule("slurm.shared_fs", "drop", note="rlbus assumes a shared filesystem"),
        Rule("slurm.cleanup_grace_period", "drop", note="see slurm.grace_s (drain time on SIGTERM)"),
        Rule("weight_broadcast.timeout", "move", "weight_broadcast.timeout_s"),
        *(
            Rule(f"weight_broadcast.{key}", "drop", note="rlbus picks the rendezvous itself")
            for key in ("host", "port", "inference_world_size")
        ),
        Rule("weight_broadcast.quantize_in_weight_transfer", "human", "no equivalent: weights move unquantized", harmless=False),
    ]  # fmt: skip


RL_RULES: list[Rule] = [
    *_launcher_rules(),
    *_shared_rules(""),
    Rule("inference.vllm.data_parallel_size", "move", "deployment.num_infer_replicas",
         "one rlbus replica per data-parallel rank"),
    Rule("inference.parallel.dp", "move", "deployment.num_infer_replicas",
         "one rlbus replica per data-parallel rank"),
    Rule("inference.parallel.tp", "move", "inference.vllm.tensor_parallel_size"),
    Rule("orchestrator.train.sampling.max_completion_tokens", "move", "orchestrator.sampling.max_tokens"),
    Rule("orchestrator.train.sampling.temperature", "move", "orchestrator.sampling.temperature"),
    Rule("orchestrator.train.sampling.extra_body", "move", "orchestrator.sampling.extra_body"),
    Rule("orchestrator.train.filter_zero_advantages", "move", "orchestrator.filter_zero_advantage"),
    Rule("orchestrator.train.group_size", "move", "orchestrator.group_size"),
    Rule("orchestrator.train.source", "convert", "orchestrator.env",
         "taskset.id -> id (owner/ dropped), ratio -> weight, name and curriculum dropped; the "
         "other taskset keys -> args (an env of rlbus's venv) or the verifiers config -> args.env "
         "(a verifiers 0.4 env)", _train_envs("orchestrator.train.source")),
    Rule("orchestrator.train.env", "convert", "orchestrator.env",
         "owner/ of the id and name dropped; taskset.id -> id, the other taskset keys -> args",
         _train_envs("orchestrator.train.env")),
    Rule("orchestrator.environment", "convert", "orchestrator.env",
         "one environment; owner/ of the id dropped", _environment_to_envs),
    Rule("orchestrator.env", "convert", "orchestrator.env", "owner/ of the id and name dropped",
         _train_envs("orchestrator.env")),
    Rule("orchestrator.token_batch_size", "move", "orchestrator.token_budget"),
    Rule("orchestrator.concurrency.max_inflight", "move", "orchestrator.max_concurrency", "per worker"),
    Rule("orchestrator.concurrency", "drop", note="rlbus keeps orchestrator.max_concurrency samples in flight from the start"),
    Rule("orchestrator.renderer", "drop", note=RENDERER),
    Rule("orchestrator.tokenizer", "human", "no equivalent: the tokenizer is the model's (model.name)"),
    Rule("orchestrator.model.lora.name", "move", "trainer.lora.name", "the adapter's served name"),
    Rule("orchestrator.model.lora", "drop", note="the adapter's shape is trainer.lora"),
    Rule("orchestrator.model.client.base_url", "convert", "orchestrator.inference_urls", "a list", _single),
    Rule("orchestrator.model.client", "drop", note="rlbus finds replicas in its registry"),
    *_eval_rules("orchestrator.eval"),
    Rule("orchestrator.algo", "human", "no equivalent: rlbus computes GRPO advantages "
         "(orchestrator.normalize_advantages, trainer.loss.type; docs/algorithms.md)",
         harmless={"type": "grpo"}),
    Rule("orchestrator.tasks_per_minute", "human", "no equivalent: no task rate limit"),
    *(
        Rule(f"orchestrator.{key}", "drop", note="no rlbus counterpart; rollouts are unchanged")
        for key in (
            "collect_inference_metrics", "inference_metrics_roles", "env_server_base_port",
            "pad_to_multiple_of", "num_train_workers", "heartbeat", "rollout_transport", "monitors.prime",
        )
    ),
    *_trainer_rules("trainer."),
    Rule("inference.server.liveness_timeout_seconds", "drop", note="see inference.health"),
    Rule("inference.deployment", "human", "deployment.num_infer_replicas (and slurm.inference_nodes)"),
    Rule("inference.router", "human", "no equivalent: rlbus runs no router; rollout workers "
         "spread requests over replicas"),
    Rule("inference.kv_cache_offload", "human", "no equivalent (vLLM flags pass through inference.vllm)"),
]  # fmt: skip
"""prime-rl `rl` keys (RLConfig)."""

SFT_RULES: list[Rule] = [
    *_launcher_rules(),
    *_shared_rules(""),
    Rule("data.seq_len", "move", "seq_len"),
    Rule("data.loss_mask", "convert", "data.loss_roles", "the roles set to true", _loss_roles),
    Rule("data.length", "move", "data.fake.length"),
    Rule("data.input_ids", "move", "data.fake.input_ids"),
    Rule("data.stopping_strategy", "drop",
         note="each source of a mixture cycles by itself (prime-rl's all_exhausted)"),
    *(
        Rule(f"data.{key}", "drop", note="rlbus packs rows by seq_len and tokens_per_forward")
        for key in ("micro_batch_size", "num_workers")
    ),
    Rule("data.shuffle", "human", "no equivalent: rlbus shuffles every epoch, seeded by the run's "
         "seed", harmless=True),
    Rule("data.seed", "drop", note="the data is shuffled by the run's seed"),
    Rule("val", "human", "data.val_path and data.val_interval (validation loss)"),
    *_eval_rules("eval"),
    Rule("inference", "drop", note="the server sft starts for its evaluations takes eval.inference"),
    Rule("renderer", "drop", note="rlbus applies the tokenizer's chat template"),
    Rule("deployment.num_train_gpus", "move", "num_processes"),
    Rule("deployment.num_infer_gpus", "drop", note="sft's evaluation server is one replica (eval.inference)"),
    *_trainer_rules(""),
]  # fmt: skip
"""prime-rl `sft` keys (SFTConfig)."""

TRAINER_RULES: list[Rule] = [*_shared_rules(""), *_trainer_rules("")]
"""prime-rl `trainer` keys (its standalone trainer config, e.g. configs/debug/fake/rl.toml)."""

RULES = {"rl": RL_RULES, "sft": SFT_RULES, "trainer": TRAINER_RULES}


# --- applying the table -----------------------------------------------------------------------


def _ordered(rules: list[Rule]) -> list[Rule]:
    """Deeper keys first, so `model.lora.modules_to_save` is looked at before `model.lora`."""
    return sorted(rules, key=lambda rule: -rule.prime.count("."))


def migrate(data: dict, kind: Literal["rl", "sft", "trainer"]) -> tuple[dict, list[Change]]:
    """`data` (a parsed config, not modified) with every prime-rl key the table names handled,
    and what happened to each. `human` keys are removed from the result."""
    order = {path: i for i, path in enumerate(leaf_paths(data))}
    data = _deep_copy(data)
    changes: list[Change] = []
    for rule in _ordered(RULES[kind]):
        value = get_path(data, rule.prime)
        if value is _UNSET:
            continue
        applied = _apply(rule, value, data)
        if applied is None:
            continue
        change, new_value = applied
        pop_path(data, rule.prime)
        changes.append(change)
        if change.status in ("move", "convert"):
            set_path(data, rule.rlbus, new_value)
    changes.sort(key=lambda c: min((i for p, i in order.items() if _under(p, c.prime)), default=0))
    return data, changes


def leaf_paths(data: dict, prefix: str = "") -> list[str]:
    """Dotted paths of every value in `data`, in file order (a list counts as one value)."""
    paths = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        paths += leaf_paths(value, path + ".") if isinstance(value, dict) and value else [path]
    return paths


def _under(path: str, prefix: str) -> bool:
    prefix = prefix.split("[")[0]  # `orchestrator.train.source[0].sampling` is in the source list
    return path == prefix or path.startswith(prefix + ".")


def _apply(rule: Rule, value: Any, data: dict) -> tuple[Change, Any] | None:
    """The change `rule` makes to `value` and the value it writes; None when it leaves the key
    as it is."""
    if rule.status == "human":
        if rule.harmless is not _UNSET and value == rule.harmless:
            return Change(
                rule.prime, "drop", note="prime-rl's default, which is what rlbus does"
            ), None
        return Change(rule.prime, "human", rule.rlbus, rule.note), None
    new = value
    if rule.convert is not None:
        try:
            new = rule.convert(value, data)
        except Unmappable as error:
            return Change(error.key, "human", error.why), None
        if rule.rlbus == rule.prime and new == value:
            return None
    return Change(rule.prime, rule.status, rule.rlbus, rule.note), new


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def migrate_for_load(data: Any, kind: Literal["rl", "sft", "trainer"]) -> Any:
    """The before-validator of `RLConfig` / `SFTConfig`: prime-rl keys that map are read as their
    rlbus keys (one stderr line each); keys that need a human are a validation error, one line
    per key naming the rlbus equivalent."""
    if not isinstance(data, dict):
        return data
    migrated, changes = migrate(data, kind)
    if not changes:
        return data
    human = [c for c in changes if c.status == "human"]
    if human:
        raise _human_errors(kind, human)
    for change in changes:
        print(f"{kind}: prime-rl key {change.line()}", file=sys.stderr)
    return migrated


def _human_errors(kind: str, changes: list[Change]) -> Exception:
    from pydantic import ValidationError
    from pydantic_core import InitErrorDetails, PydanticCustomError

    details = []
    for change in changes:
        message = f"prime-rl key, in rlbus: {change.rlbus}" + (
            f" ({change.note})" if change.note else ""
        )
        message += " (`rl migrate-config FILE` converts the rest)"
        details.append(
            InitErrorDetails(
                type=PydanticCustomError(
                    "prime_rl_key", message.replace("{", "{{").replace("}", "}}")
                ),
                loc=tuple(change.prime.split(".")),
                input=None,
            )
        )
    return ValidationError.from_exception_data(f"{kind} config", details)
