"""Checks a weight update passes before a single tensor reaches the engine.

A tensor vLLM cannot place (an unknown name, a wrong shape) fails inside the worker's
`reload_weights` half-way through and kills the EngineCore; a truncated file fails the same way,
and NaN weights are loaded silently. So every update is compared first with the served model's
own checkpoint (the safetensors of `--vllm.model`, read once, headers only):

    names    exactly the checkpoint's tensors: none unknown, none missing
    shapes   equal
    dtypes   equal, or both floating point (vLLM casts floats to the model dtype when loading)
    bytes    every file parses and holds exactly what its header declares (safetensors checks
             offsets against the file size; the published sha256 is checked before, by admin)
    finite   no NaN or infinity (optional: it reads every value once more)

Each problem is one line naming the tensor (or file) and what is wrong. Used by the engine's
admin endpoint for filesystem updates and by the worker extension for broadcasts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the replica reads specs without torch; the checks import it when they run
    import torch

FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
TORCH_TO_SAFETENSORS = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float64": "F64",
    "int64": "I64",
    "int32": "I32",
    "uint8": "U8",
}
"""`rlbus.broadcast` dtype names (torch's, without `torch.`) -> safetensors' names."""
MAX_PROBLEMS = 5
"""Problems listed in one refusal (a wrong model has hundreds; the first few say enough)."""


@dataclass(frozen=True)
class Spec:
    """What a tensor is, as far as loading it goes."""

    dtype: str  # safetensors' name: F32, BF16, I64, ...
    shape: tuple[int, ...]


class WeightsRefused(ValueError):
    """An update that must not be loaded; `problems` are one line each."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        more = len(problems) - MAX_PROBLEMS
        shown = "; ".join(problems[:MAX_PROBLEMS]) + (f"; and {more} more" if more > 0 else "")
        super().__init__(shown)


def file_specs(files: Iterable[Path]) -> dict[str, Spec]:
    """Name -> Spec of every tensor in `files` (headers only); WeightsRefused for a file that is
    not valid safetensors (truncated, garbage) or a tensor name found in two files."""
    from safetensors import safe_open

    specs: dict[str, Spec] = {}
    problems = []
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name in specs:
                        problems.append(f"tensor {name}: found twice (again in {path.name})")
                    part = f.get_slice(name)
                    specs[name] = Spec(part.get_dtype(), tuple(part.get_shape()))
        except Exception as error:  # safetensors raises its own error types, and OSError
            problems.append(f"file {path.name}: not a valid safetensors file ({error})")
    if problems:
        raise WeightsRefused(problems)
    return specs


def compare(update: dict[str, Spec], reference: dict[str, Spec]) -> list[str]:
    """The problems of `update` against the served model's `reference`, one line each."""
    problems = []
    for name, spec in update.items():
        want = reference.get(name)
        if want is None:
            problems.append(f"tensor {name}: not a tensor of the served model")
        elif spec.shape != want.shape:
            problems.append(
                f"tensor {name}: shape {list(spec.shape)} but the served model has "
                f"{list(want.shape)}"
            )
        elif spec.dtype != want.dtype and not (
            spec.dtype in FLOAT_DTYPES and want.dtype in FLOAT_DTYPES
        ):
            problems.append(
                f"tensor {name}: dtype {spec.dtype} but the served model has {want.dtype}"
            )
    problems.extend(
        f"tensor {name}: missing (an update carries every tensor of the model)"
        for name in sorted(reference.keys() - update.keys())
    )
    return problems


def first_non_finite(tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The problem line of the first floating-point tensor holding NaN or infinity, or None."""
    import torch

    for name, tensor in tensors:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return f"tensor {name}: holds NaN or infinite values"
    return None


def read_tensors(files: Iterable[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in `files`, one at a time (memory-mapped)."""
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def check_files(files: list[Path], reference: dict[str, Spec], *, check_finite: bool) -> None:
    """Raise WeightsRefused unless `files` form a loadable update of the `reference` model."""
    if problems := compare(file_specs(files), reference):
        raise WeightsRefused(problems)
    if check_finite and (problem := first_non_finite(read_tensors(files))):
        raise WeightsRefused([problem])


ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U8": 1}


def total_bytes(specs: dict[str, Spec]) -> int:
    """Bytes the tensors of `specs` take (8 per element for a dtype not in ITEM_BYTES)."""
    return sum(math.prod(s.shape) * ITEM_BYTES.get(s.dtype, 8) for s in specs.values())


def broadcast_specs(entries: Iterable[tuple[str, str, tuple[int, ...]]]) -> dict[str, Spec]:
    """Specs of a broadcast header's (name, torch dtype name, shape) entries."""
    return {
        name: Spec(TORCH_TO_SAFETENSORS.get(dtype, dtype), tuple(shape))
        for name, dtype, shape in entries
    }


def model_files(model: str) -> list[Path]:
    """The safetensors files of the served model: `model` as a directory, else the local
    Hugging Face cache snapshot of that id. FileNotFoundError when there are none (a model
    served from other formats): updates cannot be compared then, and are refused."""
    directory = Path(model)
    if not directory.is_dir():
        from huggingface_hub import snapshot_download

        try:
            directory = Path(snapshot_download(model, local_files_only=True))
        except Exception as error:
            raise FileNotFoundError(
                f"no local files of the served model {model}: {error}"
            ) from None
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"the served model {model} has no *.safetensors files")
    return files
