"""Inference service config (`inference` command): vLLM engine behind the public gate."""

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import ByteSize, ConfigDict, Field, field_validator, model_validator

from rlbus.configs.base import BaseConfig, field_errors
from rlbus.configs.common import ServiceConfig, WeightBroadcastConfig
from rlbus.configs.slurm import SlurmConfig
from rlbus.netutil import check_http_url

TOOL_CALL_PARSERS = {
    "qwen2": "hermes",
    "qwen2_moe": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "llama": "llama3_json",
    "mistral": "mistral",
    "granite": "granite",
}
"""vLLM's tool-call parser for a model family (`model_type` of config.json): the format the
family's chat template teaches the model to call tools in."""


def tool_call_parser_of(model: str, setting: str | None) -> str | None:
    """The `--tool-call-parser` for `model` under the `tool_call_parser` setting (see there)."""
    if setting is None or setting == "none":
        return None
    if setting != "auto":
        return setting
    try:
        config = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # a hub id, or a directory without a readable config: no guess
    return (
        TOOL_CALL_PARSERS.get(str(config.get("model_type"))) if isinstance(config, dict) else None
    )


class VLLMConfig(BaseConfig):
    """Options passed through to vLLM's engine/server (`--vllm.<option>`). Unknown keys are
    forwarded verbatim as `--<option>` to vLLM, so every vLLM flag is available."""

    model_config = ConfigDict(extra="allow")

    model: str = "Qwen/Qwen3-0.6B"
    """Model id or local directory served by vLLM."""

    dtype: str = "auto"
    """Model dtype."""

    max_model_len: int | None = None
    """Context length (None: the model's)."""

    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Fraction of accelerator memory for vLLM (GPU only: on CPU `cpu_kv_cache_bytes` sizes the
    KV cache and this is not passed)."""

    cpu_kv_cache_bytes: ByteSize = Field(ByteSize(256 * 1024**2), gt=0)
    """KV-cache size on CPU hosts: an int or a size such as "256MiB", "1GiB" (vLLM's
    `--kv-cache-memory-bytes`). vLLM-CPU would otherwise take a fraction of the NUMA node's memory
    minus what the worker already holds, which is ~0 on a busy machine. The default fits the tiny
    models; a model with a longer `max_model_len` or more layers needs more (docs/inference.md).
    Ignored on GPU."""

    enforce_eager: bool = False
    """Disable CUDA graphs / compilation."""

    tensor_parallel_size: int = Field(1, ge=1)
    """Tensor parallel degree."""

    enable_prefix_caching: bool = True
    """Prefix caching (reset on every weight update so versions never mix)."""

    seed: int = 0
    """Sampling seed of the engine."""

    enable_scale_out: bool = True
    """Serve vLLM's token-in/token-out `/inference/v1/generate`, which verifiers 0.4's train
    client calls (`vf:` environments, docs/environments.md). The public port passes only that
    path of vLLM's scale-out API."""

    tool_call_parser: str | None = "auto"
    """vLLM's tool-call parser (`--tool-call-parser`, started with `--enable-auto-tool-choice`),
    so tool calls of environments that offer tools come back parsed. "auto": the parser of the
    model's family (`model_type` in its config.json, `TOOL_CALL_PARSERS`), none for a family not
    listed there or a model not on disk; "none": no parser (tool calls stay text)."""


class ServerConfig(BaseConfig):
    """The client-facing public port (the gate: OpenAI API, /health, /metrics)."""

    host: str = "0.0.0.0"
    """Bind address of the public port (the engine's admin port binds admin.host)."""

    port: int = Field(8000, ge=0, le=65535)
    """Client-facing port: the OpenAI API (/v1/...), /health and /metrics only."""

    advertise_host: str | None = None
    """Host name or address the replica registers its URLs under (what rollout workers on other
    hosts connect to). None: `host` when it is a specific address, else this machine's name when
    it resolves to a non-loopback address, else the address of its outward interface. Set it
    behind NAT, in containers (the service's DNS name) or on multi-homed nodes."""

    cors_allowed_origins: list[str] = []
    """Origins browsers may call the public port from (`*`: any); none by default (CORS off)."""


class HealthConfig(BaseConfig):
    """How the replica watches its engine while serving (docs/inference.md, "Engine death")."""

    interval_s: float = Field(2.0, gt=0)
    """Seconds between two probes of the engine's /health (and checks of the child processes)."""

    timeout_s: float = Field(5.0, gt=0)
    """Deadline of one /health probe."""

    failures: int = Field(3, ge=1)
    """Probes failing in a row that count as a dead engine (the replica then exits 1)."""


class AdminConfig(BaseConfig):
    """The engine's admin port (`backend_port`: /update_weights, /pause, ...) and the checks every
    weight update passes before it touches the engine (docs/security.md)."""

    host: str = "127.0.0.1"
    """Bind address of the engine port. Loopback by default: the weight agent runs on the same
    host. Any other address (multi-node) needs a token (`token_file` or env RLBUS_ADMIN_TOKEN)."""

    token_file: str | None = None
    """File (mode 0600) holding the bearer token every admin call must send; else env
    RLBUS_ADMIN_TOKEN. With a token, admin paths answer 401 without it, on any bind address."""

    weights_root: str | None = None
    """Directory every weights `path` / `lora_path` must lie under (default: `<run_dir>/broadcasts`;
    without a run_dir and this, any directory is accepted)."""

    check_finite: bool = True
    """Refuse a weight update holding NaN or infinite values (reads every tensor once more)."""


DEFAULT_BACKEND_PORT = 8100


class AttachConfig(BaseConfig):
    """An already running `inference` server to use instead of starting vLLM (docs/inference.md,
    "Attach to a running inference server"). The defaults are those of a plain `inference` on
    this host: public port 8000, admin port 8100 on loopback."""

    url: str = "http://127.0.0.1:8000"
    """The server's public URL (OpenAI API under /v1), as the rollout clients reach it."""

    admin_url: str | None = None
    """The server's engine (admin) port: /update_weights, /liveness (default: port 8100 on the
    host of `url`). Its token, if it has one, comes from admin.token_file or env
    RLBUS_ADMIN_TOKEN, as for an owned replica."""

    timeout_s: float = Field(5.0, gt=0)
    """How long the attach checks wait for the server to answer before giving up (short: an
    unreachable URL is reported within 10 s of the start, process start-up included)."""

    @field_validator("url", "admin_url")
    @classmethod
    def _http_urls(cls, value: str | None) -> str | None:
        return None if value is None else check_http_url(value)

    @model_validator(mode="after")
    def _default_admin_url(self) -> "AttachConfig":
        if self.admin_url is None:
            parts = urlsplit(self.url)
            self.admin_url = f"{parts.scheme}://{parts.hostname}:{DEFAULT_BACKEND_PORT}"
        return self

    def shifted(self, offset: int) -> "AttachConfig":
        """The server `offset` ports up on both URLs: replica i of a run attaches to port + i
        and admin port + i, the rule by which `rl` numbers the replicas it starts itself."""
        assert self.admin_url is not None, "set by _default_admin_url"
        return self.model_copy(
            update={
                "url": shift_port(self.url, offset),
                "admin_url": shift_port(self.admin_url, offset),
            }
        )


def shift_port(url: str, offset: int) -> str:
    """`url` with its (explicit) port raised by `offset`."""
    parts = urlsplit(url)
    if parts.port is None:
        raise ValueError(f"{url} names no port: give one (replica i attaches to port + i)")
    if parts.port + offset > 65535:
        raise ValueError(f"{url}: port + {offset} is past 65535 (replica i attaches to port + i)")
    return parts._replace(netloc=f"{parts.hostname}:{parts.port + offset}").geturl()


def attach_url_flags(args: list[str], flag: str) -> list[str]:
    """`<flag> URL` -> `<flag>.url URL` (flag: `--attach` or `--inference.attach`): given as a
    value, the URL would replace the table that `<flag>.admin-url` next to it fills."""
    out = list(args)
    for i, token in enumerate(out[:-1]):
        if token == flag and not out[i + 1].startswith(("--", "@")):
            out[i] = flag + ".url"
    return out


class InferenceConfig(ServiceConfig):
    """The inference service: one vLLM engine, its public gate, its weight agent and replica lease.
    Without bus.url the weight agent and the lease are off."""

    # Bus, logging, tracing: the ServiceConfig block (`rl` pushes its own values down).

    server: ServerConfig = ServerConfig()
    """The public port (the gate in front of the engine)."""

    backend_port: int = Field(DEFAULT_BACKEND_PORT, ge=0, le=65535)
    """Engine port; admin endpoints (/update_weights, ...) live here only."""

    vllm: VLLMConfig = VLLMConfig()
    """vLLM pass-through options."""

    fast_start: bool = True
    """On CPU, start vLLM faster: fork its EngineCore and worker from the API server instead of
    spawning fresh interpreters that import vLLM and torch again, and run the sampler's logprob
    rank count eagerly instead of compiling it at the first request (docs/inference.md,
    "Start-up on CPU"). No effect on GPU. `--no-fast-start` restores vLLM's own behaviour."""

    replica_id: str | None = None
    """Replica id in the registry (default: host:port)."""

    lease_ttl_s: int = Field(5, ge=1)
    """Replica lease TTL; the heartbeat renews it at a third of this."""

    run_dir: str | None = None
    """Run directory, given whole (`rl` sets it to the run's; holds broadcasts and logs). A replica
    only joins a run: it never names one, so it has no output_dir/run.name of its own."""

    weight_broadcast: WeightBroadcastConfig = WeightBroadcastConfig()
    """How new weights arrive."""

    health: HealthConfig = HealthConfig()
    """Engine health probes while serving."""

    slurm: SlurmConfig | None = None
    """Submit this replica as a SLURM batch job (one replica per node) instead of serving here
    (bare `--slurm` or a `[slurm]` table; needs run_dir; docs/slurm.md)."""

    admin: AdminConfig = AdminConfig()
    """Engine admin port: bind address, token, weight-update checks."""

    weights_apply_timeout_s: float = Field(600.0, gt=0)
    """Deadline of one weights load (the engine's /update_weights or /load_lora_adapter call);
    a load that takes longer is reported as failed (`weights.failed`)."""

    attach: AttachConfig | None = None
    """Attach to a running server instead of starting one (`rl` runs this process in the
    replica's place): bare `--attach` (the defaults of AttachConfig), `--attach URL` (its public
    URL; `attach_url_flags`), an `[attach]` table, or `attach = true` / `attach = "URL"`. The
    process registers the server, resets its weights to the run's start and applies the run's
    updates; the server outlives the run."""

    @field_validator("attach", mode="before")
    @classmethod
    def _attach_spellings(cls, value: Any) -> Any:
        """Bare flag / `true` -> the defaults, a string -> its public URL, `false` -> off."""
        if value is True or value == "true":
            return {}
        if value is False or value in ("false", "None"):
            return None
        if isinstance(value, str):
            return {"url": value}
        return value

    def vllm_cli_args(self, *, on_cpu: bool = False) -> list[str]:
        """The vLLM server flags for the `vllm.*` options (known and pass-through). On CPU the KV
        cache is sized in bytes (`cpu_kv_cache_bytes`), on GPU by `gpu_memory_utilization`."""
        args: list[str] = []
        values: dict[str, Any] = self.vllm.model_dump(
            exclude={"cpu_kv_cache_bytes", "tool_call_parser"}
        )
        parser = tool_call_parser_of(self.vllm.model, self.vllm.tool_call_parser)
        if parser is not None:
            values.update(enable_auto_tool_choice=True, tool_call_parser=parser)
        if on_cpu:
            del values["gpu_memory_utilization"]
            values["kv_cache_memory_bytes"] = int(self.vllm.cpu_kv_cache_bytes)
        values.update(self.vllm.model_extra or {})
        for key, value in values.items():
            flag = "--" + key.replace("_", "-")
            if value is None:
                continue
            if isinstance(value, bool):
                args.append(flag if value else "--no-" + key.replace("_", "-"))
            else:
                args.extend([flag, str(value)])
        return args

    # --- cross-field rules (checked at load time, `--dry-run` included) ---

    @model_validator(mode="after")
    def _ports_differ(self) -> "InferenceConfig":
        """The gate and the engine cannot share a port (0 picks a free one for each). Before,
        only the replica's start (`claim_ports`) noticed, after the config was written."""
        if self.server.port == self.backend_port != 0:
            raise field_errors(
                self,
                (
                    "backend_port",
                    f"must differ from server.port ({self.server.port}): the public gate "
                    "listens there; give the engine another port, or 0 for a free one",
                ),
            )
        return self

    @model_validator(mode="after")
    def _attach_alone(self) -> "InferenceConfig":
        """An attached server is started elsewhere: it cannot also be submitted to SLURM."""
        if self.attach is not None and self.slurm is not None:
            why = "cannot be combined with slurm: drop one (attach uses a running server)"
            raise field_errors(self, ("attach", why))
        return self
