"""The weight-broadcast wire protocol between trainer rank 0 and the inference workers.

A broadcast group has `world_size` ranks: rank 0 is the trainer (it hosts the TCPStore
rendezvous at host:port), ranks `rank_offset .. rank_offset + tp - 1` are the workers of one
inference replica. CPU machines use gloo, CUDA machines NCCL (vLLM's PyNcclCommunicator over a
StatelessProcessGroup, so neither side touches torch.distributed's default group that vLLM owns).

One version is sent as (all broadcasts from rank 0, every one under the group timeout):

    1. int64[1]        number of bytes of the header (0 = the sender is closing the group)
    2. uint8[n]        JSON header {"version": int, "tensors": [[name, dtype, shape], ...]}
    3. one tensor per header entry, in header order, dtype/shape as announced

`send_state_dict` is the sender side; the trainer may use it as the reference implementation
(services share no code, so it re-implements these ~20 lines against this docstring).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}


class GlooBroadcastGroup:
    """A private gloo group (own TCPStore) that leaves torch.distributed's default group alone."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float):
        timeout = timedelta(seconds=timeout_s)
        store = torch.distributed.TCPStore(
            host, port, world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=False
        )
        self.group = torch.distributed.ProcessGroupGloo(store, rank, world_size, timeout)
        self.device = torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast(tensor, 0).wait()


class NcclBroadcastGroup:
    """NCCL through vLLM's PyNcclCommunicator (CUDA only)."""

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


def make_group(
    host: str, port: int, rank: int, world_size: int, timeout_s: float, device: torch.device
):
    """gloo on CPU, NCCL on CUDA."""
    if device.type == "cuda":
        return NcclBroadcastGroup(host, port, rank, world_size, timeout_s, device)
    return GlooBroadcastGroup(host, port, rank, world_size, timeout_s)


def send_state_dict(group, version: int, state_dict: dict[str, torch.Tensor]) -> None:
    """Rank 0: broadcast one version (header, then every tensor)."""
    entries = [
        [name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in state_dict.items()
    ]
    header = json.dumps({"version": version, "tensors": entries}).encode()
    group.broadcast(torch.tensor([len(header)], dtype=torch.int64, device=group.device))
    group.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(group.device))
    for name, _, _ in entries:
        group.broadcast(state_dict[name].detach().contiguous().to(group.device))


def receive_header(group) -> dict[str, Any] | None:
    """Workers: the next version's header, or None when the sender closed the group."""
    size = torch.zeros(1, dtype=torch.int64, device=group.device)
    group.broadcast(size)
    if int(size.item()) == 0:
        return None
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=group.device)
    group.broadcast(buf)
    return json.loads(bytes(buf.cpu().tolist()))


def receive_tensors(group, header: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Workers: yield (name, tensor) in header order as each broadcast arrives."""
    for name, dtype, shape in header["tensors"]:
        tensor = torch.empty(shape, dtype=_DTYPES[dtype], device=group.device)
        group.broadcast(tensor)
        yield name, tensor
