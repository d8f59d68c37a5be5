"""Find an environment by id: built-ins, entry points, verifiers-style modules, then the index.

Lookup order for `load_environment("my-env", args)`:

1. built-ins (`BUILTINS`, e.g. `reverse-text`);
2. an installed package that registers `my-env` in the entry point group `rlbus.environments`;
   the entry point is a callable `(**args) -> Environment`;
3. an importable module `my_env` exposing `load_environment(**args)` (the verifiers convention
   for environment packages): used as it is when it returns an rlbus `Environment`, else
   adapted (`verifiers_adapter.adapt`: classic multi-turn environments turn by turn);
4. an environment that `rl env install` put in a venv of its own (the index, rlbus.envindex):
   a verifiers 0.4 environment, served like `vf:<taskset-id>` (`VfServerEnv`) with the venv's
   python from the index; `args.python` or `args.address`, when given, win.

An id `vf:<taskset-id>` is a verifiers 0.4 (`verifiers.v1`) environment served by its own
process from its own venv (`VfServerEnv`, envs/vf_server.py), with `args.python` naming it.

An id that resolves nowhere raises `EnvironmentNotFoundError` before anything starts; its message
holds the `rl env install` command that would install the package. The config load runs the
same lookup from package metadata and the index alone
(`rlbus.configs.orchestrator.unknown_env_error`), so `rl --dry-run` rejects an unknown id too;
built-ins are also registered as entry points of `rlbus-orchestrator` for that reason.
"""

import importlib
import importlib.util
import inspect
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from rlbus import envindex
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
    """The command that installs the environment package named `env_id`
    (docs/environments.md): its local package under `environments/` when there is one."""
    return envindex.install_command(env_id)


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
    module = importlib.import_module(name) if importlib.util.find_spec(name) else None
    if module is not None and hasattr(module, "load_environment"):
        from rlbus_orchestrator.envs.verifiers_adapter import adapt

        loaded = module.load_environment(**args)
        if isinstance(loaded, Environment):  # an rlbus environment (e.g. a MultiTurnEnv)
            return loaded
        return adapt(env_id, loaded)
    installed = envindex.find_installed(env_id)
    if installed is not None:
        return installed_environment(installed, args)
    if module is not None:
        raise EnvironmentNotFoundError(
            f"environment {env_id!r}: module {name!r} imports but has no `load_environment`; "
            f"register a factory in the {ENTRY_POINT_GROUP!r} entry point group instead"
        )
    raise EnvironmentNotFoundError(
        f"environment {env_id!r} (set in `env[].id`) is not built in ({', '.join(sorted(BUILTINS))}), "
        f"no installed package registers it in the {ENTRY_POINT_GROUP!r} entry point group, "
        f"module {name!r} does not import, and `rl env install` recorded no environment of that id "
        f"in {envindex.index_path()}. Install it with {install_hint(env_id)}, then check with "
        "`rl env list`."
    )


def installed_environment(installed: envindex.InstalledEnv, args: dict[str, Any]) -> Environment:
    """The environment `rl env install` recorded: a verifiers 0.4 env server over the recorded
    taskset, from the recorded venv (`args.python` / `args.address` win)."""
    from rlbus_orchestrator.envs.vf_server import VfServerEnv, merged

    remote = "python" in args or "address" in args
    if not remote and not Path(installed.python).exists():
        raise EnvironmentNotFoundError(
            f"environment {installed.id!r}: its venv is gone ({installed.python} does not exist); "
            f"install it again with `rl env install {installed.source}`"
        )
    if installed.kind == envindex.CLASSIC_KIND:
        from rlbus_orchestrator.envs.classic_remote import classic_environment

        module = installed.taskset_id.replace("-", "_")
        return classic_environment(
            installed.id,
            module,
            args.get("python", installed.python),
            {k: v for k, v in args.items() if k != "python"},
        )
    taskset = {"taskset": {"id": installed.taskset_id}}
    options = {"python": installed.python, **args, "env": merged(taskset, args.get("env", {}))}
    unknown = set(options) - set(inspect.signature(VfServerEnv).parameters)
    if unknown:
        raise EnvironmentNotFoundError(
            f"environment {installed.id!r} is a verifiers 0.4 environment (installed in its own "
            f"venv): args {', '.join(sorted(unknown))} are not among its args (python, env, "
            "address, client_type, renderer_model, max_concurrent, episode_timeout_s); taskset "
            f"fields go under args.env.taskset, e.g. args.env.taskset.{sorted(unknown)[0]} "
            "(docs/environments.md)"
        )
    return VfServerEnv(installed.id, **options)  # env.taskset.id names the taskset
