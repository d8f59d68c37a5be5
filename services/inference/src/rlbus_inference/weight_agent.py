"""The weight agent of a replica: every weights version published on the bus, applied to its engine.

    WeightAgent
      ├─ watch   the weights KV key `latest` -> remembers the newest WeightsPublished
      │          (reopened after a bus error, and every WATCH_REFRESH_S)
      └─ apply   newest version != loaded: refused once (WeightsFailed, never retried) when it can
                 never apply (lower than loaded, directory missing, engine 4xx); else the engine
                 loads it (EngineWeightLoader) within weights_apply_timeout_s; then WeightsApplied
                 and the lease updated (`on_change`). A failure that may pass (5xx, no answer) is
                 retried with backoff (1, 2, 4, 8 s), giving up on that version early when a
                 newer one is published.

    EngineWeightLoader   the admin endpoints of the replica's own engine, over HTTP, exactly as
                         an operator would call them (the engine process stays free of NATS):
                         /update_weights (filesystem: path + sha256), /init_broadcaster once per
                         group generation then /update_weights source=broadcast (nccl; a failed
                         broadcast is reported, not retried), or /load_lora_adapter.

`rlbus_inference.replica` runs the agent next to the replica's lease.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import structlog

from rlbus.bus import Bus
from rlbus.bus.kv import KV
from rlbus.configs.inference import InferenceConfig
from rlbus.lifecycle import TaskSupervisor
from rlbus.obs import tracing
from rlbus.wire import weights
from rlbus.wire.subjects import WEIGHTS_LATEST_KEY
from rlbus_inference import engine_process
from rlbus_inference.metrics import record_weights_version

log = structlog.get_logger()

RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0)
CURRENT_READ_S = 10.0
"""Deadline of reading the current weights record at start-up."""
WATCH_REFRESH_S = 15.0
WATCH_RETRY_S = 2.0

OnChange = Callable[[int, str, str | None], Awaitable[None]]
"""async (loaded version, status, served LoRA name or None) -> None: updates the lease."""
RecordKey = tuple[int, str, float]
"""(version, location, published_at): what tells two weights records apart (`record_key`)."""


class WeightApplyError(RuntimeError):
    """The engine failed a weights version for a reason that may pass (5xx, no answer): retried."""


class WeightRejected(RuntimeError):
    """A weights record that can never be applied (directory missing, checksum wrong, version
    lower than the loaded one, or the engine answered 4xx): reported once, never retried."""


class WeightAgent:
    """Applies every new weights version published on the bus to this replica's engine."""

    def __init__(
        self,
        bus: Bus,
        config: InferenceConfig,
        http: httpx.AsyncClient,
        on_change: OnChange,
        *,
        replica_id: str,
    ) -> None:
        self.bus = bus
        self.on_change = on_change
        self.served_lora: str | None = None
        """The LoRA adapter name loaded last (None: the base model or full weights): the replica
        advertises it as its model, so rollouts sample from the adapter."""
        self.replica_id = replica_id
        self.loader = EngineWeightLoader(http, config, replica_id=replica_id)
        self.loaded_version = 0
        record_weights_version(self.replica_id, 0)  # Prometheus (rlbus.obs.metrics)
        self.latest: weights.WeightsPublished | None = None
        self.new_version = asyncio.Event()
        self.rejected: set[RecordKey] = set()
        """Records refused or given up for good (`record_key`): one delivered again (the watch
        is reopened every WATCH_REFRESH_S) is not tried or reported again; the same version
        published again as a new record is."""
        self.undecodable: set[int | None] = set()
        """Revisions of `latest` that did not decode (logged once each)."""
        self.trace_headers: dict[RecordKey, dict[str, str]] = {}
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

    async def remember_trace(
        self, kv: KV, revision: int | None, target: weights.WeightsPublished | None
    ) -> None:
        """Keep the trace context stored with record `revision` (one read, only when tracing)."""
        if target is None or revision is None or not tracing.enabled():
            return
        if record_key(target) in self.trace_headers:
            return
        try:
            self.trace_headers[record_key(target)] = await kv.headers_of(revision)
        except Exception as error:  # a trace is not worth a failed weight load
            log.debug("weights_trace_unread", revision=revision, error=repr(error))
        for key in list(self.trace_headers)[:-4]:  # the newest few records are enough
            del self.trace_headers[key]

    def offer(self, target: weights.WeightsPublished | None) -> None:
        """Remember `target` as the newest record and wake the apply loop."""
        if target is not None:
            self.latest = target
            self.new_version.set()

    async def apply_loop(self) -> None:
        """Apply the newest offered record whenever one arrives (until cancelled)."""
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
                duration = await self.loader.apply(target)
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

    async def publish_applied(self, version: int, duration_s: float) -> None:
        """`weights.applied`: this replica serves `version` now."""
        message = weights.WeightsApplied(
            version=version, replica_id=self.replica_id, duration_s=duration_s
        )
        await self.publish_event(
            self.bus.subjects.weights_applied,
            message,
            msg_id=f"applied-{self.replica_id}-{version}-{time.time_ns()}",
        )

    async def publish_failed(self, version: int, reason: str) -> None:
        """`weights.failed`: `version` did not load here, and why."""
        message = weights.WeightsFailed(version=version, replica_id=self.replica_id, reason=reason)
        await self.publish_event(self.bus.subjects.weights_failed, message)

    async def publish_event(
        self, subject: str, message: msgspec.Struct, msg_id: str | None = None
    ) -> None:
        """Publish an event; a bus outage loses the event (with a line), not the replica."""
        try:
            await self.bus.publish(subject, weights.encoder.encode(message), msg_id=msg_id)
        except Exception as error:
            log.warning("weights_event_unpublished", subject=subject, error=repr(error))


class EngineWeightLoader:
    """Has the replica's engine load a weights record through its admin endpoints (HTTP)."""

    def __init__(
        self, http: httpx.AsyncClient, config: InferenceConfig, *, replica_id: str
    ) -> None:
        self.http = http
        self.config = config
        self.replica_id = replica_id
        self.engine_url = engine_process.engine_url(config)
        self.broadcast_location: str | None = None
        """The broadcast group generation (host:port) this replica joined last."""

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

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
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


def record_key(target: weights.WeightsPublished) -> RecordKey:
    """What tells two weights records apart (a version may be published again, e.g. by a
    trainer that resumed from a checkpoint)."""
    return (target.version, target.location, target.published_at)


def describe_http_error(error: Exception) -> str:
    """The error's message, or its type when it has none (httpx timeouts)."""
    return str(error) or type(error).__name__
