"""The `@ file` arguments of every command, checked before the loader opens them.

pydantic_config opens each file and merges its top level into the config; a directory, a file
that is not UTF-8 text, an empty YAML file or one whose top level is a list or a string ended in
a Python traceback there (IsADirectoryError, UnicodeDecodeError, `'list' object has no attribute
'items'`). `check_config_files` reads each file once and names the file and the fix instead.
"""

import json
from pathlib import Path
from typing import Any

SUFFIXES = {".toml": "TOML", ".json": "JSON", ".yaml": "YAML", ".yml": "YAML"}
ALLOWED = ".toml, .yaml/.yml or .json"


class ConfigFileProblem(ValueError):
    """A config file that cannot be loaded; the message names the file and the fix."""


def file_arguments(args: list[str]) -> list[str]:
    """The paths given as `@ path` or `@path`; a trailing `@` is itself a problem."""
    paths = []
    for i, token in enumerate(args):
        if token == "@":
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ConfigFileProblem("`@` must be followed by a config file path (`@ rl.toml`)")
            paths.append(args[i + 1])
        elif token.startswith("@") and len(token) > 1:
            paths.append(token[1:])
    return paths


def _kind_of(value: Any) -> str:
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    return "a number" if isinstance(value, (int, float)) else type(value).__name__


def _parse(kind: str, text: str) -> Any:
    if kind == "TOML":
        import tomli

        return tomli.loads(text)
    if kind == "JSON":
        return json.loads(text)
    import yaml

    # The loader reads YAML with FullLoader: parse the same way, so both accept the same files.
    return yaml.load(text, Loader=yaml.FullLoader)


def load_table(name: str) -> dict:
    """The top-level table of config file `name`, or ConfigFileProblem saying what is wrong."""
    path = Path(name)
    kind = SUFFIXES.get(path.suffix.lower())
    if not path.exists():
        raise ConfigFileProblem(f"config file {name}: not found")
    if path.is_dir():
        raise ConfigFileProblem(f"config file {name}: is a directory; `@` takes a {ALLOWED} file")
    if kind is None:
        raise ConfigFileProblem(
            f"config file {name}: unsupported type {path.suffix or '(no suffix)'!r}; "
            f"`@` takes a {ALLOWED} file"
        )
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ConfigFileProblem(f"config file {name}: cannot be read ({error.strerror})") from None
    if b"\0" in data:
        raise ConfigFileProblem(f"config file {name}: is binary, not {kind} text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigFileProblem(
            f"config file {name}: is not UTF-8 text (byte {error.start}); save it as UTF-8 {kind}"
        ) from None
    if not text.strip():
        raise ConfigFileProblem(
            f"config file {name}: is empty; put a {kind} table in it or drop `@ {name}`"
        )
    try:
        table = _parse(kind, text)
    except Exception as error:  # tomli, json and yaml raise unrelated types
        detail = " ".join(str(error).split())
        raise ConfigFileProblem(f"config file {name}: invalid {kind}: {detail}") from None
    if not isinstance(table, dict):
        raise ConfigFileProblem(
            f"config file {name}: the top level is {_kind_of(table)}, not a table; "
            "write `key = value` pairs (a JSON object, a YAML mapping)"
        )
    return table


def check_config_files(args: list[str]) -> None:
    """Raise ConfigFileProblem for the first `@ file` argument that cannot be loaded."""
    for name in file_arguments(args):
        load_table(name)
