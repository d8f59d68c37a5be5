"""vLLM worker extension: the worker-side half of the admin endpoints.

vLLM mixes this class into every worker process (`--worker-extension-cls`), and the API server
reaches its methods with `engine_client.collective_rpc("<method>", args=...)`. Methods run inside
the worker, next to the model, so weights never travel through the API server process.
All methods are prefixed `rlbus_` so they cannot clash with vLLM's own worker attributes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # vLLM imports this module in its workers, where torch is loaded already
    import torch

    from rlbus.broadcast import BroadcastGroup


def safetensors_files(weights_dir: Path) -> list[Path]:
    """The `*.safetensors` files of a weights directory, sorted; raises if there are none."""
    files = sorted(Path(weights_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {weights_dir}")
    return files


class RlbusWorkerExtension:
    """Load weights from a safetensors directory or from a trainer broadcast."""

    _rlbus_group: BroadcastGroup | None

    def _rlbus_reload(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint-format tensors into the running model.

        A plain `model.load_weights` fails after the first load on CPU: vLLM repacks linear
        weights for its kernels after loading (the checkpoint-shaped parameters become empty).
        `Worker.reload_weights` restores the checkpoint layout layer by layer, loads, and
        repacks again (vllm/model_executor/model_loader/reload/).
        """
        from rlbus_inference.patches import refresh_tied_lm_head

        self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)  # type: ignore[attr-defined]
        refresh_tied_lm_head(self.model_runner.get_model())  # type: ignore[attr-defined]

    def rlbus_load_weights_from_dir(self, weights_dir: str) -> dict:
        """Load every `*.safetensors` file of `weights_dir` into the running model, in place."""
        from safetensors.torch import safe_open

        start = time.perf_counter()
        num_tensors = 0

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal num_tensors
            for path in safetensors_files(Path(weights_dir)):
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    for name in f.keys():
                        num_tensors += 1
                        yield name, f.get_tensor(name)

        self._rlbus_reload(tensors())
        return {"num_tensors": num_tensors, "seconds": time.perf_counter() - start}

    def rlbus_init_broadcaster(
        self, host: str, port: int, rank_offset: int, world_size: int, timeout_s: float
    ) -> int:
        """Join the trainer's broadcast group as rank `rank_offset + local rank`; returns the rank.
        A group this worker was in before (an older generation) is left first. BroadcastError
        when the group does not form within `timeout_s`."""
        from rlbus.broadcast import open_group

        self._rlbus_leave_group()
        rank = rank_offset + self.rank  # type: ignore[attr-defined]
        self._rlbus_group = open_group(
            host,
            port,
            rank,
            world_size,
            timeout_s,
            self.device,  # type: ignore[attr-defined]
        )
        return rank

    def _rlbus_leave_group(self) -> None:
        group = getattr(self, "_rlbus_group", None)
        if group is not None:
            group.close()
        self._rlbus_group = None

    def _rlbus_reference(self) -> dict:
        """Tensor specs of the served model's checkpoint (`rlbus_inference.validation`)."""
        from rlbus_inference import validation

        if getattr(self, "_rlbus_reference_specs", None) is None:
            model = self.model_config.model  # type: ignore[attr-defined]
            self._rlbus_reference_specs = validation.file_specs(validation.model_files(model))
        return self._rlbus_reference_specs

    def rlbus_receive_broadcast(self, check_finite: bool = True) -> dict:
        """Receive one version from the broadcast group and load it tensor by tensor.

        The header is compared with the served model before any tensor is received; a mismatch
        is refused (`{"refused": reason}`, the engine keeps its weights) after the announced
        tensors were received and dropped, so the sender is not left waiting. With
        `check_finite` the whole version is received before loading (one model's worth of extra
        memory) and refused if any value is NaN or infinite.

        Every collective has the group's deadline: a sender that dies or stalls makes this raise
        `BroadcastError` (the admin endpoint answers 500 with its message) instead of hanging,
        and the group is left; the next version comes with a new group generation.
        """
        from rlbus.broadcast import BroadcastError

        try:
            return self._rlbus_receive(check_finite)
        except BroadcastError:
            self._rlbus_leave_group()
            raise

    def _rlbus_receive(self, check_finite: bool) -> dict:
        from rlbus.broadcast import DTYPES, receive_header, receive_tensors
        from rlbus_inference import validation

        group = getattr(self, "_rlbus_group", None)
        if group is None or group.closed:
            raise RuntimeError("no broadcast group: call /init_broadcaster first")
        start = time.perf_counter()
        try:
            header = receive_header(group)
        except (ValueError, KeyError, TypeError) as error:  # a sender not speaking the protocol
            self._rlbus_group = None
            return {"refused": f"broadcast header unreadable ({error}); group closed"}
        if header is None:
            self._rlbus_group = None
            return {"version": None, "closed": True}
        announced = validation.broadcast_specs((t.name, t.dtype, t.shape) for t in header.tensors)
        reference = self._rlbus_reference()
        if problems := validation.compare(announced, reference):
            drainable = all(t.dtype in DTYPES for t in header.tensors) and (
                validation.total_bytes(announced) <= 2 * validation.total_bytes(reference)
            )
            if drainable:  # receive and drop: the group stays in step with the sender
                for _ in receive_tensors(group, header):
                    pass
            else:  # what it announces cannot even be received safely: leave the group
                self._rlbus_group = None
            return {"refused": str(validation.WeightsRefused(problems))}
        tensors: Iterable[tuple[str, torch.Tensor]] = receive_tensors(group, header)
        if check_finite:
            tensors = list(tensors)
            if problem := validation.first_non_finite(tensors):
                return {"refused": problem}
        self._rlbus_reload(iter(tensors))
        return {
            "version": header.version,
            "num_tensors": len(header.tensors),
            "seconds": time.perf_counter() - start,
        }
