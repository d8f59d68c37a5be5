"""Factories for the coordinator's unit tests: an in-memory stand-in for the bus, deliveries,
rollouts, and each part built on them (the real bus is in tests/integration/orchestrator)."""

import asyncio
from typing import Any

from rlbus.configs.orchestrator import OrchestratorConfig
from rlbus.wire.rollouts import Rollout, RolloutSample
from rlbus.wire.subjects import RunSubjects
from rlbus_orchestrator.coordinator import Coordinator
from rlbus_orchestrator.group_pool import GroupPool, PooledGroup
from rlbus_orchestrator.state_store import CoordinatorState, StateStore
from rlbus_orchestrator.step_metrics import StepStats
from rlbus_orchestrator.weights_watch import WeightsWatcher


class FakeBus:
    def __init__(self) -> None:
        self.subjects = RunSubjects("unit")
        self.published: list[tuple[str, Any, str | None]] = []
        self.dead: list[tuple[str, str, str]] = []

    async def publish(self, subject: str, message: Any, msg_id: str | None = None) -> None:
        self.published.append((subject, message, msg_id))

    async def dead_letter(
        self, stream: str, subject: str, data: bytes, headers: dict, reason: str
    ) -> None:
        self.dead.append((stream, subject, reason))

    def published_to(self, subject: str) -> list[Any]:
        return [message for subj, message, _ in self.published if subj == subject]


class FakeMsg:
    subject = "rlbus.unit.rollouts"
    data = b"raw"
    headers = {"Nats-Msg-Id": "m"}


class FakeDelivery:
    def __init__(self, rollout: Rollout | None) -> None:
        self.data = rollout
        self.headers: dict[str, str] = {}
        self.msg = FakeMsg()
        self.acked = False
        self.termed = False

    async def ack(self) -> None:
        self.acked = True

    async def term(self, reason: str | None = None) -> None:
        self.termed = True


def make_rollout(
    task_id: str, rewards: list[float], version: int = 0, num_completion: int = 3
) -> Rollout:
    samples = [
        RolloutSample(
            prompt_token_ids=[1, 2],
            completion_token_ids=[3] * num_completion,
            completion_logprobs=[-0.1] * num_completion,
            completion_mask=[1] * num_completion,
            reward=r,
            policy_version=version,
        )
        for r in rewards
    ]
    return Rollout(task_id=task_id, step=1, env_id="reverse-text", samples=samples)


def make_pooled(task_id: str, rewards: list[float], version: int = 0) -> PooledGroup:
    rollout = make_rollout(task_id, rewards, version=version)
    return PooledGroup(rollout, FakeDelivery(rollout), [0.0] * len(rewards))


def make_config(**overrides: Any) -> OrchestratorConfig:
    fields = dict(
        batch_size=4,
        group_size=2,
        async_level=1,
        max_off_policy_steps=1,
        seq_len=64,
        num_train_ranks=2,
    )
    return OrchestratorConfig(**(fields | overrides))


def count_saves(store: StateStore) -> StateStore:
    """`store`, its saves recorded in `store.saved` instead of written: (the state saved, how
    many messages were published before the save)."""
    store.saved = []

    async def save() -> None:
        snapshot = CoordinatorState.decode(store.state.encode())
        store.saved.append((snapshot, len(store.bus.published)))

    store.save = save
    return store


def make_store(bus: Any = None) -> StateStore:
    return count_saves(StateStore(bus or FakeBus(), retry_s=1.0))


def make_weights(config: OrchestratorConfig, store: StateStore, **kw: Any) -> WeightsWatcher:
    changed = kw.pop("changed", asyncio.Event())
    stats = kw.pop("stats", StepStats())
    return WeightsWatcher(
        FakeBus(), config, store=store, stats=stats, on_new_version=changed.set, **kw
    )


def make_parts(**overrides: Any) -> tuple[OrchestratorConfig, StateStore, GroupPool, StepStats]:
    return make_config(**overrides), make_store(), GroupPool(), StepStats()


def make_coordinator(**overrides: Any) -> Coordinator:
    coordinator = Coordinator(FakeBus(), make_config(**overrides))
    count_saves(coordinator.store)
    return coordinator
