"""`rl migrate-config FILE`: convert a prime-rl config into an rlbus one and say what changed.

The key rules themselves live in the core (`rlbus.configs.migrate`), because `RLConfig` and
`SFTConfig` apply them when they load a file; this module is only the command around them. The
environments keep prime-rl's ids (a hub id `owner/name` becomes `name`); for each one that is not
installed here it prints the `rl env install ...` line that installs it (docs/environments.md),
instead of counting the unknown id as a key that needs a human.
"""

import argparse
import sys
from pathlib import Path
from typing import Literal

from rlbus import envindex
from rlbus.configs.migrate import _deep_copy, get_path, migrate, prime_env_sources

PROG = "rl migrate-config"
EXIT_OK = 0
EXIT_NEEDS_HUMAN = 2


def guess_kind(data: dict) -> Literal["rl", "sft"]:
    """`rl` configs have orchestrator/trainer/inference blocks; `sft` ones have `data` or `optim`
    at the top."""
    if any(k in data for k in ("orchestrator", "trainer")):
        return "rl"
    return "sft" if any(k in data for k in ("data", "optim", "val")) else "rl"


def validation_problems(data: dict, kind: Literal["rl", "sft"]) -> list[str]:
    """What keeps the migrated `data` from loading as an rlbus config (empty: it loads)."""
    from pydantic import ValidationError

    from rlbus.configs.base import format_validation_error
    from rlbus.configs.rl import RLConfig
    from rlbus.configs.sft import SFTConfig

    cls = RLConfig if kind == "rl" else SFTConfig
    try:
        cls.model_validate(_deep_copy(data))  # the validators fill in defaults in place
    except ValidationError as error:
        return format_validation_error(cls, error).splitlines()[1:]
    return []


def missing_envs(migrated: dict, data: dict) -> dict[int, tuple[str, str]]:
    """Index in `orchestrator.env` -> (id, what `rl env install` installs it from) of each
    environment that is not installed here; empty where the orchestrator is not installed (its
    ids cannot be checked)."""
    from rlbus.configs import orchestrator as orchestrator_config

    known = orchestrator_config.known_env_ids()
    envs = get_path(migrated, "orchestrator.env")
    if not known or not isinstance(envs, list):
        return {}
    sources = prime_env_sources(data)
    missing = {}
    for i, env in enumerate(envs):
        env_id = env.get("id") if isinstance(env, dict) else None
        if isinstance(env_id, str) and orchestrator_config.unknown_env_error(env_id, known):
            local = envindex.local_package(env_id)
            missing[i] = (env_id, str(local) if local else sources.get(env_id, env_id))
    return missing


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Convert a prime-rl config into an rlbus one (docs/migration.md). Exit 0: "
        "converted; 2: some keys need a human (listed, left out of the output).",
    )
    parser.add_argument("input", type=Path, help="the prime-rl TOML config")
    parser.add_argument(
        "-o", "--output", type=Path, help="write the rlbus TOML here (default: stdout)"
    )
    parser.add_argument("--kind", choices=["rl", "sft"], help="config kind (default: guessed)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Convert, report each key on stderr, write the result; returns the exit code."""
    import tomli_w

    from rlbus.configs.base import _none_as_string
    from rlbus.configs.files import ConfigFileProblem, load_table

    args = parse_args(argv)
    try:
        data = load_table(str(args.input))
    except ConfigFileProblem as problem:
        print(f"migrate-config: {problem}", file=sys.stderr)
        return EXIT_NEEDS_HUMAN
    kind = args.kind or guess_kind(data)
    migrated, changes = migrate(data, kind)
    for change in changes:
        print(f"{change.status:8} {change.line()}", file=sys.stderr)
    missing = missing_envs(migrated, data) if kind == "rl" else {}
    unknown_ids = tuple(f"--orchestrator.env[{i}].id:" for i in missing)
    problems = [p for p in validation_problems(migrated, kind) if not p.startswith(unknown_ids)]
    for invalid in problems:
        print(f"invalid  {invalid}", file=sys.stderr)
    for env_id, source in missing.values():
        print(f"install  rl env install {source}   (environment {env_id!r})", file=sys.stderr)
    text = tomli_w.dumps(_none_as_string(migrated))
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
    human = [c for c in changes if c.status == "human"]
    if human or problems:
        print(
            f"{len(human) + len(problems)} key(s) need a human: set the rlbus keys named above "
            f"(docs/migration.md); the output leaves them out",
            file=sys.stderr,
        )
        return EXIT_NEEDS_HUMAN
    installs = " once the environments above are installed" if missing else ""
    print(
        f"converted {len(changes)} key(s): `{kind} @ OUT.toml` loads it{installs}", file=sys.stderr
    )
    return EXIT_OK
