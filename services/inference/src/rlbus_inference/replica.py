"""The bus side of a replica: its registry lease, its weight agent and its lifecycle events.

    run_replica_tasks
      ├─ first    the weights KV key `latest` is read and that version loaded, so the replica
      │           registers serving the run's current weights (a restart included)
      ├─ lease    ReplicaInfo under key <replica_id> of the replicas bucket (TTL lease_ttl_s,
      │           heartbeat every ttl/3); re-acquired if lost, retried while the bus is down;
      │           deleted on shutdown (also after a child died), left to expire after kill -9
      └─ WeightAgent (rlbus_inference.weight_agent): watches the weights KV key and has the
                  engine load every new version; `on_change` updates the lease with the loaded
                  version and status

The agent talks to its own engine over HTTP (the admin endpoints), exactly like an operator
would, so the engine process stays free of NATS.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import structlog

from rlbus.bus import Bus
from rlbus.bus.errors import LeaseHeld
from rlbus.bus.kv import Lease
from rlbus.configs.inference import InferenceConfig
from rlbus.lifecycle import ServiceState, TaskSupervisor, drain_when_finished
from rlbus.netutil import is_wildcard, reachable_host
from rlbus.obs.metrics import timed_transport
from rlbus.rundirs import run_id_of
from rlbus.wire import events, replicas
from rlbus.wire.events import LifecycleState
from rlbus_inference import engine_process
from rlbus_inference.weight_agent import OnChange, WeightAgent

log = structlog.get_logger()

LEASE_RETRY_S = (1.0, 2.0, 5.0)
"""Waits between attempts to (re-)register while the bus does not answer (the last repeats)."""
LIFECYCLE_PUBLISH_S = 2.0
"""Deadline of one lifecycle event's publish: a replica never waits long on a bus to say so."""


def replica_id(config: InferenceConfig) -> str:
    """Registry key of this replica: `config.replica_id` or `<hostname>-<port>` (KV-key safe);
    an attached server is named by its URL's host and port."""
    if config.replica_id:
        raw = config.replica_id
    elif config.attach is not None:
        url = urlsplit(config.attach.url)
        raw = f"{url.hostname}-{url.port or (443 if url.scheme == 'https' else 80)}"
    else:
        raw = f"{socket.gethostname()}-{config.server.port}"
    return re.sub(r"[^A-Za-z0-9_=/.-]", "-", raw)


def served_model_name(config: InferenceConfig) -> str:
    """The model name clients send (`--vllm.served-model-name`, else the model as given)."""
    name = (config.vllm.model_extra or {}).get("served_model_name")
    if isinstance(name, list):
        name = name[0]
    return name or config.vllm.model


def public_host(host: str, advertise: str | None = None) -> str:
    """Host other machines use to reach a port of this replica bound to `host`: `advertise`
    when set, `host` when it is one address, else `netutil.reachable_host()`."""
    if is_wildcard(host):
        return advertise or reachable_host()
    return host


def advertised_urls(config: InferenceConfig) -> tuple[str, str]:
    """(public, admin) URLs other machines reach this replica at: an attached server's as
    configured, else our ports on the advertised host (`server.advertise_host`)."""
    if config.attach is not None:
        return config.attach.url, engine_process.engine_url(config)
    advertise = config.server.advertise_host
    return (
        f"http://{public_host(config.server.host, advertise)}:{config.server.port}",
        f"http://{public_host(config.admin.host, advertise)}:{config.backend_port}",
    )


STARTED_AT = time.time()
"""When this replica process started: the `started_at` of every entry it writes, so a reader
tells a restarted replica (same id, new value) from an updated one."""


def make_replica_info(
    config: InferenceConfig, *, version: int, status: str, model: str | None = None
) -> replicas.ReplicaInfo:
    """The registry entry; `model`: the LoRA adapter served, if any (what rollouts must ask
    for), else the served model name."""
    public, admin = advertised_urls(config)
    return replicas.ReplicaInfo(
        replica_id=replica_id(config),
        base_url=f"{public}/v1",
        admin_url=admin,
        model=model or served_model_name(config),
        weights_version=version,
        capacity=int((config.vllm.model_extra or {}).get("max_num_seqs", 256)),
        status=status,
        tensor_parallel_size=config.vllm.tensor_parallel_size,
        started_at=STARTED_AT,
    )


@dataclass
class LeaseState:
    """What the registry entry says now: written by the weight agent (`on_change`), read by
    every (re-)registration; `lease` is the held lease, None between registrations."""

    version: int = 0
    status: str = "ready"
    model: str | None = None
    lease: Lease | None = None

    def info(self, config: InferenceConfig) -> replicas.ReplicaInfo:
        """The registry entry for the current values."""
        return make_replica_info(config, version=self.version, status=self.status, model=self.model)


async def hold_lease(
    bus: Bus, config: InferenceConfig, state: LeaseState, stop: asyncio.Event
) -> None:
    """Keep this replica's registry entry alive until `stop`; re-acquire it whenever it is lost.
    A bus that does not answer (an outage) is retried with a line each time, never fatal; only
    another live holder of the same replica id (LeaseHeld after `2 * lease_ttl_s`) ends it."""
    key = replica_id(config)
    attempt = 0
    while not stop.is_set():
        info = state.info(config)
        lease = bus.lease(
            bus.subjects.replicas_bucket,
            key,
            replicas.encoder.encode(info),
            ttl_s=config.lease_ttl_s,
            wait_s=2 * config.lease_ttl_s,
        )
        try:
            await lease.acquire()
        except LeaseHeld:
            raise
        except Exception as error:
            delay = LEASE_RETRY_S[min(attempt, len(LEASE_RETRY_S) - 1)]
            attempt += 1
            log.warning(
                "replica_register_failed", replica_id=key, error=repr(error), retry_in_s=delay
            )
            await wait_or_stop(stop, delay)
            continue
        attempt = 0
        try:
            state.lease = lease
            log.info(
                "replica_registered",
                replica_id=key,
                base_url=info.base_url,
                weights_version=info.weights_version,
            )
            lost = asyncio.create_task(lease.lost.wait())
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait({lost, stopped}, return_when=asyncio.FIRST_COMPLETED)
            lost.cancel()
            stopped.cancel()
        finally:
            state.lease = None
            await lease.release()
    log.info("replica_withdrawn", replica_id=key)


async def wait_or_stop(stop: asyncio.Event, delay_s: float) -> None:
    """Sleep `delay_s`, or less when `stop` is set meanwhile."""
    try:
        await asyncio.wait_for(stop.wait(), delay_s)
    except TimeoutError:
        pass


def lease_updater(config: InferenceConfig, state: LeaseState) -> OnChange:
    """The weight agent's `on_change`: the new values go into `state` (the next registration's)
    and, while the lease is held, into the registry entry at once."""

    async def on_change(version: int, status: str, model: str | None) -> None:
        state.version, state.status, state.model = version, status, model
        if (lease := state.lease) is not None and lease.held:
            try:
                await lease.update(replicas.encoder.encode(state.info(config)))
            except Exception as error:  # the heartbeat carries the new value once the bus is back
                log.warning("replica_update_failed", status=status, error=repr(error))

    return on_change


async def run_replica_tasks(
    config: InferenceConfig, service: ServiceState, token: str | None = None
) -> None:
    """Load the current weights, then lease + weight agent until the service ends; then withdraw
    the lease and close the bus. The agent sends the admin `token` with every call."""
    bus = await Bus.connect(
        config.bus,
        run_id=run_id_of(config.bus.run_id, run_dir=config.run_dir),
        storage_dir=config.run_dir,
        name=f"inference-{replica_id(config)}",
    )
    lifecycle = Lifecycle(bus, replica_id(config))
    final: LifecycleState = "stopped"
    stopped_reason = "lease ended"
    try:
        public, _ = advertised_urls(config)
        await lifecycle.publish("started", reason=f"serving {public}")
        await serve_registered(config, service, bus, lifecycle, token)
        stopped_reason = service.reason or stopped_reason
        if stopped_reason.startswith(engine_process.FAILED_PREFIX):
            final = "failed"
    except Exception as error:
        final, stopped_reason = "failed", f"{type(error).__name__}: {error}"
        raise
    except asyncio.CancelledError:
        stopped_reason = "cancelled while stopping"
        raise
    finally:
        await lifecycle.publish(final, reason=stopped_reason)
        await bus.close()


async def serve_registered(
    config: InferenceConfig,
    service: ServiceState,
    bus: Bus,
    lifecycle: Lifecycle,
    token: str | None,
) -> None:
    """The current weights loaded, then the lease and the weight agent until a stop request
    (or the lease ends by itself); returns once the lease is withdrawn."""
    state = LeaseState()
    headers = {"Authorization": f"Bearer {token}"} if token else None
    http_client = httpx.AsyncClient(headers=headers, transport=timed_transport())
    async with http_client as http, TaskSupervisor() as tasks:
        agent = WeightAgent(
            bus, config, http, lease_updater(config, state), replica_id=replica_id(config)
        )
        await agent.load_current()  # before registering: never advertise stale weights
        lease = tasks.spawn("replica_lease", hold_lease(bus, config, state, service.stop_requested))
        agent_task = tasks.spawn("weight_agent", agent.run())
        if config.exit_when_finished:
            tasks.spawn("finish_watch", drain_when_finished(bus, service))
        await lifecycle.publish("ready", reason=f"weights version {agent.loaded_version}")
        await tasks.wait(service.stop_requested, lease)
        if service.mode == "draining":
            await lifecycle.publish("draining", reason=service.reason)
        agent_task.cancel()
        await lease  # withdraws the lease: stop is set or the lease ended by itself


class Lifecycle:
    """The replica's lifecycle events (`events.lifecycle.inference`, instance = replica id):
    started (connected, `reason` = its public URL), ready (registered), draining, stopped,
    failed. Weight loads have their own `weights.applied` events. A bus outage loses an event
    with a line, never the replica."""

    def __init__(self, bus: Bus, instance_id: str) -> None:
        self.bus, self.instance_id = bus, instance_id

    async def publish(self, state: LifecycleState, reason: str | None = None) -> None:
        """One lifecycle event, within LIFECYCLE_PUBLISH_S."""
        message = events.Lifecycle(
            service="inference", state=state, instance_id=self.instance_id, reason=reason
        )
        try:
            await asyncio.wait_for(
                self.bus.publish(self.bus.subjects.lifecycle("inference"), message),
                LIFECYCLE_PUBLISH_S,
            )
        except Exception as error:
            log.warning("lifecycle_event_unpublished", state=state, error=repr(error))
