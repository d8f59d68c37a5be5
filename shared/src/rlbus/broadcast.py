"""The weight-broadcast protocol between trainer rank 0 and the inference workers (nccl transport).

Both sides use this module: the trainer's `NcclWeightPublisher` sends, the inference worker
extension (`rlbus_inference.worker`) receives. It imports torch, so only the trainer and the
inference workers import it (the shared package itself does not depend on torch).

Group. A broadcast group has `world_size` ranks: rank 0 is the trainer, which hosts the TCPStore
rendezvous at host:port (announced as `location` of a `WeightsPublished` with transport "nccl");
ranks `rank_offset .. rank_offset + tp - 1` are the workers of one inference replica. `open_group`
picks the backend from the device: gloo on CPU, NCCL on CUDA (vLLM's PyNcclCommunicator over a
StatelessProcessGroup). Either way the group has its own store, so neither side touches
torch.distributed's default group (vLLM owns it in the workers, the trainer's ranks in training).

Frames. One version is sent as broadcasts from rank 0, each under the group timeout:

    1. int64[1]   number of bytes of the header; 0 means the sender is closing the group
    2. uint8[n]   JSON header {"version": int, "tensors": [[name, dtype, shape], ...]}
    3. one tensor per header entry, in header order, with the dtype and shape it announces

Order. The header lists the tensors in the sender's state-dict order and the tensors follow in
exactly that order; receivers allocate each one from its header entry and must not reorder.
Dtypes are named without the `torch.` prefix and limited to `DTYPES`: a state dict with any
other dtype is refused by `Header.of` before a single frame is sent (a refusal half-way through
would leave the receivers waiting for tensors that never come).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}


@dataclass(frozen=True)
class TensorSpec:
    """One header entry: what the receiver allocates before the tensor's broadcast."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Header:
    """Frame 2: the version and its tensors, in the order they are sent."""

    version: int
    tensors: tuple[TensorSpec, ...]

    @classmethod
    def of(cls, version: int, state_dict: Mapping[str, torch.Tensor]) -> Header:
        """The header announcing `state_dict`; ValueError names a tensor of an unsupported dtype."""
        specs = []
        for name, tensor in state_dict.items():
            dtype = str(tensor.dtype).removeprefix("torch.")
            if dtype not in DTYPES:
                raise ValueError(
                    f"tensor {name!r} has dtype {dtype}, which the weight broadcast does not "
                    f"carry (supported: {', '.join(DTYPES)}); cast it before publishing"
                )
            specs.append(TensorSpec(name, dtype, tuple(tensor.shape)))
        return cls(version, tuple(specs))

    def encode(self) -> bytes:
        entries = [[t.name, t.dtype, list(t.shape)] for t in self.tensors]
        return json.dumps({"version": self.version, "tensors": entries}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Header:
        body = json.loads(raw)
        specs = tuple(TensorSpec(n, d, tuple(s)) for n, d, s in body["tensors"])
        return cls(int(body["version"]), specs)


class BroadcastGroup(Protocol):
    device: torch.device

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast `tensor` from rank 0 in place (rank 0 sends it, the others receive into it)."""


class GlooGroup:
    """A private gloo group (own TCPStore) that leaves torch.distributed's default group alone."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float):
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(
            host, port, world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=False
        )
        self.group = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)
        self.device = torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast(tensor, 0).wait()


class NcclGroup:
    """NCCL through vLLM's PyNcclCommunicator (CUDA only; the process must have vLLM)."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
        device: torch.device,
    ):
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        pg = StatelessProcessGroup.create(
            host, port, rank, world_size, store_timeout=int(timeout_s)
        )
        self.comm = PyNcclCommunicator(pg, device=device)
        self.device = device

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.comm.broadcast(tensor, src=0, stream=torch.cuda.current_stream())
        torch.cuda.current_stream().synchronize()


def open_group(
    host: str, port: int, rank: int, world_size: int, timeout_s: float, device: torch.device
) -> BroadcastGroup:
    """Join (rank > 0) or host (rank 0) the group at host:port: gloo on CPU, NCCL on CUDA."""
    if device.type == "cuda":
        return NcclGroup(host, port, rank, world_size, timeout_s, device)
    return GlooGroup(host, port, rank, world_size, timeout_s)


def _send_size(group: BroadcastGroup, size: int) -> None:
    group.broadcast(torch.tensor([size], dtype=torch.int64, device=group.device))


def send_state_dict(
    group: BroadcastGroup, version: int, state_dict: Mapping[str, torch.Tensor]
) -> Header:
    """Rank 0: broadcast one version (frames 1-3); returns the header it sent."""
    header = Header.of(version, state_dict)
    raw = header.encode()
    _send_size(group, len(raw))
    group.broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(group.device))
    for spec in header.tensors:
        group.broadcast(state_dict[spec.name].detach().contiguous().to(group.device))
    return header


def send_close(group: BroadcastGroup) -> None:
    """Rank 0: header size 0, which tells the receivers the group is closing."""
    _send_size(group, 0)


def receive_header(group: BroadcastGroup) -> Header | None:
    """Receivers: the next version's header, or None when the sender closed the group."""
    size = torch.zeros(1, dtype=torch.int64, device=group.device)
    group.broadcast(size)
    if int(size.item()) == 0:
        return None
    raw = torch.zeros(int(size.item()), dtype=torch.uint8, device=group.device)
    group.broadcast(raw)
    return Header.decode(bytes(raw.cpu().tolist()))


def receive_tensors(group: BroadcastGroup, header: Header) -> Iterator[tuple[str, torch.Tensor]]:
    """Receivers: yield (name, tensor) in header order as each broadcast arrives."""
    for spec in header.tensors:
        tensor = torch.empty(spec.shape, dtype=DTYPES[spec.dtype], device=group.device)
        group.broadcast(tensor)
        yield spec.name, tensor
