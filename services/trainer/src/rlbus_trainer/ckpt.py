"""Checkpoints: `<run_dir>/checkpoints/step_N/trainer/`, written with torch.distributed.checkpoint.

Layout of one checkpoint:

    step_N/trainer/            DCP shards of {"model", "optim"} (every rank writes its own)
    step_N/trainer/rank_R.pt   per-rank extras: RNG states, full-offload masters + optimizer state
    step_N/trainer/meta.json   progress (step, schedule, anything the caller adds), rank 0
    step_N/trainer/COMPLETE    written last, after a barrier, with fsync: only marked checkpoints count

A kill -9 mid-save leaves a directory without COMPLETE; resume ignores it and `prune` removes it.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
import torch.distributed as dist

from rlbus.configs.common import ResumeConfig

# The path rule, the completeness marker and resume-step resolution are the run directory's
# contract, shared with the launcher: one home in rlbus.rundirs.
from rlbus.rundirs import (
    CHECKPOINT_COMPLETE,
    CHECKPOINTS_DIR,
    checkpoint_dir,
    complete_steps,
    resolve_resume_step,
)
from rlbus_trainer.engine import Engine, torch_optimizers
from rlbus_trainer.full_offload import OptimizerInBackward

log = structlog.get_logger()


def _rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(path: Path) -> None:
    for file in path.iterdir():
        if file.is_file():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dcp_state(engine: Engine) -> dict[str, Any]:
    # torch.distributed.checkpoint is imported where it is used: it costs 0.1-0.8 s, which a run
    # without [ckpt] (and every `--help`) would pay at start-up.
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if engine.full_offload:
        return {"model": get_model_state_dict(engine.model)}
    model_sd, optim_sd = get_state_dict(engine.model, torch_optimizers(engine.optimizer))
    return {"model": model_sd, "optim": optim_sd}


def save_checkpoint(engine: Engine, run_dir: Path, step: int, progress: dict[str, Any]) -> Path:
    """Write step `step`'s checkpoint on every rank, then mark it complete. Collective."""
    import torch.distributed.checkpoint as dcp  # deferred: see _dcp_state

    path = checkpoint_dir(run_dir, step)
    if engine.world.is_main and path.exists():
        shutil.rmtree(path)  # an incomplete leftover of a killed run
    dist.barrier()
    path.mkdir(parents=True, exist_ok=True)
    dcp.save(_dcp_state(engine), checkpoint_id=str(path))
    extras: dict[str, Any] = {"rng": _rng_state()}
    if isinstance(engine.optimizer, OptimizerInBackward):  # engine.full_offload
        extras["full_offload"] = engine.optimizer.state_dict()
    torch.save(extras, path / f"rank_{engine.world.rank}.pt")
    if engine.world.is_main:
        meta = {
            "step": step,
            "schedule": engine.schedule.state_dict(),
            "world_size": engine.world.world_size,
            "progress": progress,
        }
        _fsync_write(path / "meta.json", json.dumps(meta))
    dist.barrier()
    if engine.world.is_main:
        _fsync_tree(path)
        _fsync_write(path / CHECKPOINT_COMPLETE, str(step))
    dist.barrier()
    log.info("checkpoint_saved", step=step, path=str(path))
    return path


def load_for_resume(engine: Engine, run_dir: Path, resume: ResumeConfig | None) -> int:
    """SFT: with `resume` (a ResumeConfig, or None for a fresh start) load the checkpoint the run
    continues from (rlbus.rundirs.resolve_resume_step) and return its step; 0 when there is none."""
    if resume is None:
        return 0
    step = resolve_resume_step(run_dir, resume.step)
    if step is None:
        return 0
    load_checkpoint(engine, run_dir, step)
    return step


def load_checkpoint(engine: Engine, run_dir: Path, step: int) -> dict[str, Any]:
    """Restore model, optimizer, schedule and RNG from step `step`; returns the saved progress."""
    import torch.distributed.checkpoint as dcp  # deferred: see _dcp_state
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    path = checkpoint_dir(run_dir, step)
    assert (path / CHECKPOINT_COMPLETE).exists(), f"checkpoint {path} is incomplete"
    state = _dcp_state(engine)
    dcp.load(state, checkpoint_id=str(path))
    if engine.full_offload:
        set_model_state_dict(engine.model, state["model"])
    else:
        set_state_dict(
            engine.model,
            torch_optimizers(engine.optimizer),
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
    meta = json.loads((path / "meta.json").read_text())
    engine.schedule.load_state_dict(meta["schedule"])
    rank_file = path / f"rank_{engine.world.rank}.pt"
    if rank_file.exists():  # absent when resuming with more ranks than were saved
        extras = torch.load(rank_file, weights_only=False)
        _set_rng_state(extras["rng"])
        if isinstance(engine.optimizer, OptimizerInBackward):  # engine.full_offload
            engine.optimizer.load_state_dict(extras["full_offload"])
    log.info("checkpoint_loaded", step=step, path=str(path))
    return meta["progress"]


def prune_checkpoints(run_dir: Path, keep_last: int | None, *, current_step: int) -> list[int]:
    """Delete trainer checkpoints beyond the newest `keep_last` complete ones, and incomplete
    ones older than `current_step` (rank 0 only). Returns the pruned steps."""
    complete = complete_steps(run_dir)
    doomed = set(complete[:-keep_last] if keep_last else [])
    for path in (Path(run_dir) / CHECKPOINTS_DIR).glob("step_*"):
        match = re.fullmatch(r"step_(\d+)", path.name)
        if not match or int(match.group(1)) >= current_step:
            continue
        trainer_dir = checkpoint_dir(run_dir, int(match.group(1)))
        if trainer_dir.exists() and not (trainer_dir / CHECKPOINT_COMPLETE).exists():
            doomed.add(int(match.group(1)))
    for step in sorted(doomed):
        shutil.rmtree(checkpoint_dir(run_dir, step), ignore_errors=True)
        try:
            checkpoint_dir(run_dir, step).parent.rmdir()  # only if no other service wrote there
        except OSError:
            pass
    if doomed:
        log.info("checkpoints_pruned", steps=sorted(doomed))
    return sorted(doomed)
