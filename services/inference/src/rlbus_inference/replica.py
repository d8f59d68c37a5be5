"""The bus side of a replica: its registry lease and its weight agent.

    run_replica_tasks
      ├─ first    the weights KV key `latest` is read and that version loaded, so the replica
      │           registers serving the run's current weights (a restart included)
      ├─ lease    ReplicaInfo under key <replica_id> of the replicas bucket (TTL lease_ttl_s,
      │           heartbeat every ttl/3); re-acquired if lost, retried while the bus is down;
      │           deleted on shutdown (also after a child died), left to expire after kill -9
      └─ WeightAgent
           ├─ watch   the weights KV key `latest` -> remembers the newest WeightsPublished
           │          (reopened after a bus error, and every WATCH_REFRESH_S)
           └─ apply   newest version != loaded: refused once (WeightsFailed, never retried) when
                      it can never apply (lower than loaded, directory missing, engine 4xx);
                      else /update_weights (filesystem: path + sha256; nccl: /init_broadcaster
                      once per group generation with the ranks of the record, then receive;
                      a failed broadcast is reported, not retried) or /load_lora_adapter, each within
                      weights_apply_timeout_s; then WeightsApplied, lease updated. A failure that
                      may pass (5xx, no answer) is retried with backoff (1, 2, 4, 8 s), giving up
                      on that version early when a newer one is published.

The agent talks to its own engine over HTTP (the admin endpoints), exactly like an operator
would, so the engine process stays free of NATS.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import msgspec
import structlog

from rlbus.bus import Bus
from rlbus.bus.errors import LeaseHeld
from rlbus.configs.inference import InferenceConfig
from rlbus.netutil import is_wildcard, reachable_host
from rlbus.obs.metrics import record_weights_version, timed_transport
from rlbus.runs import run_id_of
from rlbus.runtime import ServiceState, TaskSupervisor, drain_when_finished
from rlbus.wire import events, replicas, weights
from rlbus.wire.subjects import WEIGHTS_LATEST_KEY
from rlbus_inference import processes

log = structlog.get_logger()

RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0)
CURRENT_READ_S = 10.0
"""Deadline of reading the current weights record at start-up."""
WATCH_REFRESH_S = 15.0
WATCH_RETRY_S = 2.0
LEASE_RETRY_S = (1.0, 2.0, 5.0)
LIFECYCLE_PUBLISH_S = 2.0
"""Deadline of one lifecycle event's publish: a replica never waits long on a bus to say so."""

"""Waits between attempts to (re-)register while the bus does not answer (the last repeats)."""


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
        return config.attach.url, config.attach.admin_url
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


class WeightApplyError(RuntimeError):
    """The engine failed a weights version for a reason that may pass (5xx, no answer): retried."""


class WeightRejected(RuntimeError):
    """A weights record that can never be applied (directory missing, checksum wrong, version
    lower than the loaded one, or the engine answered 4xx): reported once, never retried."""


class WeightAgent:
    """Applies every new weights version published on the bus to this replica's engine."""

    def __init__(self, bus: Bus, config: InferenceConfig, http: httpx.AsyncClient, on_change):
        self.bus = bus
        self.config = config
        self.http = http
        self.on_change = on_change  # async (version, status, model) -> None: updates the lease
        self.served_lora: str | None = None
        """The LoRA adapter name loaded last (None: the base model or full weights): the replica
        advertises it as its model, so rollouts sample from the adapter."""
        self.replica_id = replica_id(config)
        self.engine_url = processes.engine_url(config)
        self.loaded_version = 0
        record_weights_version(self.replica_id, 0)  # Prometheus (rlbus.obs.metrics)
        self.latest: weights.WeightsPublished | None = None
        self.new_version = asyncio.Event()
        self.broadcast_location: str | None = None
        self.rejected: set[tuple] = set()
        """Records refused or given up for good (`record_key`): one delivered again (the watch
        is reopened every WATCH_REFRESH_S) is not tried or reported again; the same version
        published again as a new record is."""
        self.undecodable: set[int | None] = set()
        """Revisions of `latest` that did not decode (logged once each)."""
        self.trace_headers: dict[tuple, dict[str, str]] = {}
        """`record_key` -> the trace context stored with that record (tracing on only): the
        weight load joins the trace of the step that produced the weights."""

    async def run(self) -> None:
        """Watch and apply until cancelled (bus errors are ridden out; a bug still ends it)."""
        async with TaskSupervisor() as tasks:
            tasks.spawn("weights_watch", self.watch())
            tasks.spawn("weights_apply", self.apply_loop())
            await tasks.join()

    async def load_current(self) -> None:
        """Apply the version current in the weights KV (`latest`) now, before the replica
        registers: a restarted replica serves the run's weights, not the base model's. No record,
        or a bus that does not answer within the deadline, leaves version 0 (the watch catches
        up)."""
        kv = self.bus.kv(self.bus.subjects.weights_bucket)
        log.info("weights_current_reading", key=WEIGHTS_LATEST_KEY, deadline_s=CURRENT_READ_S)
        try:
            entry = await asyncio.wait_for(kv.get(WEIGHTS_LATEST_KEY), CURRENT_READ_S)
        except Exception as error:  # a bus outage: start with version 0, the watch catches up
            log.warning("weights_current_unreadable", error=repr(error))
            return
        if entry is None or not entry.value:
            log.info("weights_current_none")
            return
        target = self.decode(entry.value, entry.revision)
        if target is not None and target.version > 0:
            await self.remember_trace(kv, entry.revision, target)
            self.latest = target
            await self.apply_with_retry(target)

    def decode(self, data: bytes, revision: int | None) -> weights.WeightsPublished | None:
        """The record, or None (one error line) when it is not a WeightsPublished."""
        try:
            message = weights.published_decoder.decode(data)
        except msgspec.DecodeError as error:  # ValidationError is a DecodeError too
            if revision not in self.undecodable:
                self.undecodable.add(revision)
                log.error("weights_record_undecodable", revision=revision, error=str(error))
            return None
        return message

    async def watch(self) -> None:
        """Follow `latest`; a watch broken by a bus outage is opened again (with a line), and the
        key is also read every WATCH_REFRESH_S in case a watch stopped delivering silently."""
        kv = self.bus.kv(self.bus.subjects.weights_bucket)
        while True:
            try:
                async with asyncio.timeout(WATCH_REFRESH_S):
                    async for entry in kv.watch(WEIGHTS_LATEST_KEY):
                        if entry.value:
                            target = self.decode(entry.value, entry.revision)
                            await self.remember_trace(kv, entry.revision, target)
                            self.offer(target)
            except TimeoutError:
                continue  # reopened: its first entry is the current value
            except Exception as error:
                log.warning("weights_watch_failed", error=repr(error), retry_in_s=WATCH_RETRY_S)
                await asyncio.sleep(WATCH_RETRY_S)

    async def remember_trace(self, kv, revision: int, target) -> None:
        """Keep the trace context stored with record `revision` (one read, only when tracing)."""
        from rlbus.obs import tracing

        if target is None or not tracing.enabled() or record_key(target) in self.trace_headers:
            return
        try:
            self.trace_headers[record_key(target)] = await kv.headers_of(revision)
        except Exception as error:  # a trace is not worth a failed weight load
            log.debug("weights_trace_unread", revision=revision, error=repr(error))
        for key in list(self.trace_headers)[:-4]:  # the newest few records are enough
            del self.trace_headers[key]

    def offer(self, target: weights.WeightsPublished | None) -> None:
        if target is not None:
            self.latest = target
            self.new_version.set()

    async def apply_loop(self) -> None:
        while True:
            await self.new_version.wait()
            self.new_version.clear()
            target = self.latest
            if target is None or target.version == self.loaded_version:
                continue
            await self.apply_with_retry(target)
            if target.version != self.loaded_version:
                self.rejected.add(record_key(target))  # its retries are spent: not tried again

    def refusal(self, target: weights.WeightsPublished) -> str | None:
        """Why `target` can never be applied here, or None. Checksums are the engine's to check
        (it reads the files); a mismatch comes back as a 4xx answer."""
        if target.version < self.loaded_version:
            return (
                f"version {target.version} is lower than the loaded version "
                f"{self.loaded_version} (weights never go backwards)"
            )
        if target.lora_name is not None or target.transport == "filesystem":
            location = Path(target.location)
            if not location.is_dir():
                return f"weights directory {location} does not exist"
            missing = [f.name for f in target.files if not (location / f.name).is_file()]
            if missing:
                return f"{', '.join(missing)} missing from {location}"
        return None

    async def apply_with_retry(self, target: weights.WeightsPublished) -> None:
        """Apply `target` with retries, inside an `inference.weights_load` span that is a child
        of the trainer's publish (the record's trace context) when tracing is on."""
        from rlbus.obs import tracing

        headers = self.trace_headers.get(record_key(target))
        with tracing.span(
            tracing.WEIGHTS_LOAD,
            context=tracing.extract_context(headers) if headers else None,
            attributes={
                tracing.VERSION: target.version,
                tracing.REPLICA: self.replica_id,
                "rlbus.weights.transport": target.transport,
            },
        ):
            await self._apply_with_retry(target)

    async def _apply_with_retry(self, target: weights.WeightsPublished) -> None:
        if record_key(target) in self.rejected:
            return
        if reason := self.refusal(target):
            await self.reject(target, reason)
            return
        for attempt, delay in enumerate((*RETRY_DELAYS_S, None), start=1):
            try:
                await self.on_change(self.loaded_version, "updating_weights", self.served_lora)
                duration = await self.apply(target)
            except WeightRejected as error:
                await self.on_change(self.loaded_version, "ready", self.served_lora)
                await self.reject(target, str(error))
                return
            except (WeightApplyError, httpx.HTTPError) as error:
                reason = describe_http_error(error)
                log.warning(
                    "weights_failed", version=target.version, attempt=attempt, reason=reason
                )
                await self.publish_failed(target.version, reason)
                await self.on_change(self.loaded_version, "ready", self.served_lora)
                if delay is None or await self.newer_published(target, delay):
                    return
                continue
            self.loaded_version = target.version
            self.served_lora = target.lora_name
            record_weights_version(self.replica_id, target.version)
            await self.on_change(self.loaded_version, "ready", self.served_lora)
            await self.publish_applied(target.version, duration)
            log.info("weights_applied", version=target.version, duration_s=round(duration, 3))
            return

    async def reject(self, target: weights.WeightsPublished, reason: str) -> None:
        """One error line and one `weights.failed` event; the loaded version stays served."""
        self.rejected.add(record_key(target))
        log.error(
            "weights_rejected",
            version=target.version,
            serving_version=self.loaded_version,
            reason=reason,
        )
        await self.publish_failed(target.version, reason)

    async def newer_published(self, target: weights.WeightsPublished, delay_s: float) -> bool:
        """Sleep `delay_s` unless a newer version arrives first (then True: stop retrying)."""
        try:
            await asyncio.wait_for(self.new_version.wait(), delay_s)
        except TimeoutError:
            return False
        return self.latest is not None and self.latest.version > target.version

    async def apply(self, target: weights.WeightsPublished) -> float:
        """Make the engine load `target`; returns seconds taken."""
        start = time.perf_counter()
        log.info(
            "weights_apply_started",
            version=target.version,
            location=target.location,
            deadline_s=self.config.weights_apply_timeout_s,
        )
        if target.lora_name is not None:
            await self.post(
                "/load_lora_adapter",
                {
                    "lora_name": target.lora_name,
                    "lora_path": target.location,
                    "version": target.version,
                    "sha256": {f.name: f.sha256 for f in target.files},
                },
            )
        elif target.transport == "filesystem":
            await self.post(
                "/update_weights",
                {
                    "version": target.version,
                    "path": target.location,
                    "sha256": {f.name: f.sha256 for f in target.files},
                    "timeout_s": self.engine_deadline_s,
                },
            )
        else:
            await self.receive_broadcast(target)
        return time.perf_counter() - start

    @property
    def engine_deadline_s(self) -> float:
        """The engine's own deadline for a load: a bit less than ours, so that its answer (with
        the reason) arrives before our HTTP call gives up."""
        return 0.9 * self.config.weights_apply_timeout_s

    async def join_broadcast(self, target: weights.WeightsPublished) -> None:
        """Join the group generation at `target.location` with this replica's ranks (once per
        generation: a re-formed group has a new location). A record from an older trainer has
        no rank table: one replica, rank 1 of 2."""
        if target.location == self.broadcast_location:
            return
        if target.world_size == 0:
            rank_offset, world_size = 1, 2
        elif self.replica_id in target.ranks:
            rank_offset, world_size = target.ranks[self.replica_id], target.world_size
        else:  # registered after the trainer formed this generation: the next one includes us
            raise WeightRejected(
                f"replica {self.replica_id} is not in the broadcast group of version "
                f"{target.version} (it formed before this replica registered); the next "
                "version re-forms the group with it"
            )
        host, _, port = target.location.rpartition(":")
        await self.post(
            "/init_broadcaster",
            {
                "host": host,
                "port": int(port),
                "rank_offset": rank_offset,
                "world_size": world_size,
                "timeout_s": self.config.weight_broadcast.timeout_s,
            },
        )
        self.broadcast_location = target.location

    async def receive_broadcast(self, target: weights.WeightsPublished) -> None:
        """Join the group and receive `target`. The trainer sends a version once, so a failure
        is not retried: it is reported, the old version stays served, and the group is joined
        afresh for the next version (which the trainer sends to a new generation)."""
        try:
            await self.join_broadcast(target)
            await self.post(
                "/update_weights",
                {
                    "version": target.version,
                    "source": "broadcast",
                    "timeout_s": self.engine_deadline_s,
                },
            )
        except WeightApplyError as error:
            self.broadcast_location = None
            raise WeightRejected(
                f"nccl broadcast of version {target.version} failed ({error}); it is not resent: "
                "this replica waits for the next version"
            ) from error

    async def post(self, path: str, body: dict) -> dict:
        """POST to the engine's admin port within `weights_apply_timeout_s`; a 4xx answer is a
        refusal (WeightRejected), anything else but 200 may pass (WeightApplyError)."""
        timeout_s = self.config.weights_apply_timeout_s
        try:
            response = await self.http.post(self.engine_url + path, json=body, timeout=timeout_s)
        except httpx.TimeoutException as error:
            raise WeightApplyError(f"no answer from {path} within {timeout_s:g} s") from error
        if 400 <= response.status_code < 500:
            raise WeightRejected(f"{path} answered {response.status_code}: {response.text[:500]}")
        if response.status_code != 200:
            raise WeightApplyError(f"{path} answered {response.status_code}: {response.text[:500]}")
        return response.json()

    async def publish_applied(self, version: int, duration_s: float) -> None:
        message = weights.WeightsApplied(
            version=version, replica_id=self.replica_id, duration_s=duration_s
        )
        await self.publish_event(
            self.bus.subjects.weights_applied,
            message,
            msg_id=f"applied-{self.replica_id}-{version}-{time.time_ns()}",
        )

    async def publish_failed(self, version: int, reason: str) -> None:
        message = weights.WeightsFailed(version=version, replica_id=self.replica_id, reason=reason)
        await self.publish_event(self.bus.subjects.weights_failed, message)

    async def publish_event(self, subject: str, message, msg_id: str | None = None) -> None:
        """Publish an event; a bus outage loses the event (with a line), not the replica."""
        try:
            await self.bus.publish(subject, weights.encoder.encode(message), msg_id=msg_id)
        except Exception as error:
            log.warning("weights_event_unpublished", subject=subject, error=repr(error))


def record_key(target: weights.WeightsPublished) -> tuple:
    """What tells two weights records apart (a version may be published again, e.g. by a
    trainer that resumed from a checkpoint)."""
    return (target.version, target.location, target.published_at)


def describe_http_error(error: Exception) -> str:
    return str(error) or type(error).__name__


async def hold_lease(bus: Bus, config: InferenceConfig, state: dict, stop: asyncio.Event) -> None:
    """Keep this replica's registry entry alive until `stop`; re-acquire it whenever it is lost.
    A bus that does not answer (an outage) is retried with a line each time, never fatal; only
    another live holder of the same replica id (LeaseHeld after `2 * lease_ttl_s`) ends it."""
    key = replica_id(config)
    attempt = 0
    while not stop.is_set():
        info = make_replica_info(
            config, version=state["version"], status=state["status"], model=state["model"]
        )
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
            state["lease"] = lease
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
            state["lease"] = None
            await lease.release()
    log.info("replica_withdrawn", replica_id=key)


async def wait_or_stop(stop: asyncio.Event, delay_s: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), delay_s)
    except TimeoutError:
        pass


async def run_replica_tasks(
    config: InferenceConfig, service: ServiceState, token: str | None = None
) -> None:
    """Load the current weights, then lease + weight agent until the service ends; then withdraw
    the lease and close the bus. The agent sends the admin `token` with every call."""
    stop = service.stop_requested
    bus = await Bus.connect(
        config.bus,
        run_id=run_id_of(config.bus.run_id, run_dir=config.run_dir),
        storage_dir=config.run_dir,
        name=f"inference-{replica_id(config)}",
    )
    state = {"version": 0, "status": "ready", "lease": None, "model": None}

    async def on_change(version: int, status: str, model: str | None) -> None:
        state["version"], state["status"], state["model"] = version, status, model
        if (lease := state["lease"]) is not None and lease.held:
            info = make_replica_info(config, version=version, status=status, model=model)
            try:
                await lease.update(replicas.encoder.encode(info))
            except Exception as error:  # the heartbeat carries the new value once the bus is back
                log.warning("replica_update_failed", status=status, error=repr(error))

    lifecycle = Lifecycle(bus, replica_id(config))
    final, stopped_reason = "stopped", "lease ended"
    try:
        public, _ = advertised_urls(config)
        await lifecycle.publish("started", reason=f"serving {public}")
        headers = {"Authorization": f"Bearer {token}"} if token else None
        http_client = httpx.AsyncClient(headers=headers, transport=timed_transport())
        async with http_client as http, TaskSupervisor() as tasks:
            agent = WeightAgent(bus, config, http, on_change)
            await agent.load_current()  # before registering: never advertise stale weights
            lease = tasks.spawn("replica_lease", hold_lease(bus, config, state, stop))
            agent_task = tasks.spawn("weight_agent", agent.run())
            if config.exit_when_finished:
                tasks.spawn("finish_watch", drain_when_finished(bus, service))
            await lifecycle.publish("ready", reason=f"weights version {agent.loaded_version}")
            await tasks.wait(stop, lease)
            if service.mode == "draining":
                await lifecycle.publish("draining", reason=service.reason)
            agent_task.cancel()
            await lease  # withdraws the lease: stop is set or the lease ended by itself
            stopped_reason = service.reason or stopped_reason
            if stopped_reason.startswith(processes.FAILED_PREFIX):
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


class Lifecycle:
    """The replica's lifecycle events (`events.lifecycle.inference`, instance = replica id):
    started (connected, `reason` = its public URL), ready (registered), draining, stopped,
    failed. Weight loads have their own `weights.applied` events. A bus outage loses an event
    with a line, never the replica."""

    def __init__(self, bus: Bus, instance_id: str):
        self.bus, self.instance_id = bus, instance_id

    async def publish(self, state: str, reason: str | None = None) -> None:
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
