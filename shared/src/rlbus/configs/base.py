"""The base class of every rlbus config, and the command-line loader every entry point uses.

`BaseConfig` is `pydantic_config.BaseConfig` (a pydantic model with `extra="forbid"` plus the
before-validators the CLI loader relies on: "None" strings, dict value coercion, default union
tags) that also refuses `inf` and `nan`.

`parse_cli(Cls)` is `pydantic_config.cli(Cls)` with a thin layer around it (docs/configuration.md
says why each piece exists):
- `--a-b.c-d @ file.toml`: the file is nested under the snake_case path (pydantic_config nests it
  under the raw kebab-case path, which then fails validation);
- validation errors are re-rendered so the flag shown is the one the user types (pydantic puts the
  discriminator tag into error locations: `--trainer.optim.muon.lr` -> `--trainer.optim.lr`) and
  "did you mean" compares whole dotted paths, including fields inside optional sub-configs and
  union variants;
- space-separated list values (`--monitors.wandb.tags a b`) also work inside optional
  sub-configs and union variants, where pydantic_config alone takes one value;
- bad JSON values and every other loader error end in the same box, exit code 2, no traceback;
- `@ file` arguments are checked before the loader opens them (rlbus.configs.files): a
  directory, a binary or empty file, or one whose top level is not a table is one line, not a
  traceback; so is a flag that needs a value followed by another flag;
- `--print-config` prints the resolved config as TOML and exits; `--debug` (or RLBUS_DEBUG=1)
  keeps tracebacks for errors that otherwise end in one line (docs/configuration.md).
"""

import ast
import difflib
import functools
import inspect
import json
import os
import sys
import types
from typing import Any, NoReturn, TypeVar, Union, get_args, get_origin

import pydantic_config
from pydantic import AliasChoices, BaseModel, ConfigDict, ValidationError
from pydantic_config import ConfigFileError, cli

from rlbus.configs.files import ConfigFileProblem, check_config_files
from rlbus.docstrings import attribute_docstrings

T = TypeVar("T", bound=BaseModel)


class BaseConfig(pydantic_config.BaseConfig):
    """pydantic_config's base with finite floats only: `inf` and `nan` pass `gt=0` checks
    (`--trainer.optim.lr inf` was accepted) and mean nothing for a rate, a size or a timeout;
    "no limit" is spelled None where a field allows it."""

    model_config = ConfigDict(allow_inf_nan=False)


PRINT_CONFIG_FLAG = "--print-config"
DEBUG_FLAG = "--debug"
DEBUG_ENV = "RLBUS_DEBUG"
"""`--debug` sets it, so the processes a launcher starts inherit it and keep tracebacks too."""
EXIT_CONFIG_ERROR = 2


def debug_enabled() -> bool:
    """Whether errors keep their traceback (`--debug` or RLBUS_DEBUG=1) instead of one line."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


# --- walking the config tree -------------------------------------------------------------------


def _strip_annotated(annotation: Any) -> Any:
    return get_args(annotation)[0] if hasattr(annotation, "__metadata__") else annotation


def _model_variants(annotation: Any) -> list[type[BaseModel]]:
    """The BaseModel classes a field can hold: itself, the X of `X | None`, or union variants."""
    inner = _strip_annotated(annotation)
    if isinstance(inner, type) and issubclass(inner, BaseModel):
        return [inner]
    if get_origin(inner) in (Union, types.UnionType):
        return [a for a in get_args(inner) if isinstance(a, type) and issubclass(a, BaseModel)]
    return []


def _container_item_model(annotation: Any) -> type[BaseModel] | None:
    """X for `list[X]` / `dict[str, X]` (optionally `| None`) when X is a BaseModel."""
    inner = _strip_annotated(annotation)
    if get_origin(inner) in (Union, types.UnionType):
        non_none = [a for a in get_args(inner) if a is not type(None)]
        if len(non_none) != 1:
            return None
        inner = non_none[0]
    if get_origin(inner) in (list, dict):
        item = get_args(inner)[-1] if get_args(inner) else None
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item
    return None


def _field_names(name: str, finfo: Any) -> list[str]:
    """The field name plus every validation alias it accepts."""
    names = [name]
    alias = finfo.validation_alias
    choices = alias.choices if isinstance(alias, AliasChoices) else [alias] if alias else []
    names += [c for c in choices if isinstance(c, str) and c != name]
    return names


def flag_path(prefix: str, name: str) -> str:
    """The dotted kebab-case flag path of field `name` under `prefix` (`trainer.optim` + `lr`)."""
    flag = name.replace("_", "-")
    return f"{prefix}.{flag}" if prefix else flag


def known_flag_paths(cls: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted kebab-case flag path of `cls`: leaves, optional sub-configs (which are flags
    themselves: `--monitors.wandb`), and the fields of every union variant."""
    paths: list[str] = []
    for name, finfo in cls.model_fields.items():
        for spelling in _field_names(name, finfo):
            path = flag_path(prefix, spelling)
            variants = _model_variants(finfo.annotation)
            annotation = _strip_annotated(finfo.annotation)
            is_plain_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
            if not variants or not is_plain_model:
                paths.append(path)
            for variant in variants:
                paths += known_flag_paths(variant, path)
    return sorted(set(paths))


def _variant_for_tag(variants: list[type[BaseModel]], tag: Any) -> type[BaseModel] | None:
    for variant in variants:
        type_field = variant.model_fields.get("type")
        if type_field is not None and type_field.default == tag:
            return variant
    return None


def loc_to_flag(cls: type[BaseModel], loc: tuple) -> str:
    """A pydantic error location as the flag the user types: discriminator tags and pydantic's
    union-member names dropped, list indices as `[i]`, snake_case as kebab-case."""
    parts: list[str] = []
    model: type[BaseModel] | None = cls
    i = 0
    while i < len(loc):
        segment = loc[i]
        i += 1
        if isinstance(segment, int):
            if parts:
                parts[-1] += f"[{segment}]"
            continue
        segment = str(segment)
        finfo = None
        if model is not None:
            finfo = next(
                (f for n, f in model.model_fields.items() if segment in _field_names(n, f)), None
            )
        parts.append(segment.replace("_", "-"))
        if finfo is None:
            model = None
            continue
        variants = _model_variants(finfo.annotation)
        item = _container_item_model(finfo.annotation)
        if item is not None:
            model = item
        elif len(variants) == 1:
            model = variants[0]
            # `X | None` errors carry the member name (`WandbMonitorConfig`) as a loc segment.
            if i < len(loc) and loc[i] == model.__name__:
                i += 1
        elif len(variants) > 1:
            tagged = _variant_for_tag(variants, loc[i]) if i < len(loc) else None
            if tagged is not None:
                model = tagged
                i += 1
            else:
                named = next((v for v in variants if i < len(loc) and v.__name__ == loc[i]), None)
                model = named
                i += 1 if named else 0
        else:
            model = None
    return "--" + ".".join(parts) if parts else "<config>"


def suggest_flag(unknown: str, known: list[str]) -> str | None:
    """The closest known flag: first among siblings (same parent path), then among all flags."""
    parent, _, leaf = unknown.rpartition(".")
    siblings = [k for k in known if k.rpartition(".")[0] == parent]
    match = difflib.get_close_matches(
        leaf, [k.rpartition(".")[2] for k in siblings], n=1, cutoff=0.6
    )
    if match:
        return f"{parent}.{match[0]}" if parent else match[0]
    match = difflib.get_close_matches(unknown, known, n=1, cutoff=0.6)
    return match[0] if match else None


def format_validation_error(cls: type[BaseModel], error: ValidationError) -> str:
    """One `--flag: message` line per error, with the input and a "did you mean" where useful."""
    known = known_flag_paths(cls)
    lines = [count_header(len(error.errors()), cls)]
    for err in error.errors():
        flag = loc_to_flag(cls, tuple(err["loc"]))
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            message = "required field is missing: set it in the TOML file or pass " + flag
        elif err["type"] == "extra_forbidden":
            message = "unknown option"
        value = err.get("input")
        if value is not None and not isinstance(value, (dict, list)) and err["type"] != "missing":
            message += f" (got {value!r})"
        if err["type"] == "extra_forbidden":
            hint = suggest_flag(flag.removeprefix("--"), known)
            if hint:
                message += f"; did you mean --{hint}?"
        lines.append(message if flag == "<config>" else f"{flag}: {message}")
    return "\n".join(lines)


def field_errors(model: BaseModel, *errors: tuple[str, str]) -> ValidationError:
    """A ValidationError for cross-field rules, located at the fields (`("batch_size", message)`,
    dotted paths relative to `model`) instead of at the sub-config: pydantic nests the location
    under the parents, so the user sees the flag to change (`--orchestrator.batch-size: ...`)
    with its value."""
    from pydantic_core import InitErrorDetails, PydanticCustomError

    details = []
    for path, message in errors:
        # A digit is a list index (`env.0.id`), shown as `--orchestrator.env[0].id`.
        loc = tuple(int(part) if part.isdigit() else part for part in path.split("."))
        value: Any = model
        for part in loc:
            value = value[part] if isinstance(part, int) else getattr(value, part)
        details.append(
            InitErrorDetails(
                type=PydanticCustomError(
                    "cross_field", message.replace("{", "{{").replace("}", "}}")
                ),
                loc=loc,
                input=value,
            )
        )
    return ValidationError.from_exception_data(type(model).__name__, details)


def exit_with_config_error(
    message: str, title: str = "Config error", code: int = EXIT_CONFIG_ERROR
) -> NoReturn:
    """Print `message` in a box on stderr and exit with `code`, without a traceback."""
    from rich.console import Console
    from rich.panel import Panel
    from rich.text import Text

    console = Console(stderr=True, highlight=False)
    console.print(
        Panel(Text(message), title=title, title_align="left", border_style="red", expand=False)
    )
    sys.exit(code)


# --- fast --help ------------------------------------------------------------------------------


@functools.cache
def _class_nodes(module_name: str) -> dict[str, ast.ClassDef]:
    """Every class definition of a module, by name, from one parse of its source file."""
    try:
        source = inspect.getsource(sys.modules[module_name])
    except (KeyError, OSError, TypeError):
        return {}
    nodes: dict[str, ast.ClassDef] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            nodes.setdefault(node.name, node)
    return nodes


@functools.cache
def _field_docstrings(cls: type) -> dict[str, str]:
    """PEP 224 field docstrings of `cls` and its config bases (same result as pydantic_config's
    extractor, which re-parses the source of every class in the MRO, pydantic's own BaseModel
    included, for every panel: 4-8 s for `rl --help` on our machines instead of ~0.3 s)."""
    result: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if base.__module__.split(".")[0] in ("builtins", "pydantic", "pydantic_config"):
            continue
        node = _class_nodes(base.__module__).get(base.__name__)
        if node is None:
            continue
        result.update({k: v.strip() for k, v in attribute_docstrings(node).items()})
    return result


def _use_fast_docstrings() -> None:
    # `pydantic_config.cli` the attribute is the function; the module is only in sys.modules.
    loader = sys.modules["pydantic_config.cli"]
    if hasattr(loader, "_extract_field_docstrings"):
        # a private function of pydantic_config, which its module type does not declare
        loader._extract_field_docstrings = lambda cls: dict(_field_docstrings(cls))  # type: ignore[attr-defined]


# --- argument pre-processing -------------------------------------------------------------------


def _model_paths(cls: type[BaseModel], prefix: str = "") -> set[str]:
    """Flag paths (kebab-case, aliases included) whose field holds a sub-config, i.e. the paths
    that `--path @ file.toml` may fill from a file."""
    paths: set[str] = set()
    for name, finfo in cls.model_fields.items():
        variants = _model_variants(finfo.annotation)
        for spelling in _field_names(name, finfo):
            path = flag_path(prefix, spelling)
            if variants:
                paths.add(path)
            for variant in variants:
                paths |= _model_paths(variant, path)
    return paths


def _hoist_root_files(args: list[str], model_paths: set[str]) -> list[str]:
    """`rl --dry-run @ rl.toml`: an `@ file` after a flag that is not a sub-config is a root file
    (pydantic_config would nest it under `dry-run`). Root files may move to the front: files
    always rank below flags, and their order among themselves is kept."""
    root: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(args):
        token = args[i]
        if token == "@" and i + 1 < len(args):
            previous = args[i - 1] if i > 0 else ""
            flag = previous[2:].replace("_", "-") if previous.startswith("--") else None
            if flag is None or flag not in model_paths:
                root += args[i : i + 2]
                i += 2
                continue
        rest.append(token)
        i += 1
    return root + rest


def _snake_case_file_targets(args: list[str]) -> list[str]:
    """`--trainer.weight-broadcast @ f.toml` -> `--trainer.weight_broadcast @ f.toml`: the loader
    nests the file under the flag path verbatim, and config keys are snake_case."""
    out = list(args)
    for i, token in enumerate(out[:-1]):
        if token.startswith("--") and out[i + 1].startswith("@"):
            out[i] = "--" + token[2:].replace("-", "_")
    return out


def _bool_union_paths(cls: type[BaseModel], prefix: str = "") -> set[str]:
    """Flag paths of fields typed `X | bool` (e.g. `model.full_offload: FullOffloadConfig | bool`);
    pydantic_config treats only plain `bool` fields as toggles."""
    paths: set[str] = set()
    for name, finfo in cls.model_fields.items():
        path = flag_path(prefix, name)
        inner = _strip_annotated(finfo.annotation)
        if get_origin(inner) in (Union, types.UnionType) and bool in get_args(inner):
            paths.add(path)
        for variant in _model_variants(finfo.annotation):
            paths |= _bool_union_paths(variant, path)
    return paths


def _expand_bool_union_toggles(args: list[str], paths: set[str]) -> list[str]:
    """`--x` -> `--x true` and `--no-x` -> `--x false` for `X | bool` fields, so they toggle
    like plain bools (`--model.full-offload`), while `--x @ file.toml` still selects a table."""
    out: list[str] = []
    for i, token in enumerate(args):
        following = args[i + 1] if i + 1 < len(args) else "--"
        takes_no_value = following.startswith("--")
        if token.startswith("--no-") and token[5:] in paths:
            out += ["--" + token[5:], "false"]
        elif token.startswith("--") and token[2:] in paths and takes_no_value:
            out += [token, "true"]
        else:
            out.append(token)
    return out


def _is_scalar_list(annotation: Any) -> bool:
    """`list[T]` or `list[T] | None` with T not a sub-config."""
    inner = _strip_annotated(annotation)
    if get_origin(inner) in (Union, types.UnionType):
        non_none = [a for a in get_args(inner) if a is not type(None)]
        inner = non_none[0] if len(non_none) == 1 else None
    if get_origin(inner) is not list:
        return False
    item = get_args(inner)[0] if get_args(inner) else None
    return not (isinstance(item, type) and issubclass(item, BaseModel))


def _variant_list_paths(cls: type[BaseModel], prefix: str = "", inside: bool = False) -> set[str]:
    """Flag paths of scalar-list fields that lie inside an optional sub-config or a union
    variant: pydantic_config gives those flags one value only (`--monitors.wandb.tags a b`
    fails on `b`), while plain sub-configs take space-separated values."""
    paths: set[str] = set()
    for name, finfo in cls.model_fields.items():
        path = flag_path(prefix, name)
        if inside and _is_scalar_list(finfo.annotation):
            paths.add(path)
        annotation = _strip_annotated(finfo.annotation)
        is_plain_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        for variant in _model_variants(finfo.annotation):
            paths |= _variant_list_paths(variant, path, inside or not is_plain_model)
    return paths


def _list_values_as_json(args: list[str], paths: set[str]) -> list[str]:
    """`--x.tags a b` -> `--x.tags '["a", "b"]'` for the paths above, so the values reach the
    field as one list; a value that is already JSON is kept. A list ends at the next `--flag`
    or `@` file, as it does in plain sub-configs."""
    out: list[str] = []
    i = 0
    while i < len(args):
        token = args[i]
        out.append(token)
        i += 1
        if not (token.startswith("--") and token[2:] in paths):
            continue
        if i < len(args) and args[i].startswith("["):
            continue
        values: list[str] = []
        while i < len(args) and not args[i].startswith(("--", "@")):
            values.append(args[i])
            i += 1
        out.append(json.dumps(values))
    return out


def _value_flag_paths(cls: type[BaseModel], prefix: str = "") -> set[str]:
    """Flag paths (kebab-case, aliases included) that take a value: every leaf that is not a
    toggle (`bool`, `X | bool`) and not an optional sub-config (bare `--monitors.wandb`)."""
    paths: set[str] = set()
    for name, finfo in cls.model_fields.items():
        variants = _model_variants(finfo.annotation)
        inner = _strip_annotated(finfo.annotation)
        toggle = inner is bool or (
            get_origin(inner) in (Union, types.UnionType) and bool in get_args(inner)
        )
        for spelling in _field_names(name, finfo):
            path = flag_path(prefix, spelling)
            if not variants and not toggle:
                paths.add(path)
            for variant in variants:
                paths |= _value_flag_paths(variant, path)
    return paths


def check_flag_values(cls: type[BaseModel], args: list[str]) -> None:
    """A flag that needs a value followed by another flag (`--max-steps --dry-run`): the loader
    would take `--dry-run` as the value and report a confusing type error, or none for a
    string field. Exits 2 naming the flag."""
    paths = _value_flag_paths(cls)
    for i, token in enumerate(args):
        following = args[i + 1] if i + 1 < len(args) else None
        if not token.startswith("--") or "=" in token:
            continue
        flag = token[2:].replace("_", "-")
        if flag in paths and (following is None or following.startswith("--")):
            got = "nothing" if following is None else f"the next flag {following}"
            exit_with_config_error(
                f"{token} needs a value (got {got}): pass `{token} VALUE` "
                "(`--help` lists what each option takes)"
            )


# --- TOML output -------------------------------------------------------------------------------


def _none_as_string(value: Any) -> Any:
    """TOML has no null: pydantic_config reads the string "None" back as None."""
    if value is None:
        return "None"
    if isinstance(value, dict):
        return {k: _none_as_string(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_none_as_string(v) for v in value]
    return value


def config_to_toml(config: BaseModel, *, exclude_unset: bool = False) -> str:
    """The config as TOML that `@ file.toml` loads back to an equal config (with
    `exclude_unset`: only what was set explicitly, i.e. from files, flags or code)."""
    import tomli_w

    return tomli_w.dumps(
        _none_as_string(config.model_dump(mode="json", exclude_unset=exclude_unset))
    )


# --- the loader --------------------------------------------------------------------------------


def parse_cli(
    cls: type[T],
    args: list[str] | None = None,
    *,
    prog: str | None = None,
    description: str | None = None,
) -> T:
    """Parse `@ file` references and `--flags` into a validated `cls`; on a user error print a
    box and exit 2. `--help` prints the panels and exits 0; `--print-config` prints TOML and exits 0."""
    args = list(sys.argv[1:] if args is None else args)
    if DEBUG_FLAG in args:
        os.environ[DEBUG_ENV] = "1"
    wants_help = "--help" in args or "-h" in args
    if wants_help:
        _use_fast_docstrings()
    print_config = PRINT_CONFIG_FLAG in args
    args = [a for a in args if a not in (PRINT_CONFIG_FLAG, DEBUG_FLAG)]
    if not wants_help:
        try:
            check_config_files(args)
        except ConfigFileProblem as problem:
            exit_with_config_error(str(problem))
        check_flag_values(cls, args)
    args = _hoist_root_files(args, _model_paths(cls))
    args = _snake_case_file_targets(_expand_bool_union_toggles(args, _bool_union_paths(cls)))
    args = _list_values_as_json(args, _variant_list_paths(cls))
    try:
        config = cli(
            cls, args=args, prog=prog, description=description or (cls.__doc__ or "").strip()
        )
    except ConfigFileError as error:
        cause = error.__cause__
        if isinstance(cause, ValidationError):
            exit_with_config_error(format_validation_error(cls, cause))
        exit_with_config_error(error.message)
    except json.JSONDecodeError as error:
        exit_with_config_error(f"a JSON value on the command line does not parse: {error}")
    except ValidationError as error:  # raised by a before-validator outside the loader's wrapping
        exit_with_config_error(format_validation_error(cls, error))
    if print_config:
        sys.stdout.write(config_to_toml(config))
        sys.exit(0)
    return config


def count_header(count: int, cls: type[BaseModel]) -> str:
    """The first line of a config error box: `2 invalid values for RLConfig:`."""
    return f"{count} invalid value{'s' if count != 1 else ''} for {cls.__name__}:"


__all__ = [
    "BaseConfig",
    "config_to_toml",
    "exit_with_config_error",
    "format_validation_error",
    "known_flag_paths",
    "loc_to_flag",
    "parse_cli",
]
