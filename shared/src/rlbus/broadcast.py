"""The weight-broadcast protocol between trainer rank 0 and the inference workers (nccl transport).

Both sides use this module: the trainer's `NcclWeightPublisher` sends, the inference worker
extension (`rlbus_inference.worker`) receives. It imports torch, so only the trainer and the
inference workers import it (the shared package itself does not depend on torch).

Group. One group generation covers the trainer and every worker of every registered replica:
`world_size = 1 + sum of the replicas' tensor-parallel sizes`. Rank 0 is the trainer, which hosts
the TCPStore rendezvous at host:port (announced as `location` of a `WeightsPublished` with
transport "nccl", with `ranks`: replica id -> its first rank, and `world_size`); ranks
`rank_offset .. rank_offset + tp - 1` are the workers of one replica (`member_ranks` assigns them
in replica-id order). A new member set means a new generation on a new port (docs/weights.md).
`open_group` picks the backend from the device: gloo on CPU, NCCL on CUDA (vLLM's
PyNcclCommunicator over a StatelessProcessGroup). Either way the group has its own store, so
neither side touches torch.distributed's default group (vLLM owns it in the workers, the
trainer's ranks in training).

Deadlines. Nothing here waits without one (`timeout_s`, the config's `weight_broadcast.timeout_s`):
  - rendezvous: each rank sets `joined/<rank>` in the store; rank 0 waits for all of them and
    raises `BroadcastError` naming the ranks that never came;
  - each collective: gloo ops carry the group timeout and `work.wait(timeout)`; NCCL ops are
    polled on a CUDA event until the deadline, then the communicator is aborted;
  - liveness: every receiver process bumps `beat/<rank>` in the store every `BEAT_S` while it
    lives; when a send fails, rank 0 names the ranks whose counter stopped (`silent_ranks`).
A failed group is never used again (`closed`): the sender forms a new generation next version.

Frames. One version is sent as broadcasts from rank 0, each under the group timeout:

    1. int64[1]   number of bytes of the header; 0 means the sender is closing the group
    2. uint8[n]   JSON header {"version": int, "bucket_bytes": int,
                               "tensors": [[name, dtype, shape], ...]}
    3. uint8[k]   the tensors' raw bytes in frames of at most `bucket_bytes` (`frames`, the one
                  rule both sides follow): in header order, whole tensors are packed into one
                  frame while it stays within `bucket_bytes`; a bigger tensor goes alone, in
                  chunks of `bucket_bytes`; frames of zero bytes are not sent
    4. int64[1]   all-reduce (sum) acknowledgement: each receiver adds 1 once it has every tensor
                  (`receive_tensors` does it when exhausted), so rank 0 learns that all of them
                  got the version, and a dead receiver fails the version by the deadline

Memory. The sender takes its tensors from an iterator (`send_stream`; the trainer's is a walk
that gathers one FSDP tensor at a time), pulling each only when a frame needs it: beyond the
tensor at hand it holds at most one bucket (a frame of one piece is a slice of the tensor
itself, no copy). A receiver receives a one-piece frame straight into the tensor's memory and
copies a packed one out of one bucket.

Order. The header lists the tensors in the sender's order and their bytes follow in exactly
that order; receivers allocate each one from its header entry and must not reorder.
Dtypes are named without the `torch.` prefix and limited to `DTYPES`: a state dict with any
other dtype is refused by `Header.of` before a single frame is sent (a refusal half-way through
would leave the receivers waiting for tensors that never come).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
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

BUCKET_BYTES = 256 * 1024**2
"""Most bytes in one tensor frame unless the sender says otherwise (the header carries it):
`weight_broadcast.bucket_size`'s default."""

BEAT_S = 0.25
"""How often a receiver bumps its liveness counter in the group's store."""


class BroadcastError(RuntimeError):
    """The group could not form, or a collective failed or passed its deadline. The message
    names the ranks involved and what to do; the group is closed and never used again."""


def member_ranks(members: Iterable[tuple[str, int]]) -> tuple[dict[str, int], int]:
    """({replica_id: first rank}, world_size) for replicas given as (replica_id, num_ranks):
    rank 0 is the trainer, then each replica's workers in replica-id order (deterministic)."""
    ranks, next_rank = {}, 1
    for replica_id, num_ranks in sorted(members):
        ranks[replica_id] = next_rank
        next_rank += num_ranks
    return ranks, next_rank


@dataclass(frozen=True)
class TensorSpec:
    """One header entry: what the receiver allocates before the tensor's broadcast."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        """The entry announcing `tensor`; ValueError when the broadcast does not carry its dtype."""
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ValueError(
                f"tensor {name!r} has dtype {dtype}, which the weight broadcast does not "
                f"carry (supported: {', '.join(DTYPES)}); cast it before publishing"
            )
        return cls(name, dtype, tuple(tensor.shape))

    @property
    def num_bytes(self) -> int:
        return DTYPES[self.dtype].itemsize * math.prod(self.shape)


@dataclass(frozen=True)
class Header:
    """Frame 2: the version, its tensors in the order they are sent, and the bucket size that
    packs them into frames (`frames`)."""

    version: int
    tensors: tuple[TensorSpec, ...]
    bucket_bytes: int = BUCKET_BYTES

    @classmethod
    def of(
        cls, version: int, state_dict: Mapping[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES
    ) -> Header:
        """The header announcing `state_dict`; ValueError names a tensor of an unsupported dtype."""
        specs = tuple(TensorSpec.of(n, t) for n, t in state_dict.items())
        return cls(version, specs, bucket_bytes)

    def encode(self) -> bytes:
        entries = [[t.name, t.dtype, list(t.shape)] for t in self.tensors]
        body = {"version": self.version, "bucket_bytes": self.bucket_bytes, "tensors": entries}
        return json.dumps(body).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Header:
        body = json.loads(raw)
        specs = tuple(TensorSpec(n, d, tuple(s)) for n, d, s in body["tensors"])
        return cls(int(body["version"]), specs, int(body["bucket_bytes"]))


@dataclass(frozen=True)
class Piece:
    """Bytes [start, end) of tensor `index` (in header order), in one frame."""

    index: int
    start: int
    end: int


def frames(header: Header) -> list[tuple[Piece, ...]]:
    """The frames (each one broadcast) that carry the header's tensors, the same on both sides:
    in header order, whole tensors are packed into a frame while it stays within
    `bucket_bytes`; a tensor bigger than that goes alone, in chunks of `bucket_bytes`. Empty
    frames (only empty tensors) are not sent."""
    out: list[tuple[Piece, ...]] = []
    packed: list[Piece] = []
    used = 0
    for index, spec in enumerate(header.tensors):
        size = spec.num_bytes
        if packed and (used + size > header.bucket_bytes):
            out.append(tuple(packed))
            packed, used = [], 0
        if size <= header.bucket_bytes:
            packed.append(Piece(index, 0, size))
            used += size
            continue
        for start in range(0, size, header.bucket_bytes):
            out.append((Piece(index, start, min(size, start + header.bucket_bytes)),))
    if packed:
        out.append(tuple(packed))
    return [frame for frame in out if sum(p.end - p.start for p in frame)]


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view of its memory (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


class BroadcastGroup(Protocol):
    device: torch.device
    rank: int
    world_size: int
    where: str
    """The store's `host:port`, for messages."""
    closed: bool

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast `tensor` from rank 0 in place (rank 0 sends it, the others receive into it);
        BroadcastError when it fails or does not complete within the group's timeout."""

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over all ranks in place, under the same deadline."""

    def silent_ranks(self) -> list[int]:
        """Rank 0: the receivers whose liveness counter did not move lately (dead processes)."""

    def close(self) -> None:
        """Leave the group (idempotent); its ops are never used again."""


class _Membership:
    """The store-side part shared by both backends: join keys, heartbeats, silent ranks."""

    rank: int
    world_size: int
    timeout_s: float
    store: dist.Store
    where: str
    closed: bool

    def _rendezvous(self, store: dist.Store, where: str) -> None:
        """Mark this rank joined; rank 0 waits for every rank and names the missing ones."""
        self.store, self.where, self.closed = store, where, False
        store.set(f"joined/{self.rank}", "1")
        if self.rank == 0:
            deadline = time.monotonic() + self.timeout_s
            while missing := self._absent("joined"):
                if time.monotonic() > deadline:
                    raise BroadcastError(
                        f"rank(s) {missing} of {self.world_size} did not join the weight "
                        f"broadcast group at {where} within {self.timeout_s:g} s: those "
                        "inference workers are down or cannot reach this address (check "
                        "their logs, the advertised host, firewalls); the next version forms "
                        "a new group from the replica registry"
                    )
                time.sleep(0.05)
        else:
            threading.Thread(target=self._beat, daemon=True, name="rlbus-beat").start()

    def _absent(self, prefix: str) -> list[int]:
        return [r for r in range(1, self.world_size) if not self.store.check([f"{prefix}/{r}"])]

    def _beat(self) -> None:
        """Bump `beat/<rank>` while this process lives, even after the group failed here: a
        receiver that failed because another one died must not be named with it. It ends when
        rank 0 drops the group (its store goes away)."""
        while True:
            time.sleep(BEAT_S)
            try:
                self.store.add(f"beat/{self.rank}", 1)
            except Exception:
                return

    def silent_ranks(self) -> list[int]:
        def counts() -> dict[int, int]:
            return {r: self.store.add(f"beat/{r}", 0) for r in range(1, self.world_size)}

        try:
            before = counts()
            time.sleep(4 * BEAT_S)
            after = counts()
        except Exception:
            return []
        return [r for r in before if after[r] == before[r]]


class GlooGroup(_Membership):
    """A private gloo group (own TCPStore) that leaves torch.distributed's default group alone."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.timeout = timedelta(seconds=timeout_s)
        where = f"{host}:{port}"
        try:
            store = dist.TCPStore(
                host,
                port,
                world_size,
                is_master=(rank == 0),
                timeout=self.timeout,
                wait_for_workers=False,
            )
        except Exception as error:
            raise BroadcastError(
                f"rank {rank} could not reach the weight broadcast store at {where} within "
                f"{timeout_s:g} s ({error}); the trainer may have given up on this group"
            ) from error
        self._rendezvous(store, where)
        try:
            self.group: dist.ProcessGroupGloo | None = dist.ProcessGroupGloo(
                store, rank, world_size, self.timeout
            )
        except Exception as error:
            self.close()
            raise BroadcastError(
                f"rank {rank}: the gloo group at {where} did not form ({error})"
            ) from error
        self.device = torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor) -> None:
        # torch's stubs give ProcessGroupGloo (a Backend) none of ProcessGroup's collectives;
        # the pybind class has them
        self._complete("broadcast", lambda group: group.broadcast(tensor, 0))  # type: ignore[attr-defined]

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self._complete("all_reduce", lambda group: group.allreduce(tensor))  # type: ignore[attr-defined]

    def _complete(self, what: str, start: Callable[[dist.ProcessGroupGloo], dist.Work]) -> None:
        if self.closed or self.group is None:  # close() drops the group
            raise BroadcastError(f"the weight broadcast group at {self.where} is closed")
        group = self.group
        try:
            if not start(group).wait(self.timeout):
                raise TimeoutError(f"not complete within {self.timeout_s:g} s")
        except Exception as error:
            self.close()
            raise BroadcastError(f"rank {self.rank}: {what} failed ({error})") from error

    def close(self) -> None:
        # Dropping the gloo group closes its sockets: peers blocked in an op fail at once.
        self.closed = True
        self.group = None


class NcclGroup(_Membership):
    """NCCL through vLLM's PyNcclCommunicator (CUDA only; the process must have vLLM). NCCL ops
    have no timeout of their own: each is polled on a CUDA event until the deadline, and a late
    op aborts the communicator (`ncclCommAbort`), which makes the other ranks' ops fail too."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
        device: torch.device,
    ) -> None:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        where = f"{host}:{port}"
        try:
            pg = StatelessProcessGroup.create(
                host, port, rank, world_size, store_timeout=max(1, int(timeout_s))
            )
        except Exception as error:
            raise BroadcastError(
                f"rank {rank} could not reach the weight broadcast store at {where} ({error})"
            ) from error
        self._rendezvous(pg.store, where)
        self.comm = PyNcclCommunicator(pg, device=device)
        self.device = device

    def broadcast(self, tensor: torch.Tensor) -> None:
        self._complete("broadcast", lambda s: self.comm.broadcast(tensor, src=0, stream=s))

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self._complete("all_reduce", lambda s: self.comm.all_reduce(tensor, tensor, stream=s))

    def _complete(self, what: str, start: Callable[[torch.cuda.Stream], object]) -> None:
        if self.closed:
            raise BroadcastError(f"the weight broadcast group at {self.where} is closed")
        stream = torch.cuda.current_stream()
        start(stream)
        done = torch.cuda.Event()
        done.record(stream)
        deadline = time.monotonic() + self.timeout_s
        while not done.query():
            if time.monotonic() > deadline:
                self.close()
                raise BroadcastError(
                    f"rank {self.rank}: NCCL {what} not complete within {self.timeout_s:g} s"
                )
            time.sleep(0.001)

    def close(self) -> None:
        if not self.closed:
            try:  # safe during an uncoordinated failure, unlike ncclCommDestroy
                self.comm.nccl.ncclCommAbort(self.comm.comm)
            except Exception:
                pass
        self.closed = True


def open_group(
    host: str, port: int, rank: int, world_size: int, timeout_s: float, device: torch.device
) -> BroadcastGroup:
    """Join (rank > 0) or host (rank 0) the group at host:port: gloo on CPU, NCCL on CUDA.
    BroadcastError when it does not form within `timeout_s` (rank 0 names the missing ranks)."""
    if device.type == "cuda":
        return NcclGroup(host, port, rank, world_size, timeout_s, device)
    return GlooGroup(host, port, rank, world_size, timeout_s)


def _send_size(group: BroadcastGroup, size: int) -> None:
    group.broadcast(torch.tensor([size], dtype=torch.int64, device=group.device))


def send_state_dict(
    group: BroadcastGroup,
    version: int,
    state_dict: Mapping[str, torch.Tensor],
    names: Mapping[int, str] | None = None,
    bucket_bytes: int = BUCKET_BYTES,
) -> Header:
    """Rank 0: broadcast one version held in memory (`send_stream` of its items)."""
    header = Header.of(version, state_dict, bucket_bytes)
    return send_stream(group, header, iter(state_dict.items()), names)


def send_stream(
    group: BroadcastGroup,
    header: Header,
    tensors: Iterator[tuple[str, torch.Tensor]],
    names: Mapping[int, str] | None = None,
) -> Header:
    """Rank 0: broadcast one version (frames 1-4), its tensors taken from `tensors` as the
    frames need them, in header order: beyond the tensor at hand, at most one bucket is held.
    BroadcastError names the version and the receivers that went silent (`names`: rank -> a
    readable name)."""
    raw = header.encode()
    try:
        _send_size(group, len(raw))
        group.broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(group.device))
        source = _Source(header, tensors, group.device)
        for frame in frames(header):
            group.broadcast(source.frame(frame))
        acks = _acknowledge(group, 0)
    except BroadcastError as error:
        silent = [
            f"{r} ({names[r]})" if names and r in names else str(r) for r in group.silent_ranks()
        ]
        who = f"silent rank(s): {', '.join(silent)}" if silent else "no rank went silent"
        group.close()
        raise BroadcastError(
            f"weights version {header.version} not delivered to the {group.world_size - 1} "
            f"receiver(s) of {group.where} ({who}): {error}. The replicas keep serving their "
            "previous version; the next version forms a new group from the replica registry"
        ) from error
    if acks != group.world_size - 1:
        raise BroadcastError(
            f"weights version {header.version}: {acks} of {group.world_size - 1} receiver(s) "
            f"of {group.where} acknowledged it"
        )
    return header


class _Source:
    """The sender's side of `frames`: pulls each tensor from the stream when a frame first needs
    it and keeps only the current one (a big tensor spans several frames)."""

    def __init__(
        self, header: Header, tensors: Iterator[tuple[str, torch.Tensor]], device: torch.device
    ) -> None:
        self.header, self.tensors, self.device = header, tensors, device
        self.index = -1
        self.flat = torch.empty(0, dtype=torch.uint8)

    def bytes_of(self, index: int) -> torch.Tensor:
        while self.index < index:  # empty tensors in between have no piece: skip them
            name, tensor = next(self.tensors)
            self.index += 1
            # the stream and the header come from the same state dict: a mismatch is a bug
            assert TensorSpec.of(name, tensor) == self.header.tensors[self.index], name
            self.flat = _bytes_of(tensor.detach().to(self.device).contiguous())
        return self.flat

    def frame(self, pieces: tuple[Piece, ...]) -> torch.Tensor:
        """One frame's bytes: a slice of the tensor itself when it is the only piece (no copy),
        else the pieces copied into one bucket."""
        if len(pieces) == 1:
            (piece,) = pieces
            return self.bytes_of(piece.index)[piece.start : piece.end]
        bucket = torch.empty(
            sum(p.end - p.start for p in pieces), dtype=torch.uint8, device=self.device
        )
        offset = 0
        for piece in pieces:
            size = piece.end - piece.start
            bucket[offset : offset + size].copy_(
                self.bytes_of(piece.index)[piece.start : piece.end]
            )
            offset += size
        return bucket


def _acknowledge(group: BroadcastGroup, received: int) -> int:
    """Frame 4: an all-reduce of one int64 (receivers add 1, rank 0 adds 0). A broadcast may
    complete on the sender while a receiver is already dead (a send completes once its bytes
    are in the socket buffers); the all-reduce needs every rank, so a missing one fails it."""
    count = torch.tensor([received], dtype=torch.int64, device=group.device)
    group.all_reduce(count)
    return int(count.item())


def send_close(group: BroadcastGroup) -> None:
    """Rank 0: header size 0, which tells the receivers the group is closing."""
    _send_size(group, 0)


def receive_header(group: BroadcastGroup) -> Header | None:
    """Receivers: the next version's header, or None when the sender closed the group."""
    size = torch.zeros(1, dtype=torch.int64, device=group.device)
    group.broadcast(size)
    if int(size.item()) == 0:
        group.close()
        return None
    raw = torch.zeros(int(size.item()), dtype=torch.uint8, device=group.device)
    group.broadcast(raw)
    return Header.decode(bytes(raw.cpu().tolist()))


def receive_tensors(group: BroadcastGroup, header: Header) -> Iterator[tuple[str, torch.Tensor]]:
    """Receivers: yield (name, tensor) in header order as soon as each is complete (a frame
    holding a single piece is received into the tensor's memory, a packed one is copied out);
    a failure is a BroadcastError naming the version (the caller keeps its previous weights)."""
    tensors: dict[int, torch.Tensor] = {}  # allocated, not yet yielded
    allocated = 0

    def allocate(up_to: int) -> None:
        nonlocal allocated
        for index in range(allocated, up_to + 1):
            spec = header.tensors[index]
            tensors[index] = torch.empty(spec.shape, dtype=DTYPES[spec.dtype], device=group.device)
        allocated = max(allocated, up_to + 1)

    done = 0  # tensors yielded so far: the caller holds them, this side does not
    for pieces in frames(header):
        allocate(pieces[-1].index)
        if len(pieces) == 1:
            (piece,) = pieces
            into = _bytes_of(tensors[piece.index])[piece.start : piece.end]
            _receive(group, header, piece, into)
        else:
            size = sum(p.end - p.start for p in pieces)
            bucket = torch.empty(size, dtype=torch.uint8, device=group.device)
            _receive(group, header, pieces[0], bucket)
            offset = 0
            for piece in pieces:
                size = piece.end - piece.start
                _bytes_of(tensors[piece.index]).copy_(bucket[offset : offset + size])
                offset += size
        last = pieces[-1]
        complete = last.index + (last.end == header.tensors[last.index].num_bytes)
        while done < complete:
            yield header.tensors[done].name, tensors.pop(done)
            done += 1
    allocate(len(header.tensors) - 1)  # trailing empty tensors came in no frame
    for index in range(done, len(header.tensors)):
        yield header.tensors[index].name, tensors.pop(index)
    _acknowledge(group, 1)


def _receive(group: BroadcastGroup, header: Header, first: Piece, into: torch.Tensor) -> None:
    """One frame into `into`; BroadcastError names the version and the frame's first tensor."""
    try:
        group.broadcast(into)
    except BroadcastError as error:
        spec = header.tensors[first.index]
        raise BroadcastError(
            f"weights version {header.version}: tensor {first.index + 1}/{len(header.tensors)} "
            f"({spec.name}) not received from the trainer (rank 0) at {group.where}: "
            f"{error}. Is the trainer alive? This replica keeps its previous version"
        ) from error
