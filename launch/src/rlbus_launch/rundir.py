"""The launchers' run directory step: `rlbus.rundirs.prepare_run_dir` with a config error box.

The rules (names, clean, resume) live in the core (`rlbus.rundirs`); only the way a launcher
reports a violation (a boxed config error and exit) is here.
"""

from typing import Any

from rlbus.configs.base import exit_with_config_error
from rlbus.rundirs import RunDirError, RunPlan, prepare_run_dir


def prepare_run_dir_or_exit(config: Any, *, name_given: bool) -> RunPlan:
    """`prepare_run_dir` for a named launcher config (`rl`, `sft`); a violation is printed in a
    box and exits, like any other config error."""
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
