"""The index of environments that `rl env install` put in venvs of their own.

A verifiers 0.4 (`verifiers.v1`) environment cannot live in rlbus's venv (verifiers 0.4 pins
`openai>=2.54`, rlbus pins another through vLLM), so `rl env install` (rlbus_launch.envinstall)
makes it a venv under the environment directory and records it here; an environment that fits
rlbus's venv is installed there and needs no record (entry points and modules find it).

    <env dir>/                     RLBUS_ENV_DIR, default ~/.cache/rlbus/envs ($XDG_CACHE_HOME)
      index.json                   {"version": 1, "envs": {id: {kind, python, taskset_id, ...}}}
      <env id>/bin/python          one venv per environment

Two readers, one lookup (`find_installed`): the config load, which checks ids from metadata
alone (rlbus.configs.orchestrator.unknown_env_error), and the orchestrator's registry, which
serves an indexed id like `vf:<taskset-id>` with the recorded python. The writer is
`rl env install`; the file is replaced whole (write, fsync, rename), so a reader never sees half.
"""

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

ENV_DIR_VAR = "RLBUS_ENV_DIR"
"""Environment variable naming the environment directory (venvs and index)."""

INDEX_NAME = "index.json"
INDEX_VERSION = 1

VF_KIND = "vf"
CLASSIC_KIND = "classic"
"""A verifiers 0.4 environment served by verifiers' `EnvServer` from its own venv."""


@dataclass(frozen=True)
class InstalledEnv:
    """One environment that `rl env install` put in a venv of its own."""

    id: str
    """The id configs name it by (`[[orchestrator.env]] id`): the package name, normalized."""
    kind: str
    """`vf` (verifiers 0.4, served by verifiers' `EnvServer`) or `classic` (verifiers before
    0.4, served by rlbus's `classic_vf_main.py`)."""
    python: str
    """The interpreter of the environment's venv."""
    taskset_id: str
    """The verifiers taskset id the env server loads (`--env.taskset.id`); for `classic`, the
    module whose `load_environment(**args)` builds the environment (`_` as `-`)."""
    source: str
    """What was installed: a local path (absolute) or a package spec; `rl env install <source>`
    installs it again."""
    editable: bool = False
    """Installed with `-e` (a local path)."""
    package: str = ""
    """The distribution name."""
    version: str = ""
    """The distribution version installed."""


def env_dir(override: str | Path | None = None) -> Path:
    """The environment directory: `override`, else `$RLBUS_ENV_DIR`, else
    `$XDG_CACHE_HOME/rlbus/envs` (`~/.cache/rlbus/envs`)."""
    if override is not None:
        return Path(override).expanduser()
    if os.environ.get(ENV_DIR_VAR):
        return Path(os.environ[ENV_DIR_VAR]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "rlbus" / "envs"


def index_path(directory: str | Path | None = None) -> Path:
    return env_dir(directory) / INDEX_NAME


def read_index(directory: str | Path | None = None) -> dict[str, InstalledEnv]:
    """Every recorded environment by id; empty when nothing was installed. A file that is not an
    index raises `ValueError` naming it and the fix."""
    path = index_path(directory)
    try:
        data = json.loads(path.read_text())
        return {env_id: InstalledEnv(**entry) for env_id, entry in data["envs"].items()}
    except FileNotFoundError:
        return {}
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise ValueError(
            f"the environment index {path} is unreadable ({type(error).__name__}: {error}); "
            "delete it and install the environments again with `rl env install`"
        ) from None


def find_installed(env_id: str, directory: str | Path | None = None) -> InstalledEnv | None:
    """The recorded environment `env_id`, if `rl env install` recorded one."""
    return read_index(directory).get(env_id)


def write_index(envs: dict[str, InstalledEnv], directory: str | Path | None = None) -> Path:
    """Replace the index with `envs` (atomically); returns its path."""
    path = index_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"version": INDEX_VERSION, "envs": {k: asdict(v) for k, v in sorted(envs.items())}}
    tmp = path.with_name(f".{INDEX_NAME}.{os.getpid()}")
    with open(tmp, "w") as file:
        file.write(json.dumps(data, indent=2) + "\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
    return path


def record(entry: InstalledEnv, directory: str | Path | None = None) -> Path:
    """Add or replace `entry` in the index; returns its path."""
    envs = read_index(directory)
    envs[entry.id] = entry
    return write_index(envs, directory)


def forget(env_id: str, directory: str | Path | None = None) -> bool:
    """Drop `env_id` from the index (its venv stays); whether it was there."""
    envs = read_index(directory)
    if envs.pop(env_id, None) is None:
        return False
    write_index(envs, directory)
    return True


def local_package(env_id: str, root: str | Path = ".") -> Path | None:
    """`environments/<id>` (or `<id>` with `_`) under `root` when it is a package directory."""
    for name in (env_id, env_id.replace("-", "_")):
        path = Path(root) / "environments" / name
        if (path / "pyproject.toml").is_file():
            return path
    return None


def install_command(env_id: str | None = None) -> str:
    """The `rl env install` line that installs `env_id`: its local package when this checkout
    has one, otherwise the generic form."""
    path = local_package(env_id) if env_id else None
    return f"`rl env install {path}`" if path else "`rl env install <name or path>`"
