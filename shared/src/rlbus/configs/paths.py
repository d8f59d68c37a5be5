"""Paths a run needs that must exist when its command starts: a local model directory and SFT
data. Every entry point calls `exit_if_paths_missing` right after `parse_cli` (parsing alone,
e.g. `--print-config`, needs no files). Without it a typo in `--model.name` surfaced only once a
service loaded the model, as a traceback of transformers or vLLM in its log.

The model is checked where it is loaded (trainer, SFT, inference, and `rl`, which starts them),
not in the orchestrator, which only sends its name. A model name is a local path when it is
written as one (absolute, `./`, `../`, `~`) or has more than one `/` (a hub id is `org/name`).
Relative paths are resolved from the working directory, as the services resolve them. A dry run
(`strict=False`) only plans: a relative path such as `outputs/models/tiny-qwen3` may be built
before its scripts run, so there only paths written explicitly as paths are checked; the launch
checks them all and, offline (HF_HUB_OFFLINE=1), that a hub id is in the local hub cache
(docs/configuration.md, "Bad input").
"""

import os
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel

from rlbus.configs.base import count_header, exit_with_config_error
from rlbus.configs.common import ModelConfig
from rlbus.configs.inference import VLLMConfig
from rlbus.configs.orchestrator import OrchestratorConfig
from rlbus.configs.sft import BUILT_IN_DATA, SFTDataConfig

EXPLICIT_PREFIXES = ("/", "./", "../", "~")
"""The SFT data generated on the fly (`sft.data.path` default); every other value is a path."""


def is_local(name: str, *, strict: bool) -> bool:
    """Whether `name` is meant as a local path (and so must exist) rather than a hub id."""
    return name.startswith(EXPLICIT_PREFIXES) or (strict and name.count("/") > 1)


OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def hub_offline() -> bool:
    """Whether the hub may not be reached (compose sets HF_HUB_OFFLINE=1; no hub is reachable in
    CI): then a hub id must already be in the local cache."""
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in OFFLINE_ENV)


def hub_cache_problem(flag: str, name: str) -> str | None:
    """Offline, a hub id that is not in the local cache fails only once vLLM or transformers try
    to load it (10-30 s in): say so now. Looks at the cache only, never at the network."""
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(name, "config.json")
    except Exception:  # not a valid repo id either (huggingface_hub's HFValidationError)
        cached = None
    if isinstance(cached, str):
        return None
    return (
        f"{flag}: not a local directory and not in the hub cache, and the hub is off "
        f"(HF_HUB_OFFLINE) (got {name!r}); give a local model directory, or unset "
        "HF_HUB_OFFLINE where the hub is reachable"
    )


def model_problem(flag: str, name: str, *, strict: bool) -> str | None:
    """Why the model `name` given by `flag` cannot be loaded: a local path that is not a saved
    model directory, or (when launching offline) a hub id missing from the cache."""
    if not is_local(name, strict=strict):
        return hub_cache_problem(flag, name) if strict and hub_offline() else None
    path = Path(name).expanduser()
    hint = "a local model is a directory with config.json (save_pretrained writes one)"
    if not path.exists():
        return f"{flag}: no such directory (got {name!r}, from {Path.cwd()}); {hint}"
    if not path.is_dir():
        return f"{flag}: is a file, not a model directory (got {name!r}); {hint}"
    if not (path / "config.json").is_file():
        return f"{flag}: has no config.json (got {name!r}); {hint}"
    return None


def data_problem(flag: str, name: str | None, *, strict: bool) -> str | None:
    """Why SFT data `name` cannot be read, if it is a path that does not exist."""
    if name is None or name == BUILT_IN_DATA:
        return None
    if not strict and not name.startswith(EXPLICIT_PREFIXES):
        return None
    if Path(name).expanduser().exists():
        return None
    return (
        f"{flag}: no such file or directory (got {name!r}, from {Path.cwd()}); give a "
        f"JSONL/Parquet file, a saved `datasets` directory, or the built-in {BUILT_IN_DATA!r}"
    )


def _walk(
    config: BaseModel, prefix: str, parent: BaseModel | None = None
) -> Iterator[tuple[str, BaseModel, BaseModel | None]]:
    """(flag prefix, sub-config, its parent) for `config` and every sub-config below it."""
    yield prefix, config, parent
    for name in type(config).model_fields:
        value = getattr(config, name)
        if isinstance(value, BaseModel):
            yield from _walk(value, f"{prefix}{name.replace('_', '-')}.", config)


def path_problems(config: BaseModel, *, strict: bool) -> list[str]:
    """One line per missing path of `config`, each named by the first flag that holds it
    (`rl` pushes `--model.name` into every service: it is reported once, as `--model.name`)."""
    problems: dict[str, str] = {}
    for prefix, sub, parent in _walk(config, "--"):
        found: list[tuple[str, str | None]] = []
        # The orchestrator only sends the model's name to inference, which may live on another
        # host (compose: another container): its files need not exist where it runs.
        if isinstance(sub, ModelConfig) and not isinstance(parent, OrchestratorConfig):
            found.append((sub.name, model_problem(prefix + "name", sub.name, strict=strict)))
        elif isinstance(sub, VLLMConfig):
            found.append((sub.model, model_problem(prefix + "model", sub.model, strict=strict)))
        elif isinstance(sub, SFTDataConfig):
            for field in ("path", "val_path"):
                value = getattr(sub, field)
                flag = prefix + field.replace("_", "-")
                found.append((str(value), data_problem(flag, value, strict=strict)))
            for i, source in enumerate(sub.sources):
                flag = f"{prefix}sources[{i}].path"
                found.append((str(source.path), data_problem(flag, source.path, strict=strict)))
        for value, problem in found:
            if problem is not None:
                problems.setdefault(value, problem)
    return list(problems.values())


def exit_if_paths_missing(config: BaseModel, *, strict: bool = True) -> None:
    """Exit 2 with one line per missing path (see `path_problems`)."""
    problems = path_problems(config, strict=strict)
    if problems:
        header = count_header(len(problems), type(config))
        exit_with_config_error("\n".join([header, *problems]))
