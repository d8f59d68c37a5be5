"""Secrets (bus tokens and passwords, the engine's admin token): where they may come from.

A secret comes from an environment variable or from a file that only its owner can read
(mode 0600 or stricter); never from a command line, where `ps` shows it to every user of the
host, nor from a config file. Configs and scripts carry the secret file's path, so there is no
value to leave out of a dump or a log line (docs/security.md).

    resolve_secret(field="bus.token", file=config.token_file, env="RLBUS_BUS_TOKEN")
"""

import os
import stat
from pathlib import Path


class SecretError(ValueError):
    """A secret file is missing, unreadable, empty or readable by others; the message is one line
    naming the field, the path and the fix."""


def read_secret_file(path: str | Path, *, field: str) -> str:
    """The secret in `path` (surrounding whitespace stripped). The file must be a regular file
    that neither its group nor others can read or write."""
    path = Path(path)
    try:
        info = path.stat()
    except FileNotFoundError:
        raise SecretError(f"{field}: secret file {path} does not exist") from None
    except OSError as error:
        raise SecretError(f"{field}: cannot read secret file {path}: {error.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise SecretError(f"{field}: secret file {path} is not a regular file")
    if info.st_mode & 0o077:
        raise SecretError(
            f"{field}: secret file {path} has mode {stat.S_IMODE(info.st_mode):04o}, "
            f"readable by others: run `chmod 600 {path}`"
        )
    try:
        value = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise SecretError(f"{field}: cannot read secret file {path}: {error}") from None
    if not value:
        raise SecretError(f"{field}: secret file {path} is empty")
    return value


def resolve_secret(*, field: str, file: str | Path | None, env: str | None) -> str | None:
    """The secret from `file` when set, else from the environment variable `env`, else None."""
    if file:
        return read_secret_file(file, field=field)
    if env and (value := os.environ.get(env, "").strip()):
        return value
    return None


def write_secret_file(path: Path, value: str) -> Path:
    """Write `value` to `path` with mode 0600 from the start (never briefly readable by others)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(value + "\n")
    os.replace(tmp, path)
    return path
