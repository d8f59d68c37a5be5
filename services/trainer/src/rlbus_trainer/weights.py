"""Publishing new weights to inference, behind one small Protocol.

    publisher = build_weight_publisher(config, bus=bus, run_dir=run_dir, world=world)
    await publisher.publish(step, engine)      # every rank calls it (gathering is collective)

- `FilesystemWeightPublisher`: every rank walks the model tensor by tensor
  (`rlbus_trainer.stream_state`: one FSDP all-gather per tensor, no rank holds the whole model)
  and rank 0 writes each tensor as it comes into `<run_dir>/broadcasts/step_N/` (HF safetensors
  shards of at most `weight_broadcast.max_shard_size` + index + config + tokenizer, temp dir +
  fsync + rename; `rlbus_trainer.safetensors_stream`), hashing each shard while writing it; then
  it puts a `WeightsPublished` with each file's sha256 under the weights KV key `latest` and on
  the weights-published subject.
- `LoraWeightPublisher` (with `trainer.lora`): the same directories, but each holds the LoRA
  adapters only (gathered with `Engine.full_state_dict`: they are small), as PEFT writes them
  (`rlbus_trainer.lora.write_adapter_dir`), announced with `lora_name` (docs/lora.md).
- `NcclWeightPublisher`: rank 0 hosts a broadcast group with every worker of every registered
  replica (TCPStore at host:port, announced with the ranks as `location`, `ranks`, `world_size`
  in the weights KV key: the rendezvous goes over the bus), then streams the version from the
  same tensor-by-tensor walk with the protocol of `rlbus.broadcast` (int64 header size, JSON
  header, the tensors' bytes in buckets of at most `weight_broadcast.bucket_size`, an all-reduce
  acknowledgement), the same module the inference workers receive with. gloo on CPU (testable
  here), vLLM's PyNccl on CUDA (docs/weights.md). Every collective runs under `timeout_s`; a failure is published as `WeightsFailed(replica_id=
  "trainer")` naming the silent ranks, and the next version forms a new group generation (new
  port) from the replica registry, as does any join or leave: never a hang.

The version under `latest` never goes backwards: `_announce` writes it by compare-and-set on the
KV revision and refuses a version that is not above the current one (a trainer resumed from an
older checkpoint retrains without publishing until it passes the bus, service.py). Bus calls are
retried through an outage for `ANNOUNCE_RETRY_S`, with a log line per retry.
"""

from __future__ import annotations

import asyncio
import functools
import re
import shutil
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Protocol, TypeVar

import msgspec
import structlog
import torch

from rlbus import broadcast
from rlbus.bus import Bus
from rlbus.bus.core import retry_transient
from rlbus.bus.errors import CasMismatch
from rlbus.checksums import weight_files
from rlbus.configs.trainer import TrainerConfig
from rlbus.netutil import free_port, reachable_host
from rlbus.obs import tracing
from rlbus.rundirs import broadcasts_dir
from rlbus.wire import weights
from rlbus.wire.subjects import WEIGHTS_LATEST_KEY
from rlbus.wire.weights import WeightFile
from rlbus_trainer.engine import Engine, World
from rlbus_trainer.lora import adapter_state_dict, write_adapter_dir
from rlbus_trainer.safetensors_stream import write_hf_dir_streamed
from rlbus_trainer.stream_state import drain, full_tensors, tensor_specs, tied_embeddings

log = structlog.get_logger()

T = TypeVar("T")


class WeightPublisher(Protocol):
    async def publish(self, step: int, engine: Engine) -> dict[str, float]:
        """Publish the engine's weights as version `step` (collective); returns timing metrics."""

    async def close(self) -> None: ...


ANNOUNCE_RETRY_S = 120.0
"""How long a weights KV read or write is retried through a NATS outage before it fails."""


async def _retrying(what: str, call: Callable[[], Awaitable[T]]) -> T:
    """`await call()`, retried on transient bus errors for ANNOUNCE_RETRY_S (one log per try)."""
    return await retry_transient(
        what, call, within_s=ANNOUNCE_RETRY_S, event="weights_kv_retry", max_delay_s=2.0
    )


async def _latest_entry(bus: Bus) -> tuple[int | None, int]:
    """(revision, version) of the weights KV key `latest`; (None, 0) when absent; a record that
    does not decode counts as version 0 (it is overwritten by the next publish)."""
    entry = await _retrying(
        "read_latest", lambda: bus.kv(bus.subjects.weights_bucket).get(WEIGHTS_LATEST_KEY)
    )
    if entry is None:
        return None, 0
    try:
        return entry.revision, weights.published_decoder.decode(entry.value).version
    except msgspec.DecodeError:
        log.warning("weights_latest_undecodable", revision=entry.revision)
        return entry.revision, 0


async def latest_version(bus: Bus) -> int:
    """The weights version the bus announces (0: none yet): how far this run has trained."""
    return (await _latest_entry(bus))[1]


async def _announce(bus: Bus, message: weights.WeightsPublished) -> bool:
    """Put the version under the weights KV key (what agents watch) and on the events stream;
    False (nothing written) when the key already holds this version or a newer one."""
    payload = weights.encoder.encode(message)
    kv = bus.kv(bus.subjects.weights_bucket)
    # The record carries the step's trace context: each replica's weight load joins the trace.
    headers = tracing.inject_headers({}) or None
    while True:
        revision, current = await _latest_entry(bus)
        if current >= message.version:
            log.warning("weights_version_not_newer", version=message.version, latest=current)
            return False
        try:
            if revision is None:
                await _retrying(
                    "create_latest", lambda: kv.create(WEIGHTS_LATEST_KEY, payload, headers=headers)
                )
            else:
                await _retrying(
                    "update_latest",
                    functools.partial(
                        kv.update, WEIGHTS_LATEST_KEY, payload, revision=revision, headers=headers
                    ),
                )
            break
        except CasMismatch:  # written meanwhile (or a retried write landed): look again
            continue
    await bus.publish(
        bus.subjects.weights_published,
        payload,
        msg_id=f"weights-{message.version}-{message.transport}",
    )
    return True


class FilesystemWeightPublisher:
    """Safetensors directories under `<run_dir>/broadcasts/` (see module docstring)."""

    def __init__(self, config: TrainerConfig, *, bus: Bus, run_dir: Path, world: World) -> None:
        self.config, self.bus, self.world = config, bus, world
        self.root = broadcasts_dir(run_dir)
        self.keep_last = config.weight_broadcast.keep_last

    lora_name: str | None = None
    """The record's `lora_name`: set by a publisher of adapters only (`LoraWeightPublisher`)."""

    async def _stale(self, step: int) -> bool:
        """Whether the bus already has version `step` or a newer one: never rewrite a directory
        replicas may serve."""
        if await latest_version(self.bus) >= step:
            log.warning("weights_version_not_newer", version=step)
            return True
        return False

    async def write_version(self, step: int, engine: Engine, out: Path) -> list[WeightFile] | None:
        """Collective: every rank gathers the model tensor by tensor (`stream_state`), rank 0
        writes each as it comes into shards at `out` (atomically) and returns the files with
        their checksums; None on the other ranks and when the version is stale."""
        model, device = engine.model, torch.device("cpu")
        tied = tied_embeddings(model)
        walk = full_tensors(model, tied, main=self.world.is_main, device=device)
        try:
            if not self.world.is_main or await self._stale(step):
                return None
            return await asyncio.to_thread(
                write_hf_dir_streamed,
                tensor_specs(model, tied),
                walk,
                self.config.model.name,
                out,
                max_shard_bytes=int(self.config.weight_broadcast.max_shard_size),
                trust_remote_code=self.config.model.trust_remote_code,
            )
        finally:  # the other ranks wait in the walk's gathers until rank 0 ran them all
            await asyncio.to_thread(drain, walk)

    async def publish(self, step: int, engine: Engine) -> dict[str, float]:
        """Rank 0 writes version `step`, announces it and prunes old ones (collective)."""
        t0 = time.perf_counter()
        out = self.root / f"step_{step}"
        files = await self.write_version(step, engine, out)
        if not self.world.is_main:
            return {}
        if files is None:
            return {"publish_s": time.perf_counter() - t0, "publish_refused": 1.0}
        t1 = time.perf_counter()
        announced = await _announce(
            self.bus,
            weights.WeightsPublished(
                version=step,
                transport="filesystem",
                location=str(out.resolve()),
                files=files,
                dtype=self.config.model.dtype,
                lora_name=self.lora_name,
            ),
        )
        if not announced:
            return {"publish_s": time.perf_counter() - t0, "publish_refused": 1.0}
        try:
            await self.prune(step)
        except Exception as error:  # the replica registry unreadable (an outage): prune next time
            log.warning("broadcasts_prune_skipped", version=step, error=type(error).__name__)
        num_bytes = sum(f.size for f in files)
        log.info(
            "weights_published",
            version=step,
            path=str(out),
            lora_name=self.lora_name,
            num_bytes=num_bytes,
            write_s=round(t1 - t0, 3),
        )
        return {
            "publish_write_s": t1 - t0,
            "publish_s": time.perf_counter() - t0,
            "publish_bytes": float(num_bytes),
        }

    async def versions_in_use(self) -> set[int]:
        """The weights versions the registered replicas serve."""
        return {info.weights_version for info in await self.bus.read_replicas()}

    async def prune(self, newest: int) -> list[int]:
        """Delete broadcasts beyond the newest `keep_last`, except versions a replica still serves."""
        steps = sorted(
            int(m.group(1))
            for p in self.root.iterdir()
            if (m := re.fullmatch(r"step_(\d+)", p.name)) and int(m.group(1)) <= newest
        )
        candidates = steps[: -self.keep_last]
        if not candidates:
            return []
        in_use = await self.versions_in_use()
        doomed = [s for s in candidates if s not in in_use]
        for s in doomed:
            shutil.rmtree(self.root / f"step_{s}", ignore_errors=True)
        if doomed:
            log.info("broadcasts_pruned", steps=doomed)
        return doomed

    async def close(self) -> None:
        """Nothing to release: every version is a directory of its own."""


def _advertised_host() -> str:
    """An address inference workers on any host can reach (`rlbus.netutil.reachable_host`: not
    the loopback address a host name may map to). The store listens on all interfaces, so
    workers on this host reach it through that address too."""
    return reachable_host()


def _sender_device() -> torch.device:
    """The device rank 0 broadcasts from: NCCL from the current GPU, else gloo on the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


Members = tuple[tuple[str, int], ...]
"""The group's receivers: (replica_id, number of worker ranks), sorted by replica id."""


class NcclWeightPublisher:
    """Tensor-by-tensor broadcast to every worker of every registered replica (module
    docstring; docs/weights.md). One group generation serves versions while the replica registry
    keeps the same members; a join, a leave or a failed version forms a new one."""

    def __init__(
        self,
        config: TrainerConfig,
        *,
        bus: Bus,
        run_dir: Path,
        world: World,
        host: str | None = None,
    ) -> None:
        self.config, self.bus, self.world = config, bus, world
        self.timeout_s = config.weight_broadcast.timeout_s
        self.bucket_bytes = config.weight_broadcast.bucket_size
        self.host = host or _advertised_host()
        self.group: broadcast.BroadcastGroup | None = None
        self.members: Members = ()
        self.started: tuple[float, ...] = ()
        """`ReplicaInfo.started_at` of each member of the current group."""
        self.ranks: dict[str, int] = {}
        self.world_size = 1
        self.generation = 0
        self.location: str | None = None

    async def read_members(self) -> tuple[Members, tuple[float, ...]]:
        """The registered replicas (draining ones excluded) with their tensor-parallel sizes,
        and when each started: a replica restarted under the same id is a new member, whose
        workers were never in the current group."""
        infos = await _retrying("read_replicas", self.bus.read_replicas)
        live = sorted((i for i in infos if i.status != "draining"), key=lambda i: i.replica_id)
        members = tuple((i.replica_id, i.tensor_parallel_size) for i in live)
        return members, tuple(i.started_at for i in live)

    def rank_names(self) -> dict[int, str]:
        """rank -> 'replica <id> worker <k>', for error messages."""
        names = {}
        for (replica, num_ranks), first in zip(self.members, self.ranks.values(), strict=True):
            names.update({first + k: f"replica {replica} worker {k}" for k in range(num_ranks)})
        return names

    async def _open_group(self, step: int, members: Members) -> bool:
        """Form generation n+1 for `members` on a free port and announce it with this version;
        False when the bus already has this version or a newer one (no group then)."""
        port = free_port("")  # all interfaces: replicas on other hosts join this store
        self.generation += 1
        self.members = members
        self.ranks, self.world_size = broadcast.member_ranks(members)
        self.location = f"{self.host}:{port}"
        # Announce first: the replicas learn the rendezvous address and their ranks from the KV.
        if not await self._announce(step):
            return False
        log.info(
            "weights_group_forming",
            generation=self.generation,
            location=self.location,
            world_size=self.world_size,
            ranks=self.ranks,
        )
        self.group = await asyncio.to_thread(
            broadcast.open_group,
            self.host,
            port,
            0,
            self.world_size,
            self.timeout_s,
            _sender_device(),
        )
        return True

    async def _announce(self, step: int) -> bool:
        assert self.location is not None  # a group was formed (_open_group) before
        return await _announce(
            self.bus,
            weights.WeightsPublished(
                version=step,
                transport="nccl",
                location=self.location,
                dtype=self.config.model.dtype,
                ranks=self.ranks,
                world_size=self.world_size,
            ),
        )

    async def publish(self, step: int, engine: Engine) -> dict[str, float]:
        """Rank 0 broadcasts version `step` to the group, formed anew when the registered
        replicas changed, as every rank gathers the model tensor by tensor (collective over the
        trainer's ranks)."""
        tied = tied_embeddings(engine.model)
        walk = full_tensors(engine.model, tied, main=self.world.is_main, device=_sender_device())
        try:
            if not self.world.is_main:
                return {}
            return await self._send(step, lambda: tensor_specs(engine.model, tied), walk)
        finally:  # the other ranks wait in the walk's gathers until rank 0 ran them all
            await asyncio.to_thread(drain, walk)

    async def _send(
        self,
        step: int,
        specs: Callable[[], list[broadcast.TensorSpec]],
        tensors: Iterator[tuple[str, torch.Tensor]],
    ) -> dict[str, float]:
        """Rank 0: announce version `step` (forming a group when needed) and stream it."""
        t0 = time.perf_counter()
        try:
            header = broadcast.Header(step, tuple(specs()), int(self.bucket_bytes))
            members, started = await self.read_members()
            if self.group is None or (members, started) != (self.members, self.started):
                await self.close()  # a join, a leave or a restart: a new group for this version
                self.started = started
                announced = await self._open_group(step, members)
            else:
                announced = await self._announce(step)
            if not announced:
                return {"publish_s": time.perf_counter() - t0, "publish_refused": 1.0}
            assert self.group is not None  # formed by _open_group, or kept from the last version
            await asyncio.to_thread(
                broadcast.send_stream, self.group, header, tensors, self.rank_names()
            )
        except (
            Exception
        ) as error:  # a deadline passed or a peer vanished: report, re-form next time
            await self._report_failure(step, error)
            return {"publish_s": time.perf_counter() - t0, "publish_failed": 1.0}
        log.info(
            "weights_broadcast",
            version=step,
            generation=self.generation,
            location=self.location,
            num_receivers=self.world_size - 1,
            num_tensors=len(header.tensors),
            num_frames=len(broadcast.frames(header)),
        )
        return {"publish_s": time.perf_counter() - t0}

    async def _report_failure(self, step: int, error: Exception) -> None:
        """Log and publish a failed version (`WeightsFailed` from "trainer"); drop the group."""
        reason = f"{type(error).__name__}: {error} (group ranks: {self.ranks})"[:1000]
        log.warning(
            "weights_broadcast_failed", version=step, generation=self.generation, reason=reason
        )
        if self.group is not None:
            self.group.close()
        self.group = None
        await self.bus.publish(
            self.bus.subjects.weights_failed,
            weights.encoder.encode(
                weights.WeightsFailed(version=step, replica_id="trainer", reason=reason)
            ),
        )

    async def close(self) -> None:
        """Drop the group: its store and sockets close, and the workers leave it when they join
        the next generation. No close frame: the workers receive only when their agent asks for
        an announced version, so a frame sent to idle workers would wait out the deadline."""
        if self.group is not None:
            self.group.close()
            self.group = None


class LoraWeightPublisher(FilesystemWeightPublisher):
    """Adapters only: `<run_dir>/broadcasts/step_N/` holds a PEFT adapter directory, announced
    with `lora_name` (replicas call /load_lora_adapter). Pruning as the filesystem publisher."""

    def __init__(self, config: TrainerConfig, *, bus: Bus, run_dir: Path, world: World) -> None:
        super().__init__(config, bus=bus, run_dir=run_dir, world=world)
        assert config.lora is not None  # build_weight_publisher picks this class only then
        self.lora = config.lora
        self.lora_name = config.lora.name

    async def write_version(self, step: int, engine: Engine, out: Path) -> list[WeightFile] | None:
        """Collective: the model gathered on rank 0 (the adapters are small; the base model's
        tensors are dropped there), its adapters written as a PEFT directory at `out`."""
        state = await asyncio.to_thread(engine.full_state_dict)
        if not self.world.is_main or await self._stale(step):
            return None
        adapters = adapter_state_dict(state)
        await asyncio.to_thread(write_adapter_dir, adapters, self.lora, self.config.model.name, out)
        return await asyncio.to_thread(weight_files, out)


PUBLISHERS: dict[str, type[FilesystemWeightPublisher] | type[NcclWeightPublisher]] = {
    "filesystem": FilesystemWeightPublisher,
    "nccl": NcclWeightPublisher,
}


def build_weight_publisher(
    config: TrainerConfig, *, bus: Bus, run_dir: Path, world: World
) -> WeightPublisher:
    """The publisher `trainer.weight_broadcast.type` selects; LoRA adapters always go through
    the filesystem."""
    if config.lora is not None:
        return LoraWeightPublisher(config, bus=bus, run_dir=run_dir, world=world)
    return PUBLISHERS[config.weight_broadcast.type](config, bus=bus, run_dir=run_dir, world=world)
