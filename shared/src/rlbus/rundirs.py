"""Run directories: `<output_dir>/<run.dir or run.name>`, their names, and the clean/resume rules.

Every launch writes all its artifacts (logs, configs, scripts, checkpoints, broadcasts, the NATS
store, metrics) into one run directory. Launchers (`rl`, `sft`) call `prepare_run_dir` once,
before anything is written; the services they start only `resolve_run_dir` the same directory
from the resolved configs the launcher wrote.

Rules (docs/run-directories.md):
- `run.name` unset: a fresh readable name `<envs>--<model>--<short-id>` (SFT:
  `<dataset>--<model>--<short-id>`) per launch, so two launches never share a directory.
- a directory that already holds artifacts is refused unless `--resume` (continue it) or `--clean`
  (wipe it, and only it, first).
- `--resume` needs an existing directory, hence a predictable `--run.name`; `--resume.step N`
  needs checkpoint N. Without `[ckpt]` a resumed run loads its checkpoint but saves no new ones.
- `--clean` never deletes anything that is not strictly inside `output_dir`, nor a directory that
  contains the working directory or the home directory, nor through a symlink.
"""

import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import structlog

log = structlog.get_logger()

CHECKPOINTS_DIR = "checkpoints"
BROADCASTS_DIR = "broadcasts"
"""Checkpoints live in `<run_dir>/checkpoints/step_<N>/` (written by the trainer)."""
CHECKPOINT_COMPLETE = "COMPLETE"
"""Written last into a finished checkpoint (rlbus_trainer.ckpt): only marked ones count."""

FINAL_MODEL_DIR = "model"
"""`<run_dir>/model/`: the trained model (or a LoRA run's adapter) written when a run reaches
max_steps (rlbus_trainer.export; docs/export.md)."""
ROLLOUTS_DIR = "rollouts"
"""`<run_dir>/rollouts/step_<N>.jsonl`: samples of the rollouts step N trained on (orchestrator)."""
EVALS_DIR = "evals"
"""`<run_dir>/evals/step_<N>/`: one evaluation's `results.json` and `samples.jsonl`."""
EVALS_FILE = "evals.jsonl"
"""`<run_dir>/evals.jsonl`: one row per evaluation of one environment (the monitor writes it)."""
EVAL_RESULTS_FILE = "results.json"
EVAL_SAMPLES_FILE = "samples.jsonl"

RUN_SUBDIRS = ("logs", "configs", "scripts")
"""Created by `prepare_run_dir`; the services add their own (checkpoints, broadcasts, nats, ...)."""


class RunDirError(ValueError):
    """A run directory rule was broken; the message names the flag that fixes it."""


def short_id() -> str:
    """6 random hex characters: enough to keep launches of one minute apart."""
    return secrets.token_hex(3)


def slug(text: str) -> str:
    """A path-safe lowercase fragment: `Qwen/Qwen3-0.6B` -> `qwen3-0.6b`, `data/train.jsonl` -> `train`."""
    leaf = text.rstrip("/").split("/")[-1] or text
    for suffix in (".jsonl", ".json", ".parquet", ".arrow", ".csv", ".txt"):
        if leaf.endswith(suffix):
            leaf = leaf[: -len(suffix)]
    cleaned = re.sub(r"[^a-z0-9._+-]+", "-", leaf.lower()).strip("-.")
    return cleaned or "run"


def rl_run_name(env_ids: list[str], model_name: str) -> str:
    """`<envs>--<model>--<short-id>`, e.g. `reverse-text--qwen3-0.6b--3f9a1c`."""
    envs = "+".join(slug(env_id) for env_id in env_ids) or "noenv"
    return f"{envs}--{slug(model_name)}--{short_id()}"


def sft_run_name(dataset: str, model_name: str) -> str:
    """`<dataset>--<model>--<short-id>`, e.g. `reverse-text--tiny-qwen3--3f9a1c`."""
    return f"{slug(dataset)}--{slug(model_name)}--{short_id()}"


def standalone_run_name(service: str, model_name: str) -> str:
    """Name for a service started by hand without `--run.name`: `<service>--<model>--<short-id>`."""
    return f"{service}--{slug(model_name)}--{short_id()}"


def run_leaf(run_name: str | None, run_dir: str | None) -> str:
    """The directory leaf under output_dir: `run.dir` when set, else `run.name`."""
    leaf = run_dir or run_name
    assert leaf, "run.name must be resolved before the run directory"
    return leaf


def resolve_run_dir(
    output_dir: str | Path, run_name: str | None, run_dir: str | None = None
) -> Path:
    """`<output_dir>/<run.dir or run.name>` (not created, not checked)."""
    return Path(output_dir) / run_leaf(run_name, run_dir)


def has_artifacts(run_dir: Path) -> bool:
    """Whether the directory exists and holds anything at all."""
    return run_dir.is_dir() and any(run_dir.iterdir())


def check_safe_to_clean(run_dir: Path, output_dir: Path) -> None:
    """Refuse to wipe anything but a real directory strictly inside output_dir."""
    if run_dir.is_symlink():
        raise RunDirError(f"--clean refuses to wipe {run_dir}: it is a symlink; remove it by hand")
    target = run_dir.resolve()
    root = output_dir.resolve()
    if target == root or root not in target.parents:
        raise RunDirError(
            f"--clean refuses to wipe {run_dir}: it is not strictly inside output_dir {output_dir}; "
            "check --run.name / --run.dir (no '..', no absolute paths)"
        )
    if root in (Path("/"), Path.home().resolve()):
        raise RunDirError(
            f"--clean refuses to wipe {run_dir}: output_dir {output_dir} is the filesystem root or "
            "your home directory; give runs a directory of their own with --output-dir"
        )
    protected = {Path("/"), Path.home().resolve(), Path.cwd().resolve()}
    for path in protected:
        if target == path or target in path.parents:
            raise RunDirError(
                f"--clean refuses to wipe {run_dir}: it contains {path}; choose another --output-dir"
            )


def check_leaf_stays_inside(run_dir: Path, output_dir: Path) -> None:
    """`run.name`/`run.dir` must not climb out of output_dir (`..`, absolute paths). Checked on
    the path as written, so a run directory that is a symlink to another disk stays usable."""
    target = Path(os.path.normpath(run_dir.absolute()))
    root = Path(os.path.normpath(output_dir.absolute()))
    if target == root or root not in target.parents:
        raise RunDirError(
            f"run directory {run_dir} is not inside output_dir {output_dir}: "
            "--run.name / --run.dir must be a relative name without '..'"
        )


def broadcasts_dir(run_dir: str | Path) -> Path:
    """`<run_dir>/broadcasts/`: where the trainer writes weight versions (`step_<N>/`) for
    inference to load, and the only place a replica of the run loads them from."""
    return Path(run_dir) / BROADCASTS_DIR


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """`<run_dir>/checkpoints/step_<N>/trainer/`: where the trainer writes step N's checkpoint."""
    return Path(run_dir) / CHECKPOINTS_DIR / f"step_{step}" / "trainer"


def rollouts_file(run_dir: str | Path, step: int) -> Path:
    """`<run_dir>/rollouts/step_<N>.jsonl`: the samples kept of step N's batch."""
    return Path(run_dir) / ROLLOUTS_DIR / f"step_{step}.jsonl"


def eval_dir(run_dir: str | Path, step: int) -> Path:
    """`<run_dir>/evals/step_<N>/`: the evaluation of step N's weights (step 0: the base model)."""
    return Path(run_dir) / EVALS_DIR / f"step_{step}"


def numbered_steps(directory: Path, suffix: str = "") -> list[int]:
    """Steps `N` of the `step_<N><suffix>` entries of `directory`, ascending (none: [])."""
    if not directory.is_dir():
        return []
    pattern = re.compile(rf"step_(\d+){re.escape(suffix)}")
    return sorted(
        int(match.group(1)) for p in directory.iterdir() if (match := pattern.fullmatch(p.name))
    )


def never_reread_through(run_dir: Path, step: int, *, checkpointing: bool) -> int:
    """The newest step whose batch no restart of the trainer reads again once `step` is
    published: the oldest complete checkpoint's (any resume starts after it; 0 before the first),
    or `step` itself without checkpoints (a restart then refuses to start over: `trainer_start`).
    The trainer deletes the claim-check files of the batches through it."""
    if not checkpointing:
        return step
    complete = complete_steps(run_dir)
    return complete[0] if complete else 0


def complete_steps(run_dir: Path) -> list[int]:
    """Steps whose trainer checkpoint is complete (its COMPLETE marker is written last), ascending.

    A directory without the marker is a save that was killed midway: it never counts, for the
    launcher's resume check as for the trainer's load.
    """
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    steps = []
    for path in root.iterdir():
        match = re.fullmatch(r"step_(\d+)", path.name)
        if match and (path / "trainer" / CHECKPOINT_COMPLETE).exists():
            steps.append(int(match.group(1)))
    return sorted(steps)


@overload
def resolve_resume_step(run_dir: Path, step: int) -> int: ...
@overload
def resolve_resume_step(run_dir: Path, step: None) -> int | None: ...
def resolve_resume_step(run_dir: Path, step: int | None) -> int | None:
    """The checkpoint step a resumed run loads: `step` if it is complete, else the latest complete
    one; None when the run has none yet (it then continues from its bus state only)."""
    steps = complete_steps(run_dir)
    if step is None:
        return steps[-1] if steps else None
    if step not in steps:
        available = ", ".join(map(str, steps)) or "none"
        raise RunDirError(
            f"--resume.step {step}: no complete checkpoint {checkpoint_dir(run_dir, step)} "
            f"(complete steps: {available}); pass one of them or a bare --resume for the latest"
        )
    return step


@dataclass(frozen=True)
class TrainerStart:
    """Where a starting trainer continues from (`trainer_start`)."""

    from_step: int
    """Checkpoint step to load; 0: none (a fresh run, from the model)."""
    why: str
    """`resume.step`, `latest_checkpoint` or `fresh_run`: logged as `trainer_resumed`."""


def trainer_start(run_dir: Path, resume_step: int | None, bus_version: int) -> TrainerStart:
    """The one auto-resume rule of the trainer (docs/run-directories.md, "Restarts").

    A trainer is started again with the command it was first started with (the launcher,
    compose, SLURM, systemd), so `resume` may well be unset: it continues from the newest complete
    checkpoint whenever there is one. `--resume.step N` picks checkpoint N (which must be
    complete). With no checkpoint, a run whose bus already has weights (`bus_version` > 0, the
    weights KV `latest`) has trained: starting again from step 1 would retrain it and publish
    versions that go backwards, so that is refused (`RunDirError`), never done silently.
    """
    if resume_step is not None:
        return TrainerStart(resolve_resume_step(run_dir, resume_step), "resume.step")
    steps = complete_steps(run_dir)
    if steps:
        return TrainerStart(steps[-1], "latest_checkpoint")
    if bus_version > 0:
        raise RunDirError(
            f"the bus of this run is at weights version {bus_version} but no complete checkpoint "
            f"exists in {Path(run_dir) / CHECKPOINTS_DIR}: the trainer cannot continue it. Enable "
            "[ckpt] (--ckpt.interval N) so restarts can resume, or start a new run with another "
            "--run.name or with --clean"
        )
    return TrainerStart(0, "fresh_run")


@dataclass(frozen=True)
class RunPlan:
    """What a launcher decided about its run directory."""

    run_dir: Path
    resuming: bool
    resume_step: int | None
    """Checkpoint to load (None: start from the model / bus state only)."""
    save_checkpoints: bool
    """False when no `[ckpt]` is configured: a resumed run then loads but saves nothing new."""


def prepare_run_dir(
    output_dir: str | Path,
    run_name: str,
    run_dir: str | None = None,
    *,
    resume: bool = False,
    resume_step: int | None = None,
    clean: bool = False,
    name_was_given: bool = True,
    ckpt_enabled: bool = False,
) -> RunPlan:
    """Apply the run-directory rules, wipe on `clean`, create the directory and its subdirs."""
    output = Path(output_dir)
    path = resolve_run_dir(output, run_name, run_dir)
    check_leaf_stays_inside(path, output)
    if resume and clean:
        raise RunDirError(
            "--resume and --clean exclude each other: --clean would wipe what --resume loads"
        )
    if resume and not name_was_given:
        raise RunDirError("--resume needs the name of the run to continue: pass --run.name <name>")
    if resume and not path.is_dir():
        raise RunDirError(
            f"--resume: no run directory {path}; pass the --run.name (and --output-dir) of an existing run"
        )
    if clean and path.exists():
        check_safe_to_clean(path, output)
        shutil.rmtree(path)
        log.info("run_dir_cleaned", run_dir=str(path))
    elif has_artifacts(path) and not resume:
        raise RunDirError(
            f"run directory {path} already holds artifacts: pass --resume to continue that run, "
            "or --clean to wipe it first (or choose another --run.name)"
        )
    step = resolve_resume_step(path, resume_step) if resume else None
    for sub in RUN_SUBDIRS:
        (path / sub).mkdir(parents=True, exist_ok=True)
    return RunPlan(run_dir=path, resuming=resume, resume_step=step, save_checkpoints=ckpt_enabled)


# ---- the run of a service's config (`output_dir`, `run`, `bus.run_id`) --------------------------


def run_dir_of(config: Any) -> Path:
    """`<output_dir>/<run.dir or run.name>` of a config with `output_dir` and `run`."""
    return resolve_run_dir(config.output_dir, config.run.name, config.run.dir)


def ensure_run_name(config: Any, service: str) -> Path:
    """Give a config with `output_dir` and `run` a run name when it has none; return its run dir."""
    if config.run.name is None:
        config.run.name = standalone_run_name(service, config.model.name)
    return run_dir_of(config)


def require_run_dir(config: Any, service: str) -> Path:
    """The run directory of a config that must name its run (the launchers always do)."""
    if not (config.run.name or config.run.dir):
        raise RunDirError(
            f"{service}: run.name is not set; pass --run.name (the `rl` and `sft` launchers set it)"
        )
    return run_dir_of(config)


def run_id_of(
    bus_run_id: str | None, run_name: str | None = None, run_dir: str | None = None
) -> str | None:
    """The run id on the bus: `bus.run_id`, else the run name, else the run directory's leaf."""
    if bus_run_id or run_name:
        return bus_run_id or run_name
    return Path(run_dir).name if run_dir else None
