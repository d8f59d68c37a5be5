"""The state store: what the coordinator must remember across a restart, and the accounting of tasks.

State lives in the state KV bucket under `STATE_KEY` as JSON (`CoordinatorState`): the next step
to batch, the data cursor, the outstanding tasks (published, not yet batched or dropped), the
cursors of a task publish in progress (the write-ahead cursors: saved before the publish and
republished on restart, deduplicated by message id), the accounting of every issued task:
`cursor - skipped == trained + sum(dropped.values()) + len(outstanding)` after every save
(`skipped`: cursors the difficulty filter passed over), and the difficulty filter's history
(`prompts`, difficulty.py).

The batches stream is the truth for which steps exist: `load` adopts any batch already stored at
`next_step` (a crash between the batch publish and the state save) and marks its tasks trained.

Reads and saves that fail with a transient bus error are retried for `bus.publish_retry_s`
(`coordinator_bus_retry` lines), so a short NATS outage is ridden out. Every state write goes
through `save`, so fencing those writes (an epoch, a lease revision) is a change to this module.
"""

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import structlog

from rlbus.bus.client import Bus
from rlbus.bus.core import retry_transient
from rlbus.bus.errors import PoisonBatch
from rlbus.bus.kv import KV
from rlbus_orchestrator.metrics import count_dropped_task

log = structlog.get_logger()

T = TypeVar("T")

STATE_KEY = "orchestrator"
DROP_REASONS = ("invalid", "stale", "zero_advantage", "error", "timeout")
"""Why an issued training task ended without being trained (counted in the state and metrics).
`error` and `timeout` also end a group whose failed episodes left fewer than min_group_size."""
EPISODE_DROP_REASONS = ("error", "timeout")
"""Why an episode was left out of its group (`Rollout.dropped`): it raised, or it ran past its
deadline (docs/orchestrator.md, "Partial groups")."""
BUS_RETRY_MAX_DELAY_S = 1.0


@dataclass
class CoordinatorState:
    """What survives a restart (JSON in the state KV bucket)."""

    next_step: int = 1
    cursor: int = 0
    outstanding: dict[str, int] = field(default_factory=dict)
    """task_id -> data cursor, for tasks published and not yet batched or dropped."""
    publishing: list[int] = field(default_factory=list)
    """Cursors being published right now (republished after a crash)."""
    trained: int = 0
    """Training tasks whose group is in a stored batch."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Training tasks dropped, by reason (DROP_REASONS)."""
    skipped: int = 0
    """Cursors passed over, never issued: their prompts were skipped (difficulty.py)."""
    prompts: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    """The difficulty filter's history: env id -> example index -> [streak, skip_until]
    (difficulty.py)."""

    def num_issued(self) -> int:
        """Training tasks issued: the cursors so far, less those passed over."""
        return self.cursor - self.skipped

    def accounting(self) -> dict[str, int]:
        """Every issued task is trained, dropped (by reason) or outstanding; `unaccounted` is 0.
        `skipped` cursors were never issued."""
        num_dropped = sum(self.dropped.values())
        issued = self.num_issued()
        return {
            "issued": issued,
            "skipped": self.skipped,
            "trained": self.trained,
            "dropped": num_dropped,
            "outstanding": len(self.outstanding),
            "unaccounted": issued - self.trained - num_dropped - len(self.outstanding),
        }

    def encode(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @classmethod
    def decode(cls, data: bytes) -> "CoordinatorState":
        return cls(**json.loads(data))


async def read_saved_state(bus: Bus) -> CoordinatorState | None:
    """The coordinator state last saved on the bus (None before the first save), e.g. for
    `state.accounting()` in a test or a tool."""
    entry = await bus.kv(bus.subjects.state_bucket).get(STATE_KEY)
    return CoordinatorState.decode(entry.value) if entry else None


class StateStore:
    """The coordinator's `CoordinatorState` in memory, its saves and loads, and the task ledger.

    Callers hold the coordinator's lock around a change and the `save` that follows it."""

    def __init__(self, bus: Bus, *, retry_s: float) -> None:
        self.bus = bus
        self.retry_s = retry_s
        """How long a read or save rides out a transient bus error (`bus.publish_retry_s`)."""
        self.state = CoordinatorState()

    def kv(self) -> KV:
        return self.bus.kv(self.bus.subjects.state_bucket)

    async def retry_bus(self, what: str, operation: Callable[[], Awaitable[T]]) -> T:
        """`await operation()`, retried on transient bus errors for `retry_s`."""
        return await retry_transient(
            what,
            operation,
            within_s=self.retry_s,
            event="coordinator_bus_retry",
            max_delay_s=BUS_RETRY_MAX_DELAY_S,
        )

    async def save(self) -> None:
        data = self.state.encode()
        await self.retry_bus("save_state", lambda: self.kv().put(STATE_KEY, data))

    async def load(self) -> CoordinatorState:
        """The saved state, with the batches stored after it adopted (and saved)."""
        entry = await self.retry_bus("read_state", lambda: self.kv().get(STATE_KEY))
        self.state = CoordinatorState.decode(entry.value) if entry else CoordinatorState()
        await self.adopt_published_batches()
        return self.state

    async def adopt_published_batches(self) -> None:
        """Steps published before a crash but not recorded in the state: mark their tasks consumed.
        A stored step that is not a batch (the trainer quarantines and skips it) still counts as
        published; its tasks, unknown, stay outstanding until `task_timeout_s` drops them."""
        while True:
            try:
                batch = await self.bus.step_log.read(self.state.next_step)
            except PoisonBatch as poison:
                log.error(
                    "coordinator_stored_step_unreadable", step=poison.step, reason=poison.reason
                )
                self.state.next_step += 1
                continue
            if batch is None:
                break
            self.record_trained(batch.task_ids)
            log.warning("coordinator_adopted_published_batch", step=batch.step)
            self.state.next_step += 1
        await self.save()

    # ---- the task ledger (in memory; the caller saves) ------------------------------------

    def record_issued(self, task_ids: dict[str, int], next_cursor: int | None = None) -> None:
        """New tasks (task_id -> cursor), outstanding from now on; the cursor moves past them, to
        `next_cursor` when cursors between were passed over (counted as skipped)."""
        self.state.outstanding.update(task_ids)
        end = self.state.cursor + len(task_ids) if next_cursor is None else next_cursor
        self.state.skipped += end - self.state.cursor - len(task_ids)
        self.state.cursor = end

    def record_trained(self, task_ids: list[str]) -> None:
        """Tasks whose groups are in a stored batch (ids no longer outstanding are skipped)."""
        for task_id in task_ids:
            if self.state.outstanding.pop(task_id, None) is not None:
                self.state.trained += 1

    def record_dropped(self, task_id: str, reason: str, env_id: str = "") -> bool:
        """End an outstanding training task (of environment `env_id`) without training it,
        counted under `reason`; False when it already ended (batched or dropped: counted then)."""
        if self.state.outstanding.pop(task_id, None) is None:
            return False
        self.state.dropped[reason] = self.state.dropped.get(reason, 0) + 1
        count_dropped_task(reason, env_id)  # Prometheus (rlbus.obs.metrics)
        return True

    def is_outstanding(self, task_id: str) -> bool:
        return task_id in self.state.outstanding

    async def save_write_ahead(self, cursors: list[int]) -> None:
        """Save before publishing the tasks of `cursors`: a crash mid-publish republishes them."""
        self.state.publishing = cursors
        await self.save()

    async def save_published(self) -> None:
        """Save once the write-ahead cursors' tasks are all on the bus."""
        self.state.publishing = []
        await self.save()
