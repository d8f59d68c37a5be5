"""What the five entry points share: parse first, then logging, then the service's `run`.

The service body is imported lazily (`importlib`) after the config parsed, so `--help` and config
errors never pay for torch or vLLM, and a command whose service is missing fails with a message
instead of a traceback.
"""

import importlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlbus.configs.base import exit_with_config_error
from rlbus.runs import RunDirError, RunPlan, prepare_run_dir, resolve_run_dir, short_id, slug

EXIT_SERVICE_MISSING = 3


def under_torchrun() -> bool:
    """Whether this process is a rank started by torchrun (it sets these variables)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def process_rank() -> int:
    """Global rank under torchrun, 0 otherwise."""
    return int(os.environ.get("RANK", "0"))


def load_service_run(module: str, command: str) -> Callable[[Any], Any]:
    """`module.run`, imported now; exits with a clear message if the service is not there."""
    try:
        service = importlib.import_module(module)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if missing != module and not module.startswith(missing + "."):
            raise  # a dependency of the service is missing: a real error, keep its traceback
        service = None
    run = getattr(service, "run", None)
    if run is None:
        exit_with_config_error(
            f"`{command}` parsed its config, but {module}.run does not exist in this installation. "
            "Update rlbus (or install the service package) and try again.",
            title="Service not available",
            code=EXIT_SERVICE_MISSING,
        )
    return run


def standalone_run_name(service: str, model_name: str) -> str:
    """Name for a service started by hand without `--run.name`: `<service>--<model>--<short-id>`."""
    return f"{service}--{slug(model_name)}--{short_id()}"


def ensure_run_name(config: Any, service: str) -> Path:
    """Give a config with `output_dir` and `run` a run name when it has none; return its run dir."""
    if config.run.name is None:
        config.run.name = standalone_run_name(service, config.model.name)
    return resolve_run_dir(config.output_dir, config.run.name, config.run.dir)


def prepare_run_dir_or_exit(config: Any, *, name_given: bool) -> RunPlan:
    """Apply the run-directory rules (rlbus.runs) to a named launcher config (`rl`, `sft`); a
    violation is printed in a box and exits, like any other config error."""
    try:
        return prepare_run_dir(
            config.output_dir,
            config.run.name,
            config.run.dir,
            resume=config.resume is not None,
            resume_step=config.resume.step if config.resume else None,
            clean=config.clean,
            name_was_given=name_given,
            ckpt_enabled=config.ckpt is not None,
        )
    except RunDirError as error:
        exit_with_config_error(str(error), title="Run directory")
