"""GPU placement on one node: which devices each inference replica and the trainer's torchrun get.

One function decides the split, `place_gpus`; the config check (`RLConfig`), the local launcher
(`rlbus_launch.plan`), the compose GPU override (`rl compose-gpus`) and the SLURM rendering
(`rlbus_launch.slurm`) all call it, so the same config gives the same split everywhere
(docs/launcher.md, "GPUs").

    gpu_ids = [0, 1, 2, 3, 4, 5, 6, 7]           deployment.gpu_ids (default: the GPUs detected)
    num_replicas = 2, tensor_parallel_size = 2    replicas = num_infer_gpus / tensor_parallel_size
    num_train_gpus = 4
    -> inference [[0, 1], [2, 3]], trainer [4, 5, 6, 7]

Inference takes the first GPUs of the list, the trainer the next ones, unless
`deployment.infer_gpu_ids` / `deployment.train_gpu_ids` name them; GPUs left over stay idle.
Each process sees only its own devices through `CUDA_VISIBLE_DEVICES` (`visible_devices`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


class PlacementError(ValueError):
    """A GPU split that cannot work; `field` is the config key to change, the message says how."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


@dataclass(frozen=True)
class GpuPlacement:
    inference: tuple[tuple[int, ...], ...]
    """Devices of each inference replica, tensor_parallel_size each."""

    trainer: tuple[int, ...]
    """Devices of the trainer's torchrun, one per rank."""


def visible_devices(devices: Sequence[int]) -> str:
    """The `CUDA_VISIBLE_DEVICES` value of a process that owns `devices`."""
    return ",".join(str(d) for d in devices)


def detected_gpus(environ: dict[str, str] | None = None, dev: Path = Path("/dev")) -> list[int]:
    """The GPUs this process may use, without importing torch: `CUDA_VISIBLE_DEVICES` when set
    (integer ids only), else the NVIDIA device nodes (`/dev/nvidia0`, ...); [] on a CPU host."""
    env = os.environ if environ is None else environ
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        items = [item.strip() for item in listed.split(",") if item.strip()]
        if any(not item.isdigit() for item in items if item != "-1"):
            raise PlacementError(
                "deployment.gpu_ids",
                f"CUDA_VISIBLE_DEVICES={listed!r} is not a list of device numbers: give the "
                "devices as numbers with --deployment.gpu-ids",
            )
        return [] if "-1" in items else [int(item) for item in items]
    nodes = (p.name for p in dev.glob("nvidia*"))
    return sorted(int(m[1]) for n in nodes if (m := re.fullmatch(r"nvidia(\d+)", n)))


def _check_list(field: str, ids: Sequence[int], length: int | None, what: str) -> None:
    twice = sorted({g for g in ids if list(ids).count(g) > 1})
    if twice:
        raise PlacementError(field, f"lists GPU {twice[0]} twice: name each device once")
    if length is not None and len(ids) != length:
        raise PlacementError(field, f"names {len(ids)} GPUs, {what} needs {length}")


def _taken(
    gpu_ids: Sequence[int], infer_ids: Sequence[int] | None, train_ids: Sequence[int] | None
) -> None:
    """Explicit per-service lists must be disjoint and name devices of `gpu_ids`."""
    if infer_ids is not None and train_ids is not None:
        shared = sorted(set(infer_ids) & set(train_ids))
        if shared:
            raise PlacementError(
                "deployment.train_gpu_ids",
                f"GPU {shared[0]} is also in deployment.infer_gpu_ids: inference and the "
                "trainer never share a device; give each its own",
            )
    for field, ids in (("infer_gpu_ids", infer_ids), ("train_gpu_ids", train_ids)):
        missing = sorted(set(ids or ()) - set(gpu_ids))
        if missing:
            raise PlacementError(
                f"deployment.{field}",
                f"GPU {missing[0]} is not among the node's GPUs {list(gpu_ids)} "
                "(deployment.gpu_ids, default: the GPUs detected)",
            )


def place_gpus(
    gpu_ids: Sequence[int],
    *,
    num_replicas: int,
    tensor_parallel_size: int,
    num_train_gpus: int,
    infer_gpu_ids: Sequence[int] | None = None,
    train_gpu_ids: Sequence[int] | None = None,
) -> GpuPlacement:
    """Disjoint devices for `num_replicas` inference replicas of `tensor_parallel_size` GPUs each
    and `num_train_gpus` trainer ranks, taken from `gpu_ids` (module docstring); PlacementError
    names the field to change when the split cannot work."""
    num_infer = num_replicas * tensor_parallel_size
    _check_list("deployment.gpu_ids", gpu_ids, None, "")
    what = f"num_infer_replicas ({num_replicas}) x tensor_parallel_size ({tensor_parallel_size})"
    if infer_gpu_ids is not None:
        _check_list("deployment.infer_gpu_ids", infer_gpu_ids, num_infer, what)
    if train_gpu_ids is not None:
        _check_list("deployment.train_gpu_ids", train_gpu_ids, num_train_gpus, "num_train_gpus")
    _taken(gpu_ids, infer_gpu_ids, train_gpu_ids)
    named = {*(infer_gpu_ids or ()), *(train_gpu_ids or ())}
    free = [g for g in gpu_ids if g not in named]
    infer = list(infer_gpu_ids) if infer_gpu_ids is not None else free[:num_infer]
    free = [g for g in free if g not in infer]
    train = list(train_gpu_ids) if train_gpu_ids is not None else free[:num_train_gpus]
    if len(infer) < num_infer or len(train) < num_train_gpus:
        raise PlacementError(
            "deployment.gpu_ids",
            f"the run needs {num_infer + num_train_gpus} GPUs ({num_infer} for inference: "
            f"{what}; {num_train_gpus} for the trainer: num_train_gpus), the node has "
            f"{len(gpu_ids)} {list(gpu_ids)}: lower deployment.num_infer_gpus or "
            "deployment.num_train_gpus, or name more devices",
        )
    replicas = tuple(
        tuple(infer[i : i + tensor_parallel_size])
        for i in range(0, num_infer, tensor_parallel_size)
    )
    return GpuPlacement(inference=replicas, trainer=tuple(train))
