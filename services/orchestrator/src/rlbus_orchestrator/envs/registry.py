"""Find an environment by id: built-ins, then entry points, then verifiers-style modules.

Lookup order for `load_environment("my-env", args)`:

1. built-ins (`BUILTINS`, e.g. `reverse-text`);
2. an installed package that registers `my-env` in the entry point group `rlbus.environments`;
   the entry point is a callable `(**args) -> Environment`;
3. an importable module `my_env` exposing `load_environment(**args)` (the verifiers convention
   for environment packages), wrapped by `VerifiersAdapter`.

An id `vf:<taskset-id>` is a verifiers 0.4 (`verifiers.v1`) environment served by its own
process from its own venv (`VfServerEnv`, envs/vf_server.py).

An id that resolves nowhere raises `EnvironmentNotFoundError` before anything starts; its message
holds the `uv pip install` command that would install the package. The config load runs the
same lookup from package metadata alone (`rlbus.configs.orchestrator.unknown_env_error`), so
`rl --dry-run` rejects an unknown id too; built-ins are also registered as entry points of
`rlbus-orchestrator` for that reason.
"""

import importlib
import importlib.util
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from rlbus_orchestrator.envs.base import Environment
from rlbus_orchestrator.envs.reverse_text import ReverseTextEnv

ENTRY_POINT_GROUP = "rlbus.environments"
BUILTINS: dict[str, Callable[..., Environment]] = {"reverse-text": ReverseTextEnv}


class EnvironmentNotFoundError(ValueError):
    """An environment id that is neither built in nor installed."""


def module_name(env_id: str) -> str:
    """The Python module an environment package installs (`my-env` -> `my_env`)."""
    return env_id.replace("-", "_")


def install_hint(env_id: str) -> str:
    """The command that installs the environment package named `env_id` (docs/environments.md:
    environment packages are not workspace members, they install into the venv like prime-rl's)."""
    local = [
        p
        for p in (Path("environments") / env_id, Path("environments") / module_name(env_id))
        if p.is_dir()
    ]
    if local:
        return f"`uv pip install -e {local[0]}`"
    return f"`uv pip install {env_id}` (or, for a local package, `uv pip install -e environments/<name>`)"


def find_entry_point(env_id: str) -> Callable[..., Environment] | None:
    """The factory registered under `env_id` in the `rlbus.environments` group, if any."""
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == env_id:
            return ep.load()
    return None


def load_environment(env_id: str, args: dict[str, Any] | None = None) -> Environment:
    """Build the environment `env_id` with keyword arguments `args` (see module docstring)."""
    args = dict(args or {})
    if env_id.startswith("vf:"):
        from rlbus_orchestrator.envs.vf_server import VfServerEnv

        return VfServerEnv(env_id, **args)
    if env_id in BUILTINS:
        return BUILTINS[env_id](**args)
    factory = find_entry_point(env_id)
    if factory is not None:
        return factory(**args)
    name = module_name(env_id)
    if importlib.util.find_spec(name) is not None:
        module = importlib.import_module(name)
        if hasattr(module, "load_environment"):
            from rlbus_orchestrator.envs.verifiers_adapter import VerifiersAdapter

            return VerifiersAdapter(env_id, module.load_environment(**args))
        raise EnvironmentNotFoundError(
            f"environment {env_id!r}: module {name!r} imports but has no `load_environment`; "
            f"register a factory in the {ENTRY_POINT_GROUP!r} entry point group instead"
        )
    raise EnvironmentNotFoundError(
        f"environment {env_id!r} (set in `env[].id`) is not built in ({', '.join(sorted(BUILTINS))}), "
        f"no installed package registers it in the {ENTRY_POINT_GROUP!r} entry point group, and "
        f"module {name!r} does not import. Install it with {install_hint(env_id)}, then check with "
        f"`uv run python -c \"import importlib.util; print(importlib.util.find_spec('{name}'))\"`."
    )
