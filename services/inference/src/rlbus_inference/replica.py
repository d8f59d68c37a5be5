"""The bus side of a replica: its registry lease and its weight agent.

    run_replica_tasks
      ├─ lease      ReplicaInfo under key <replica_id> of the replicas bucket (TTL lease_ttl_s,
      │             heartbeat every ttl/3); re-acquired if lost; deleted on clean shutdown,
      │             left to expire after kill -9
      └─ WeightAgent
           ├─ watch   the weights KV key `latest` -> remembers the newest WeightsPublished
           └─ apply   newest version > loaded: /update_weights (filesystem: path + sha256;
                      nccl: /init_broadcaster once per rendezvous, then receive) or
                      /load_lora_adapter; then WeightsApplied, lease updated. On failure
                      WeightsFailed with the reason and retry with backoff (1, 2, 4, 8 s),
                      giving up on that version early when a newer one is published.

The agent talks to its own engine over HTTP (the admin endpoints), exactly like an operator
would, so the engine process stays free of NATS.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time

import httpx
import structlog

from rlbus.bus import Bus
from rlbus.configs.inference import InferenceConfig
from rlbus.runs import run_id_of
from rlbus.runtime import ServiceState, TaskSupervisor
from rlbus.wire import replicas, weights
from rlbus.wire.subjects import WEIGHTS_LATEST_KEY
from rlbus_inference import processes

log = structlog.get_logger()

RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0)
UPDATE_TIMEOUT_S = 600.0


def replica_id(config: InferenceConfig) -> str:
    """Registry key of this replica: `config.replica_id` or `<hostname>-<port>` (KV-key safe)."""
    raw = config.replica_id or f"{socket.gethostname()}-{config.server.port}"
    return re.sub(r"[^A-Za-z0-9_=/.-]", "-", raw)


def served_model_name(config: InferenceConfig) -> str:
    name = (config.vllm.model_extra or {}).get("served_model_name")
    if isinstance(name, list):
        name = name[0]
    return name or config.vllm.model


def public_host(config: InferenceConfig) -> str:
    """Host other machines use to reach this replica's ports."""
    if config.server.host in ("0.0.0.0", "::", ""):
        return socket.getfqdn()
    return config.server.host


def make_replica_info(
    config: InferenceConfig, *, version: int, status: str
) -> replicas.ReplicaInfo:
    host = public_host(config)
    return replicas.ReplicaInfo(
        replica_id=replica_id(config),
        base_url=f"http://{host}:{config.server.port}/v1",
        admin_url=f"http://{host}:{config.backend_port}",
        model=served_model_name(config),
        weights_version=version,
        capacity=int((config.vllm.model_extra or {}).get("max_num_seqs", 256)),
        status=status,
    )


class WeightApplyError(RuntimeError):
    """The engine refused or failed a weights version (message = the engine's reason)."""


class WeightAgent:
    """Applies every new weights version published on the bus to this replica's engine."""

    def __init__(self, bus: Bus, config: InferenceConfig, http: httpx.AsyncClient, on_change):
        self.bus = bus
        self.config = config
        self.http = http
        self.on_change = on_change  # async (version, status) -> None: updates the lease
        self.replica_id = replica_id(config)
        self.engine_url = processes.engine_url(config)
        self.loaded_version = 0
        self.latest: weights.WeightsPublished | None = None
        self.new_version = asyncio.Event()
        self.broadcast_location: str | None = None

    async def run(self) -> None:
        """Watch and apply until cancelled; a watch that ends with an error ends the agent."""
        async with TaskSupervisor() as tasks:
            tasks.spawn("weights_watch", self.watch())
            tasks.spawn("weights_apply", self.apply_loop())
            await tasks.join()

    async def watch(self) -> None:
        kv = self.bus.kv(self.bus.subjects.weights_bucket)
        async for entry in kv.watch(WEIGHTS_LATEST_KEY, weights.published_decoder):
            if entry.value is not None:
                self.latest = entry.value
                self.new_version.set()

    async def apply_loop(self) -> None:
        while True:
            await self.new_version.wait()
            self.new_version.clear()
            target = self.latest
            if target is None or target.version <= self.loaded_version:
                continue
            await self.apply_with_retry(target)

    async def apply_with_retry(self, target: weights.WeightsPublished) -> None:
        for attempt, delay in enumerate((*RETRY_DELAYS_S, None), start=1):
            try:
                await self.on_change(self.loaded_version, "updating_weights")
                duration = await self.apply(target)
            except (WeightApplyError, httpx.HTTPError) as error:
                reason = str(error) or type(error).__name__
                log.warning(
                    "weights_failed", version=target.version, attempt=attempt, reason=reason
                )
                await self.publish_failed(target.version, reason)
                await self.on_change(self.loaded_version, "ready")
                if delay is None or await self.newer_published(target, delay):
                    return
                continue
            self.loaded_version = target.version
            await self.on_change(self.loaded_version, "ready")
            await self.publish_applied(target.version, duration)
            log.info("weights_applied", version=target.version, duration_s=round(duration, 3))
            return

    async def newer_published(self, target: weights.WeightsPublished, delay_s: float) -> bool:
        """Sleep `delay_s` unless a newer version arrives first (then True: stop retrying)."""
        try:
            await asyncio.wait_for(self.new_version.wait(), delay_s)
        except TimeoutError:
            return False
        return self.latest is not None and self.latest.version > target.version

    async def apply(self, target: weights.WeightsPublished) -> float:
        """Make the engine load `target` (inside a `weights_apply` span naming the version)."""
        from rlbus.obs import tracing

        attributes = {"weights.version": target.version, "replica_id": self.replica_id}
        with tracing.tracer().start_as_current_span("weights_apply", attributes=attributes):
            return await self._apply(target)

    async def _apply(self, target: weights.WeightsPublished) -> float:
        """Make the engine load `target`; returns seconds taken."""
        start = time.perf_counter()
        if target.lora_name is not None:
            await self.post(
                "/load_lora_adapter",
                {
                    "lora_name": target.lora_name,
                    "lora_path": target.location,
                    "version": target.version,
                },
            )
        elif target.transport == "filesystem":
            await self.post(
                "/update_weights",
                {
                    "version": target.version,
                    "path": target.location,
                    "sha256": {f.name: f.sha256 for f in target.files},
                },
            )
        else:
            await self.join_broadcast(target.location)
            await self.post("/update_weights", {"version": target.version, "source": "broadcast"})
        return time.perf_counter() - start

    async def join_broadcast(self, location: str) -> None:
        """Join the trainer's group at `host:port` once per location (rank 1 of 2: TP=1)."""
        if location == self.broadcast_location:
            return
        host, _, port = location.rpartition(":")
        await self.post(
            "/init_broadcaster",
            {
                "host": host,
                "port": int(port),
                "rank_offset": 1,
                "world_size": 2,
                "timeout_s": self.config.weight_broadcast.timeout_s,
            },
        )
        self.broadcast_location = location

    async def post(self, path: str, body: dict) -> dict:
        response = await self.http.post(self.engine_url + path, json=body, timeout=UPDATE_TIMEOUT_S)
        if response.status_code != 200:
            raise WeightApplyError(f"{path} answered {response.status_code}: {response.text[:500]}")
        return response.json()

    async def publish_applied(self, version: int, duration_s: float) -> None:
        message = weights.WeightsApplied(
            version=version, replica_id=self.replica_id, duration_s=duration_s
        )
        await self.bus.publish(
            self.bus.subjects.weights_applied,
            weights.encoder.encode(message),
            msg_id=f"applied-{self.replica_id}-{version}-{time.time_ns()}",
        )

    async def publish_failed(self, version: int, reason: str) -> None:
        message = weights.WeightsFailed(version=version, replica_id=self.replica_id, reason=reason)
        await self.bus.publish(self.bus.subjects.weights_failed, weights.encoder.encode(message))


async def hold_lease(bus: Bus, config: InferenceConfig, state: dict, stop: asyncio.Event) -> None:
    """Keep this replica's registry entry alive until `stop`; re-acquire it whenever it is lost."""
    key = replica_id(config)
    while not stop.is_set():
        info = make_replica_info(config, version=state["version"], status=state["status"])
        lease = bus.lease(
            bus.subjects.replicas_bucket,
            key,
            replicas.encoder.encode(info),
            ttl_s=config.lease_ttl_s,
            wait_s=2 * config.lease_ttl_s,
        )
        async with lease:
            state["lease"] = lease
            log.info("replica_registered", replica_id=key, base_url=info.base_url)
            lost = asyncio.create_task(lease.lost.wait())
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait({lost, stopped}, return_when=asyncio.FIRST_COMPLETED)
            lost.cancel()
            stopped.cancel()
            state["lease"] = None
    log.info("replica_withdrawn", replica_id=key)


async def run_replica_tasks(config: InferenceConfig, service: ServiceState) -> None:
    """Lease + weight agent until the service ends; then withdraw the lease and close the bus."""
    stop = service.stop_requested
    bus = await Bus.connect(
        config.bus,
        run_id=run_id_of(config.bus.run_id, run_dir=config.run_dir),
        storage_dir=config.run_dir,
        name=f"inference-{replica_id(config)}",
    )
    state = {"version": 0, "status": "ready", "lease": None}

    async def on_change(version: int, status: str) -> None:
        state["version"], state["status"] = version, status
        if (lease := state["lease"]) is not None and lease.held:
            info = make_replica_info(config, version=version, status=status)
            await lease.update(replicas.encoder.encode(info))

    try:
        async with httpx.AsyncClient() as http, TaskSupervisor() as tasks:
            agent = WeightAgent(bus, config, http, on_change)
            lease = tasks.spawn("replica_lease", hold_lease(bus, config, state, stop))
            agent_task = tasks.spawn("weight_agent", agent.run())
            await tasks.wait(stop, lease)
            agent_task.cancel()
            await lease  # withdraws the lease: stop is set or the lease ended by itself
    finally:
        await bus.close()
