"""Coordinator decisions with an in-memory stand-in for the bus (the real bus is in integration tests)."""

import asyncio
from importlib.metadata import EntryPoint

import pytest

from rlbus.configs.orchestrator import OrchestratorConfig
from rlbus.wire import batches as batches_wire
from rlbus.wire.rollouts import Rollout, RolloutSample
from rlbus.wire.subjects import RunSubjects
from rlbus_orchestrator.coordinator import Coordinator, PooledGroup
from rlbus_orchestrator.envs import ReverseTextEnv, load_environment, registry


class FakeBus:
    def __init__(self):
        self.subjects = RunSubjects("unit")
        self.published = []
        self.dead = []

    async def publish(self, subject, message, msg_id=None):
        self.published.append((subject, message, msg_id))

    async def dead_letter(self, stream, subject, data, headers, reason):
        self.dead.append((stream, subject, reason))


class FakeMsg:
    subject = "rlbus.unit.rollouts"
    data = b"raw"
    headers = {"Nats-Msg-Id": "m"}


class FakeDelivery:
    def __init__(self, rollout):
        self.data = rollout
        self.headers = {}
        self.msg = FakeMsg()
        self.acked = False
        self.termed = False

    async def ack(self):
        self.acked = True

    async def term(self, reason=None):
        self.termed = True


def make_rollout(task_id, rewards, version=0, num_completion=3):
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


def make_coordinator(**overrides):
    fields = dict(
        batch_size=4,
        group_size=2,
        async_level=1,
        max_off_policy_steps=1,
        seq_len=64,
        num_train_ranks=2,
    )
    coordinator = Coordinator(FakeBus(), OrchestratorConfig(**(fields | overrides)))

    async def save_state():
        pass

    coordinator.save_state = save_state
    return coordinator


def test_async_level_bounds_how_many_tasks_are_issued():
    sync = make_coordinator(async_level=0)
    assert sync.max_step() == 1 and sync.num_tasks_to_issue() == 2
    ahead = make_coordinator(async_level=2)
    assert ahead.max_step() == 3 and ahead.num_tasks_to_issue() == 6
    ahead.state.next_step = 4
    assert ahead.num_tasks_to_issue() == 0  # waits for newer weights
    ahead.applied_version = 1
    assert ahead.num_tasks_to_issue() == 2


def test_tasks_in_flight_and_pooled_samples_count_toward_the_target():
    c = make_coordinator(async_level=0)
    c.state.outstanding = {"train-0": 0, "train-1": 1}
    assert c.num_tasks_to_issue() == 0
    c.pool["train-0"] = PooledGroup(
        make_rollout("train-0", [0.0, 1.0]), FakeDelivery(None), [-0.5, 0.5]
    )
    assert c.num_tasks_to_issue() == 0
    del c.state.outstanding["train-1"]  # dropped: a replacement is due
    assert c.num_tasks_to_issue() == 1


def test_stale_error_and_flat_groups_are_dropped_with_a_reason():
    c = make_coordinator()
    c.state.next_step = 4
    assert c.drop_reason(make_rollout("t", [0.0, 1.0], version=1)) == "stale"
    assert c.drop_reason(make_rollout("t", [0.0, 1.0], version=2)) is None
    assert c.drop_reason(make_rollout("t", [0.5, 0.5], version=3)) == "zero_advantage"
    assert c.drop_reason(Rollout(task_id="t", step=1, env_id="x", error="boom")) == "error"
    assert (
        make_coordinator(filter_zero_advantage=False).drop_reason(make_rollout("t", [0.5, 0.5]))
        is None
    )


def test_full_pool_becomes_one_batch_and_acks_after_publishing():
    c = make_coordinator()
    deliveries = []

    async def feed():
        for i, rewards in enumerate([[0.0, 1.0], [0.3, 0.3], [0.2, 0.6]]):
            task_id = f"train-{i}"
            c.state.outstanding[task_id] = i
            c.state.cursor = i + 1
            d = FakeDelivery(make_rollout(task_id, rewards))
            deliveries.append(d)
            await c.on_rollout(d)

    asyncio.run(feed())
    subject, batch, msg_id = next(p for p in c.bus.published if p[0] == c.bus.subjects.batch(1))
    assert msg_id == "batch-1" and batch.step == 1 and batch.task_ids == ["train-0", "train-2"]
    assert batch.metrics["dropped/zero_advantage"] == 1
    # the flat group was sampled, so it counts in the sampled mean, not in the trained one
    assert batch.metrics["reward/mean"] == pytest.approx((0.0 + 1.0 + 0.3 + 0.3 + 0.2 + 0.6) / 6)
    assert batch.metrics["reward/trained_mean"] == pytest.approx(0.45)
    assert batch.metrics["reward/num_samples"] == 6
    assert len(batch.micro_batches) == 2
    assert all(d.acked for d in deliveries)
    assert c.state.next_step == 2 and c.state.outstanding == {}
    assert batches_wire.decoder.decode(batches_wire.encoder.encode(batch)).num_samples == 4


def test_duplicate_rollout_of_a_batched_task_is_acked_and_ignored():
    c = make_coordinator()
    c.state.cursor = 10
    d = FakeDelivery(make_rollout("train-9", [0.0, 1.0]))
    asyncio.run(c.on_rollout(d))
    assert d.acked and not c.pool and not c.bus.dead


def test_token_budget_closes_a_batch_by_tokens():
    c = make_coordinator(token_budget=10, batch_size=100)
    c.pool["a"] = PooledGroup(make_rollout("a", [0, 1]), FakeDelivery(None), [0, 0])  # 10 tokens
    c.pool["b"] = PooledGroup(make_rollout("b", [0, 1]), FakeDelivery(None), [0, 0])
    assert [g.rollout.task_id for g in c.batch_ready()] == ["a"]


def test_eval_rollouts_are_aggregated_into_eval_metrics():
    c = make_coordinator(eval={"interval": 1, "num_examples": 2})
    asyncio.run(c.publish_eval_tasks(3))
    assert len([p for p in c.bus.published if p[0] == c.bus.subjects.tasks]) == 2
    for i, reward in enumerate([0.2, 0.6]):
        asyncio.run(c.on_rollout(FakeDelivery(make_rollout(f"eval-3-{i}", [reward]))))
    assert c.eval_results[3]["eval/reward/mean"] == 0.4


def test_entry_point_environment_is_found_by_id(monkeypatch):
    ep = EntryPoint(
        name="my-env",
        value="rlbus_orchestrator.envs.reverse_text:ReverseTextEnv",
        group=registry.ENTRY_POINT_GROUP,
    )
    monkeypatch.setattr(
        registry, "entry_points", lambda group: [ep] if group == registry.ENTRY_POINT_GROUP else []
    )
    env = load_environment("my-env", {"min_len": 3, "max_len": 3})
    assert isinstance(env, ReverseTextEnv) and len(env.text("train", 0)) == 3


def test_pooled_group_that_became_stale_is_dropped_before_batching():
    c = make_coordinator(max_off_policy_steps=0, batch_size=2)
    old = FakeDelivery(make_rollout("train-0", [0.0, 1.0], version=0))
    c.state.outstanding = {"train-0": 0}
    c.pool["train-0"] = PooledGroup(old.data, old, [-0.5, 0.5])
    c.state.next_step, c.applied_version = 3, 2
    asyncio.run(c.build_batches())
    assert not c.pool and old.acked and c.stats.dropped["stale"] == 1
    assert not [p for p in c.bus.published if p[0].startswith(c.bus.subjects.prefix + ".batches")]


def test_poison_rollout_is_quarantined_dropped_as_invalid_and_batching_goes_on():
    c = make_coordinator()
    c.state.cursor = 3
    c.state.outstanding = {"train-0": 0, "train-1": 1, "train-2": 2}
    poison = make_rollout("train-1", [0.0, 1.0])
    poison.samples[0].completion_logprobs = [-0.1]  # 3 tokens, 1 logprob: packing would fail
    bad = FakeDelivery(poison)
    good = [FakeDelivery(make_rollout(t, [0.0, 1.0])) for t in ("train-0", "train-2")]

    async def feed():
        await c.on_rollout(good[0])
        await c.on_rollout(bad)
        await c.on_rollout(good[1])

    asyncio.run(feed())
    assert bad.termed and not bad.acked
    [(stream, subject, reason)] = c.bus.dead
    assert stream == c.bus.subjects.rollouts_stream and "3 completion tokens, 1 logprobs" in reason
    batch = next(m for subj, m, _ in c.bus.published if subj == c.bus.subjects.batch(1))
    assert batch.task_ids == ["train-0", "train-2"] and batch.metrics["tasks/dropped/invalid"] == 1
    assert c.state.dropped == {"invalid": 1} and c.state.accounting()["unaccounted"] == 0
    assert c.state.accounting() == {
        "issued": 3,
        "trained": 2,
        "dropped": 1,
        "outstanding": 0,
        "unaccounted": 0,
    }
    assert c.num_tasks_to_issue() > 0  # the dropped group is replaced by a new task


def test_rollout_for_a_task_never_issued_or_with_a_garbage_id_is_quarantined():
    c = make_coordinator()
    c.state.cursor = 2
    for task_id in ("train-7", "nonsense", "eval-x-1"):
        d = FakeDelivery(make_rollout(task_id, [0.0, 1.0]))
        asyncio.run(c.on_rollout(d))
        assert d.termed and not c.pool
    assert len(c.bus.dead) == 3 and c.state.dropped == {}


def test_a_task_whose_rollout_never_comes_is_dropped_as_timeout_and_replaced(monkeypatch):
    from rlbus_orchestrator import coordinator as coordinator_module

    now = [1000.0]
    monkeypatch.setattr(coordinator_module.time, "monotonic", lambda: now[0])
    c = make_coordinator(async_level=0, task_timeout_s=60.0)
    c.state.cursor = 2
    c.state.outstanding = {"train-0": 0, "train-1": 1}
    c.issued_at = {"train-0": 1000.0, "train-1": 1000.0}
    c.pool["train-0"] = PooledGroup(
        make_rollout("train-0", [0.0, 1.0]), FakeDelivery(None), [-0.5, 0.5]
    )
    now[0] = 1059.0
    assert asyncio.run(c.expire_overdue_tasks()) == 0
    now[0] = 1061.0
    assert asyncio.run(c.expire_overdue_tasks()) == 1  # train-1; train-0 came back (pooled)
    assert c.state.outstanding == {"train-0": 0} and c.state.dropped == {"timeout": 1}
    assert c.num_tasks_to_issue() == 1 and c.state.accounting()["unaccounted"] == 0
    late = FakeDelivery(make_rollout("train-1", [0.0, 1.0]))
    asyncio.run(c.on_rollout(late))
    assert late.acked and "train-1" not in c.pool  # a late rollout is ignored


def test_state_save_is_retried_through_a_transient_bus_error_and_fails_past_the_deadline():
    from rlbus.bus.core import RETRYABLE_PUBLISH_ERRORS

    transient = RETRYABLE_PUBLISH_ERRORS[0]
    c = make_coordinator(bus={"publish_retry_s": 1.0})
    calls = []

    async def flaky(fail_times):
        calls.append(1)
        if len(calls) <= fail_times:
            raise transient()
        return "saved"

    assert asyncio.run(c.retry_bus("save_state", lambda: flaky(2))) == "saved"
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(transient):  # past bus.publish_retry_s: the task fails (exit 1, one line)
        asyncio.run(c.retry_bus("save_state", lambda: flaky(1000)))
    assert 3 <= len(calls) < 20


def test_backoff_max_below_backoff_is_one_clear_error():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="http.backoff_max_s"):
        OrchestratorConfig(http={"backoff_s": 10.0, "backoff_max_s": 1.0})
