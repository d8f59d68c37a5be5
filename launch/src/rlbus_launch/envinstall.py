"""`rl env install NAME|PATH` and `rl env list`: environments by id, installed the way prime-rl
users install theirs (`prime env install owner/name`, `uv pip install -e <path>`).

    rl env install environments/reverse_text_v1      a local package (editable)
    rl env install my-env                            a package on PyPI (`my-env==0.2` pins it)
    rl env install primeintellect/wordle[@0.1.4]     a package on the Prime hub's index
    rl env list                                      every id a config can name, and its kind

Install reads the package's declared dependencies (its pyproject.toml; for a name, the metadata
of the package alone, fetched with `uv pip install --no-deps --target <tmp>`) and picks where the
environment lives:

- it needs verifiers >= 0.4 (a `verifiers.v1` environment): a venv of its own,
  `<env dir>/<id>/` (`--venv-dir`, `$RLBUS_ENV_DIR`, default ~/.cache/rlbus/envs), made with
  `uv venv`, the package installed there, and the environment recorded in the index next to the
  venvs (rlbus.envindex), which the config load and the orchestrator read;
- it needs classic verifiers (a requirement on verifiers that admits releases before 0.4): a venv
  of its own too, recorded with kind `classic`; rlbus's classic env server
  (`rlbus_orchestrator.envs.classic_remote`) plays it turn by turn from there;
- anything else (an rlbus entry point package, a plain module): rlbus's own venv,
  `uv pip install [-e]`, found by entry point or module as before; no record.

Installing again updates: the venv is reused, a local package is rebuilt when it changed (uv's
cache keys), a named package is upgraded. Each step prints one line; the last names the id to set
in `[[orchestrator.env]]`. A failure is one line (exit 1): a path without pyproject.toml, a
package uv cannot find, or uv's last stderr line.
"""

import argparse
import fcntl
import importlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rlbus import envindex
from rlbus.configs.orchestrator import ENV_ENTRY_POINT_GROUP

PROG = "rl env"
EXIT_OK = 0
EXIT_FAILED = 1

PRIME_HUB_INDEX = "https://hub.primeintellect.ai/{owner}/simple/"
"""The package index of an `owner/name` environment on the Prime hub (`prime env install`
installs `name` from it)."""

HUB_SPEC = re.compile(r"^([A-Za-z0-9][\w.-]*)/([A-Za-z0-9][\w.-]*)(?:@([\w.+!-]+))?$")
REQUIREMENT_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
SPECIFIER = re.compile(r"(~=|===|==|!=|<=|>=|<|>)\s*([0-9][0-9A-Za-z.*+!-]*)")
LOWER_BOUNDS = ("~=", "===", "==", ">=", ">")
VERIFIERS_V1 = (0, 4)
"""verifiers releases from 0.4 on carry `verifiers.v1` (and pin `openai>=2.54`)."""

CHECK_MODULES = (
    "import importlib.util as u, sys; print(*[m for m in sys.argv[1:] if u.find_spec(m)])"
)
"""Run by the env venv's python: which of the candidate modules it can import."""


class InstallError(Exception):
    """An install that cannot go on; the message is the one line the user sees."""


@dataclass(frozen=True)
class Source:
    """What to install: a local package directory, or a requirement (PyPI or a hub index)."""

    text: str
    """As the user typed it; `rl env install <text>` installs it again."""
    path: Path | None = None
    requirement: str = ""
    index_url: str | None = None

    def uv_args(self) -> list[str]:
        """The `uv pip install` arguments naming the package."""
        if self.path is not None:
            return ["-e", str(self.path)]
        extra = ["--extra-index-url", self.index_url] if self.index_url else []
        return [self.requirement, *extra]


@dataclass(frozen=True)
class Package:
    """A distribution's name, version and declared dependencies."""

    name: str
    version: str
    requires: list[str]

    @property
    def env_id(self) -> str:
        return normalized(self.name)


def normalized(name: str) -> str:
    """A distribution name as an environment id (`Reverse_Text.v1` -> `reverse-text-v1`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_source(text: str) -> Source:
    """A directory (with pyproject.toml), `owner/name[@version]` (the Prime hub), or a
    requirement (PyPI)."""
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "pyproject.toml").is_file():
            raise InstallError(
                f"{text}: no pyproject.toml in it (an environment package is a directory with one)"
            )
        return Source(text, path=path.resolve())
    hub = HUB_SPEC.match(text)
    if hub and not text.startswith((".", "~")):
        owner, name, version = hub.groups()
        requirement = f"{name}=={version}" if version else name
        return Source(text, requirement=requirement, index_url=PRIME_HUB_INDEX.format(owner=owner))
    if "/" in text or text.startswith((".", "~")):
        raise InstallError(f"{text}: no such directory")
    if not REQUIREMENT_NAME.match(text):
        raise InstallError(f"{text!r} is neither a directory nor a package name")
    return Source(text, requirement=text)


def requirement_name(requirement: str) -> str:
    match = REQUIREMENT_NAME.match(requirement)
    assert match is not None
    return normalized(match.group(1))


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version (`0.4.0rc1` -> (0, 4, 0)); `0.4.*` -> (0, 4)."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def verifiers_requirement(requires: list[str]) -> str | None:
    """The requirement on verifiers among `requires` (those of extras left out), if any."""
    for requirement in requires:
        body, _, marker = requirement.partition(";")
        if "extra" not in marker and requirement_name(body) == "verifiers":
            return requirement.strip()
    return None


def needs_verifiers_v1(requirement: str) -> bool:
    """Whether the requirement admits only verifiers >= 0.4 (a lower bound of 0.4 or more)."""
    body = requirement.partition(";")[0]
    if "@" in body:  # a direct reference (git, URL) says no version
        return False
    return any(
        op in LOWER_BOUNDS and release(version) >= VERIFIERS_V1
        for op, version in SPECIFIER.findall(body)
    )


def find_uv() -> str:
    """The uv binary: `$UV` (set by `uv run`), else `uv` on PATH."""
    uv = os.environ.get("UV") or shutil.which("uv")
    if not uv:
        raise InstallError("uv not found: run through `./uvw run rl env ...` or put uv on PATH")
    return uv


def run_uv(uv: str, args: list[str], step: str) -> str:
    """Run `uv args`; its stdout, or `InstallError` with uv's last stderr line."""
    result = subprocess.run([uv, *args], capture_output=True, text=True)
    if result.returncode != 0:
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        raise InstallError(
            f"{step} failed: {lines[-1] if lines else f'uv exit {result.returncode}'}"
        )
    return result.stdout


def read_pyproject(path: Path) -> Package | None:
    """Name, version and dependencies from `path/pyproject.toml`; None when they are dynamic."""
    try:
        project = tomllib.loads((path / "pyproject.toml").read_text()).get("project", {})
    except tomllib.TOMLDecodeError as error:
        raise InstallError(f"{path / 'pyproject.toml'}: {error}") from None
    dynamic = set(project.get("dynamic", []))
    if "name" not in project or {"dependencies", "version"} & dynamic:
        return None
    return Package(project["name"], project.get("version", ""), project.get("dependencies", []))


def probe_package(uv: str, source: Source) -> Package:
    """The package's own metadata, from installing it alone (`--no-deps`) into a temp folder."""
    target = source.path if source.path is not None else source.requirement
    extra = ["--extra-index-url", source.index_url] if source.index_url else []
    with tempfile.TemporaryDirectory(prefix="rlbus-env-probe-") as tmp:
        step = f"uv pip install --no-deps {target}"
        run_uv(
            uv, ["pip", "install", "-q", "--no-deps", "--target", tmp, str(target), *extra], step
        )
        found = sorted(Path(tmp).glob("*.dist-info"))
        if not found:
            raise InstallError(f"{step} installed no package")
        dist = importlib.metadata.PathDistribution(found[0])
        return Package(dist.metadata["Name"], dist.version, dist.requires or [])


def read_package(uv: str, source: Source) -> Package:
    if source.path is not None:
        package = read_pyproject(source.path)
        if package is not None:
            return package
    return probe_package(uv, source)


@contextmanager
def index_lock(directory: Path) -> Iterator[None]:
    """One `rl env install` at a time per environment directory (venvs and index)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def say(line: str) -> None:
    print(f"rl env install: {line}", flush=True)


def taskset_module(python: Path, package: Package) -> str:
    """The module the env venv imports for the package (its taskset id, `_` as `-`)."""
    candidates = [package.name.replace("-", "_").lower(), package.env_id.replace("-", "_")]
    result = subprocess.run(
        [str(python), "-c", CHECK_MODULES, *dict.fromkeys(candidates)],
        capture_output=True,
        text=True,
    )
    found = result.stdout.split()
    if result.returncode != 0 or not found:
        raise InstallError(
            f"{package.name} installed, but its venv imports no module {' or '.join(candidates)} "
            "(a verifiers taskset package installs a module named like the package)"
        )
    return found[0]


def install_own_venv(
    uv: str,
    source: Source,
    package: Package,
    directory: Path,
    python_version: str,
    kind: str = envindex.VF_KIND,
) -> envindex.InstalledEnv:
    """Make (or reuse) `<directory>/<id>/`, install the package there, record it."""
    venv = directory / package.env_id
    python = venv / "bin" / "python"
    if not python.exists():
        say(f"creating the venv {venv} (python {python_version})")
        run_uv(uv, ["venv", "-q", "--clear", "-p", python_version, str(venv)], "uv venv")
    else:
        say(f"reusing the venv {venv}")
    say(f"installing {source.text} into it")
    upgrade = [] if source.path else ["--upgrade-package", package.name]
    run_uv(
        uv,
        ["pip", "install", "-q", "--python", str(python), *source.uv_args(), *upgrade],
        f"uv pip install {source.text}",
    )
    module = taskset_module(python, package)
    entry = envindex.InstalledEnv(
        id=package.env_id,
        kind=kind,
        python=str(python),
        taskset_id=module.replace("_", "-"),
        source=str(source.path or source.text),
        editable=source.path is not None,
        package=package.name,
        version=package.version,
    )
    say(f"recorded {entry.id} (taskset {entry.taskset_id}) in {envindex.record(entry, directory)}")
    return entry


def ids_in_this_venv(package: Package) -> list[str]:
    """The ids an installed package gives rlbus's venv: its `rlbus.environments` entry points,
    else its module's id (`my_env` -> `my-env`)."""
    importlib.invalidate_caches()
    dist = importlib.metadata.distribution(package.name)
    names = [ep.name for ep in dist.entry_points if ep.group == ENV_ENTRY_POINT_GROUP]
    return names or [package.env_id]


def install_here(uv: str, source: Source, package: Package, directory: Path) -> list[str]:
    """`uv pip install [-e]` into rlbus's venv; the ids it gives."""
    say(f"installing {source.text} into rlbus's venv ({sys.prefix})")
    upgrade = [] if source.path else ["--upgrade-package", package.name]
    run_uv(
        uv,
        ["pip", "install", "-q", "--python", sys.executable, *source.uv_args(), *upgrade],
        f"uv pip install {source.text}",
    )
    if envindex.forget(package.env_id, directory):
        say(f"dropped the earlier own-venv record of {package.env_id} from the index")
    ids = ids_in_this_venv(package)
    for env_id in ids:
        module = env_id.replace("-", "_")
        if env_id == package.env_id and importlib.util.find_spec(module) is None:
            say(f"warning: no entry point and no module {module!r}: the id may not resolve")
    return ids


def install(args: argparse.Namespace) -> int:
    """`rl env install`: one line per step, the id to use last."""
    uv = find_uv()
    source = parse_source(args.source)
    directory = envindex.env_dir(args.venv_dir)
    package = read_package(uv, source)
    verifiers = verifiers_requirement(package.requires)
    v1 = verifiers is not None and needs_verifiers_v1(verifiers)
    own = args.own_venv or verifiers is not None
    kind = envindex.VF_KIND if v1 or args.own_venv else envindex.CLASSIC_KIND
    why = f"requires {verifiers}" if verifiers else "does not require verifiers"
    if not own:
        where = "rlbus's venv"
    elif kind == envindex.VF_KIND:
        where = "its own venv (verifiers 0.4: served by verifiers' env server)"
    else:
        where = "its own venv (classic verifiers: served by rlbus's classic env server)"
    say(f"{package.name} {package.version} {why}: installing into {where}")
    with index_lock(directory):
        if own:
            ids = [install_own_venv(uv, source, package, directory, args.python, kind).id]
        else:
            ids = install_here(uv, source, package, directory)
    for env_id in ids:
        print(f'{env_id} is installed: set `id = "{env_id}"` in [[orchestrator.env]]')
    if own and directory != envindex.env_dir():
        print(f"(run rl with {envindex.ENV_DIR_VAR}={directory} so that it finds the index)")
    return EXIT_OK


def listed_envs(directory: Path | None = None) -> list[tuple[str, str]]:
    """(id, kind) of every environment a config can name, in lookup order's precedence: entry
    points (built-ins included), verifiers modules in rlbus's venv, then the index."""
    rows: dict[str, str] = {}
    for ep in importlib.metadata.entry_points(group=ENV_ENTRY_POINT_GROUP):
        dist = ep.dist
        if dist is not None and normalized(dist.name) == "rlbus-orchestrator":
            rows.setdefault(ep.name, "built-in")
        else:
            named = f" {dist.name} {dist.version}" if dist is not None else ""
            rows.setdefault(ep.name, f"package{named} (rlbus's venv)")
    for dist in importlib.metadata.distributions():
        env_id = normalized(dist.name)
        if verifiers_requirement(dist.requires or []) and importlib.util.find_spec(
            env_id.replace("-", "_")
        ):
            rows.setdefault(env_id, f"verifiers module {dist.name} {dist.version} (rlbus's venv)")
    for env_id, entry in envindex.read_index(directory).items():
        gone = "" if Path(entry.python).exists() else "; the venv is gone: install it again"
        label = "classic verifiers" if entry.kind == envindex.CLASSIC_KIND else "verifiers 0.4"
        kind = f"{label}, own venv {entry.python} (from {entry.source}{gone})"
        rows.setdefault(env_id, kind)
    return sorted(rows.items())


def list_envs(args: argparse.Namespace) -> int:
    """`rl env list`: one line per id."""
    rows = listed_envs(args.venv_dir)
    width = max(len(env_id) for env_id, _ in rows)
    for env_id, kind in rows:
        print(f"{env_id:<{width}}  {kind}")
    return EXIT_OK


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Install environments by id, the way prime-rl users do (docs/environments.md).",
    )
    actions = parser.add_subparsers(dest="action", required=True)
    where = "the environment directory: venvs and index.json (default: $RLBUS_ENV_DIR, else "
    where += "~/.cache/rlbus/envs)"
    install_parser = actions.add_parser(
        "install",
        help="install an environment package: one that needs verifiers >= 0.4 into a venv of its "
        "own (recorded in the index), any other into rlbus's venv",
    )
    install_parser.add_argument(
        "source",
        help="a package directory (with pyproject.toml), a PyPI requirement (my-env, my-env==0.2), "
        "or a Prime hub id owner/name[@version]",
    )
    install_parser.add_argument("--venv-dir", type=Path, help=where)
    install_parser.add_argument(
        "--python",
        default=f"{sys.version_info.major}.{sys.version_info.minor}",
        help="python version of a new venv (default: rlbus's, %(default)s)",
    )
    install_parser.add_argument(
        "--own-venv",
        action="store_true",
        help="give it a venv of its own even if its dependencies do not say verifiers >= 0.4 "
        "(e.g. verifiers from git)",
    )
    list_parser = actions.add_parser("list", help="the ids a config can name, and their kinds")
    list_parser.add_argument("--venv-dir", type=Path, help=where)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return install(args) if args.action == "install" else list_envs(args)
    except (InstallError, ValueError) as error:
        print(f"rl env {args.action}: error: {error}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
