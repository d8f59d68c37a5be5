"""structlog setup shared by every rlbus process.

One processor chain feeds two renderers through the stdlib `logging` root logger, so library logs
(vLLM, nats, torch) end up in the same places as ours:

    structlog.get_logger().info("batch_published", step=3)
        -> contextvars (run_id, service, step) + level + timestamp
        -> console handler: ConsoleRenderer on a terminal, one JSON object per line otherwise
        -> file handler:    JSON lines in <run_dir>/logs/<service>.log

When the process's stderr already *is* that log file (the launcher redirects each service's output
there), the file handler is skipped so no line is written twice. The console handler is named
(`console_handler()`) so that the launcher's live panel can point it above the panel while it is
shown (rlbus_launch.progress): a log line written straight to the terminal would land on the
panel's border.

Services call `setup_logging` once at start, then `bind_step(n)` as they move through steps.
"""

import logging
import os
import sys
from pathlib import Path
from typing import TextIO

import structlog
from structlog.typing import Processor

LOGS_DIR = "logs"
CONSOLE_HANDLER = "console"
"""Name of the stdlib handler that writes the console lines (stderr unless told otherwise)."""


def log_file_path(run_dir: str | Path, service: str, rank: int | None = None) -> Path:
    """`<run_dir>/logs/<service>.log` (`<service>-rank<r>.log` for ranks other than 0)."""
    name = service if not rank else f"{service}-rank{rank}"
    return Path(run_dir) / LOGS_DIR / f"{name}.log"


def shared_processors() -> list:
    """Processors applied to every event, ours and foreign (stdlib) ones alike."""
    return [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]


def make_formatter(json_lines: bool, colors: bool = False) -> structlog.stdlib.ProcessorFormatter:
    renderer = (
        structlog.processors.JSONRenderer()
        if json_lines
        else structlog.dev.ConsoleRenderer(colors=colors)
    )
    final: list[Processor] = [structlog.stdlib.ProcessorFormatter.remove_processors_meta]
    if json_lines:
        final.append(structlog.processors.format_exc_info)
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared_processors(),
        processors=[*final, renderer],
    )


def same_file(stream: TextIO, path: Path) -> bool:
    """Whether `stream` writes into `path` already (e.g. the launcher redirected stderr there)."""
    try:
        return path.exists() and os.path.samestat(os.fstat(stream.fileno()), os.stat(path))
    except (OSError, ValueError, AttributeError):
        return False


def setup_logging(
    service: str,
    *,
    run_dir: str | Path | None = None,
    run_id: str | None = None,
    level: str = "info",
    json_console: bool = False,
    rank: int | None = None,
    stream: TextIO | None = None,
) -> Path | None:
    """Configure structlog + stdlib logging for this process; returns the log file (if any).

    Console: pretty on a terminal, JSON lines otherwise (or always with `json_console`).
    File: JSON lines in `<run_dir>/logs/<service>.log` when a run directory is given.
    """
    stream = stream or sys.stderr
    numeric_level = logging.getLevelName(level.upper())
    is_tty = hasattr(stream, "isatty") and stream.isatty()

    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    root.setLevel(numeric_level)

    console = logging.StreamHandler(stream)
    console.set_name(CONSOLE_HANDLER)
    console.setFormatter(make_formatter(json_lines=json_console or not is_tty, colors=is_tty))
    root.addHandler(console)

    log_path = None
    if run_dir is not None:
        log_path = log_file_path(run_dir, service, rank)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        if not same_file(stream, log_path):
            file_handler = logging.FileHandler(log_path, encoding="utf-8")
            file_handler.setFormatter(make_formatter(json_lines=True))
            root.addHandler(file_handler)

    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared_processors(),
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.processors.UnicodeDecoder(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    context: dict[str, object] = {"service": service}
    if run_id is not None:
        context["run_id"] = run_id
    if rank is not None:
        context["rank"] = rank
    structlog.contextvars.bind_contextvars(**context)
    return log_path


def console_handler() -> logging.StreamHandler[TextIO] | None:
    """The console handler `setup_logging` installed (None before it ran)."""
    for handler in logging.getLogger().handlers:
        if handler.get_name() == CONSOLE_HANDLER and isinstance(handler, logging.StreamHandler):
            return handler
    return None


def bind_step(step: int) -> None:
    """Tag every following log event of this context with `step`."""
    structlog.contextvars.bind_contextvars(step=step)


__all__ = ["bind_step", "console_handler", "log_file_path", "setup_logging"]
