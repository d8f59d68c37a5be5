"""Who may call the engine's admin endpoints, and which directories a weight update may name.

Both halves of a replica use this module: the replica process (`rlbus_inference.service`)
resolves the token and the weights root from its config and hands them to the engine child in its
environment (never argv: `ps` shows argv to every user of the host); the engine's endpoint plugin
(`rlbus_inference.admin`) reads them back and enforces them. Torch-free, so it loads fast.

    admin.host loopback (default)   no token needed; a configured token is still enforced
    admin.host anything else        a token is required (exit 2 without one)
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import stat
from pathlib import Path

from rlbus.configs.inference import InferenceConfig
from rlbus.rundirs import broadcasts_dir
from rlbus.secrets import resolve_secret

ADMIN_TOKEN_ENV = "RLBUS_ADMIN_TOKEN"
"""The admin token: read by `inference` (unless admin.token_file is set) and passed to the engine."""
WEIGHTS_ROOT_ENV = "RLBUS_WEIGHTS_ROOT"
CHECK_FINITE_ENV = "RLBUS_WEIGHTS_CHECK_FINITE"
GATE_PORT_ENV = "RLBUS_GATE_FACING_PORT"
"""The engine's second, loopback listener, the one the public gate forwards to: it serves only
the public paths (`rlbus_inference.gate.is_public`), so no admin route is reachable through the
gate even if the gate's allow-list and the engine's disagreed."""
MAX_PATH_CHARS = 4096
"""Longest `path` accepted in a request (Linux's PATH_MAX)."""


class AdminExposed(ValueError):
    """The admin port would be reachable from other hosts without a token."""


def is_loopback(host: str) -> bool:
    """Whether a bind address only accepts connections from this host."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def admin_token(config: InferenceConfig) -> str | None:
    """The admin token (admin.token_file, else env RLBUS_ADMIN_TOKEN), or None. Raises
    AdminExposed when the engine port binds a non-loopback address without one, and
    rlbus.secrets.SecretError for an unusable token file; both are one line naming the field."""
    token = resolve_secret(
        field="admin.token_file", file=config.admin.token_file, env=ADMIN_TOKEN_ENV
    )
    if token is None and not is_loopback(config.admin.host):
        raise AdminExposed(
            f"--admin.host {config.admin.host} exposes the engine's admin endpoints to other hosts "
            f"without a token: set --admin.token-file (a mode 0600 file) or env {ADMIN_TOKEN_ENV}, "
            "or keep the default --admin.host 127.0.0.1"
        )
    return token


def weights_root(config: InferenceConfig) -> Path | None:
    """The directory weight updates must come from: admin.weights_root, else
    `<run_dir>/broadcasts` (where the trainer writes them), else None (unconfined)."""
    if config.admin.weights_root:
        return Path(config.admin.weights_root)
    if config.run_dir:
        return broadcasts_dir(config.run_dir)
    return None


def engine_env(config: InferenceConfig, token: str | None) -> dict[str, str]:
    """The variables that carry this module's settings to the engine child."""
    env = {CHECK_FINITE_ENV: "1" if config.admin.check_finite else "0"}
    if token is not None:
        env[ADMIN_TOKEN_ENV] = token
    if (root := weights_root(config)) is not None:
        env[WEIGHTS_ROOT_ENV] = str(root.resolve())
    return env


def authorized(header: str | None, token: str) -> bool:
    """Whether an `Authorization` header value carries `token` (constant-time comparison)."""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        given.strip().encode(), token.encode()
    )


class PathRefused(ValueError):
    """A directory named in a request that the engine must not read; the message says why."""


def confined_dir(field: str, raw: str, root: Path | None) -> Path:
    """`raw` as a directory under `root` (symlinks resolved), or PathRefused naming `field`."""
    if len(raw) > MAX_PATH_CHARS or "\0" in raw:
        raise PathRefused(f"`{field}` is not a usable path (longer than {MAX_PATH_CHARS} or NUL)")
    path = Path(raw)
    if not path.is_absolute():
        raise PathRefused(f"`{field}` must be an absolute path, got {raw!r}")
    if ".." in path.parts:
        raise PathRefused(f"`{field}` must not contain '..', got {raw!r}")
    resolved = path.resolve()
    if root is not None and not resolved.is_relative_to(root):
        raise PathRefused(f"`{field}` {raw} is outside the weights directory {root}")
    if not resolved.is_dir():
        raise PathRefused(f"`{field}`: weights directory {raw} does not exist")
    return resolved


def regular_files(directory: Path, pattern: str, root: Path | None) -> list[Path]:
    """The files of `directory` matching `pattern`, sorted; PathRefused for one that is not a
    regular file (a FIFO would block the reader) or that a symlink takes outside `root`."""
    found = []
    for path in sorted(directory.glob(pattern)):
        target = path.resolve()
        if root is not None and not target.is_relative_to(root):
            raise PathRefused(f"{path.name} points outside the weights directory {root}")
        try:
            mode = target.stat().st_mode
        except OSError as error:
            raise PathRefused(f"{path.name}: {error.strerror}") from None
        if not stat.S_ISREG(mode):
            raise PathRefused(f"{path.name} is not a regular file")
        found.append(target)
    return found


def root_from_env() -> Path | None:
    """The engine's weights root, as `engine_env` passed it."""
    root = os.environ.get(WEIGHTS_ROOT_ENV)
    return Path(root) if root else None
