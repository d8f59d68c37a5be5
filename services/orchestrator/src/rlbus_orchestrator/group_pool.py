"""The group pool: accepted rollouts waiting for a batch, first in, first out.

A pooled group is a rollout with its advantages and its delivery, still unacked (the consumer
heartbeats it): it is acked only once the batch that holds it is stored, and a coordinator that
dies before that gets it redelivered. The pool answers two questions for the batcher: which groups
make the next batch (`next_batch_groups`: the oldest groups reaching `batch_size` samples, or
`token_budget` tokens), and which became too old to train the step being built (`take_stale`).
Groups are never split: with partial groups (some episodes left out) or environments of different
group sizes a step may hold a few samples more than `batch_size` (less than its last group).
"""

from dataclasses import dataclass

from rlbus.bus.consumer import Delivery
from rlbus.wire.rollouts import Rollout
from rlbus_orchestrator.staleness import has_stale_sample


@dataclass
class PooledGroup:
    rollout: Rollout
    delivery: Delivery[Rollout]
    advantages: list[float]

    @property
    def task_id(self) -> str:
        return self.rollout.task_id

    def num_tokens(self) -> int:
        return sum(
            len(s.prompt_token_ids) + len(s.completion_token_ids) for s in self.rollout.samples
        )


class GroupPool:
    """Pooled groups by task id, in arrival order."""

    def __init__(self) -> None:
        self.groups: dict[str, PooledGroup] = {}

    def __len__(self) -> int:
        return len(self.groups)

    def __contains__(self, task_id: str) -> bool:
        return task_id in self.groups

    def add(self, group: PooledGroup) -> None:
        self.groups[group.task_id] = group

    def pop(self, task_id: str) -> PooledGroup | None:
        return self.groups.pop(task_id, None)

    def refresh_delivery(self, delivery: Delivery[Rollout]) -> None:
        """A pooled rollout redelivered (its ack wait passed): keep the newest handle to ack."""
        self.groups[delivery.data.task_id].delivery = delivery

    def num_samples(self) -> int:
        return sum(len(g.rollout.samples) for g in self.groups.values())

    def next_batch_groups(
        self, *, batch_size: int, token_budget: int | None
    ) -> list[PooledGroup] | None:
        """The groups of the next batch (FIFO), or None if there are not enough yet: samples up
        to `batch_size`, or tokens up to `token_budget` when one is set."""
        chosen, num_samples, num_tokens = [], 0, 0
        for group in self.groups.values():
            chosen.append(group)
            num_samples += len(group.rollout.samples)
            num_tokens += group.num_tokens()
            if token_budget is not None and num_tokens >= token_budget:
                return chosen
            if token_budget is None and num_samples >= batch_size:
                return chosen
        return None

    def take_stale(self, step: int, max_off_policy_steps: int) -> list[PooledGroup]:
        """Remove and return the groups that waited until they became too old for `step`."""
        stale = [
            g
            for g in self.groups.values()
            if has_stale_sample(step, g.rollout.samples, max_off_policy_steps)
        ]
        for group in stale:
            del self.groups[group.task_id]
        return stale

    def remove(self, groups: list[PooledGroup]) -> None:
        for group in groups:
            del self.groups[group.task_id]
