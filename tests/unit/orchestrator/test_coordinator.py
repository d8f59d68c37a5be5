"""The coordinator's wiring: rollouts through intake, pool, batcher and eval runner together, with
an in-memory stand-in for the bus (each part alone: test_<part>.py; the real bus: integration)."""

import asyncio

import pytest
from coordinator_fakes import FakeDelivery, make_coordinator, make_pooled, make_rollout

from rlbus.configs.orchestrator import OrchestratorConfig
from rlbus.wire import batches as batches_wire
from rlbus_orchestrator import task_issue


def test_async_level_bounds_how_many_tasks_are_issued():
    sync = make_coordinator(async_level=0)
    assert sync.weights.max_step() == 1 and sync.issuer.num_tasks_to_issue() == 2
    ahead = make_coordinator(async_level=2)
    assert ahead.weights.max_step() == 3 and ahead.issuer.num_tasks_to_issue() == 6
    ahead.store.state.next_step = 4
    assert ahead.issuer.num_tasks_to_issue() == 0  # waits for newer weights
    ahead.weights.applied_version = 1
    assert ahead.issuer.num_tasks_to_issue() == 2


def test_full_pool_becomes_one_batch_and_acks_after_publishing():
    c = make_coordinator()
    deliveries = []

    async def feed():
        for i, rewards in enumerate([[0.0, 1.0], [0.3, 0.3], [0.2, 0.6]]):
            task_id = f"train-{i}"
            c.store.state.outstanding[task_id] = i
            c.store.state.cursor = i + 1
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
    assert c.store.state.next_step == 2 and c.store.state.outstanding == {}
    assert batches_wire.decoder.decode(batches_wire.encoder.encode(batch)).num_samples == 4


def test_duplicate_rollout_of_a_batched_task_is_acked_and_ignored():
    c = make_coordinator()
    c.store.state.cursor = 10
    d = FakeDelivery(make_rollout("train-9", [0.0, 1.0]))
    asyncio.run(c.on_rollout(d))
    assert d.acked and not c.pool and not c.bus.dead


def test_eval_rollouts_go_to_the_evaluation_never_to_the_pool():
    c = make_coordinator(eval={"interval": 1, "num_examples": 2}, max_steps=5)
    c.weights.applied_version = 3

    async def scenario():
        c.start_eval(3)
        while not c.bus.published_to(c.bus.subjects.eval_tasks) and c.tasks.tasks:
            await asyncio.sleep(0.01)
        for i, reward in enumerate([0.2, 0.6]):
            await c.on_rollout(FakeDelivery(make_rollout(f"eval-3-0-{i}", [reward])))
        await c.tasks.join()

    asyncio.run(scenario())
    assert len(c.bus.published_to(c.bus.subjects.eval_tasks)) == 2
    assert c.evals.results[3]["reverse-text"]["eval/reverse-text/reward/mean"] == 0.4
    assert not c.pool and c.store.state.dropped == {}


def test_a_batch_at_an_eval_interval_starts_an_evaluation_and_max_steps_ends_the_run():
    c = make_coordinator(eval={"interval": 2, "num_examples": 1, "timeout_s": 0.1}, max_steps=3)
    c.weights.applied_version = 3

    async def after_batches():
        c.after_batch(1)
        assert not c.tasks.tasks and not c.done.is_set()
        c.after_batch(2)
        assert [*c.tasks.tasks.values()] == ["eval_step_2"] and not c.done.is_set()
        c.after_batch(3)  # the last step: evaluated whatever the interval
        assert c.done.is_set() and not c.evals.idle.is_set()
        await c.tasks.join()

    asyncio.run(after_batches())
    tasks = c.bus.published_to(c.bus.subjects.eval_tasks)
    assert [t.task_id for t in tasks] == ["eval-2-0-0", "eval-3-0-0"]
    assert c.evals.idle.is_set()


def test_poison_rollout_is_quarantined_dropped_as_invalid_and_batching_goes_on():
    c = make_coordinator()
    c.store.state.cursor = 3
    c.store.state.outstanding = {"train-0": 0, "train-1": 1, "train-2": 2}
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
    [batch] = c.bus.published_to(c.bus.subjects.batch(1))
    assert batch.task_ids == ["train-0", "train-2"] and batch.metrics["tasks/dropped/invalid"] == 1
    state = c.store.state
    assert state.dropped == {"invalid": 1} and state.accounting()["unaccounted"] == 0
    assert state.accounting() == {
        "issued": 3,
        "skipped": 0,
        "trained": 2,
        "dropped": 1,
        "outstanding": 0,
        "unaccounted": 0,
    }
    assert c.issuer.num_tasks_to_issue() > 0  # the dropped group is replaced by a new task


def test_rollout_for_a_task_never_issued_or_with_a_garbage_id_is_quarantined():
    c = make_coordinator()
    c.store.state.cursor = 2
    for task_id in ("train-7", "nonsense", "eval-x-1"):
        d = FakeDelivery(make_rollout(task_id, [0.0, 1.0]))
        asyncio.run(c.on_rollout(d))
        assert d.termed and not c.pool
    assert len(c.bus.dead) == 3 and c.store.state.dropped == {}


def test_a_task_whose_rollout_never_comes_is_dropped_as_timeout_and_replaced(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(task_issue.time, "monotonic", lambda: now[0])
    c = make_coordinator(async_level=0, task_timeout_s=60.0)
    c.store.state.cursor = 2
    c.store.state.outstanding = {"train-0": 0, "train-1": 1}
    c.issuer.issued_at = {"train-0": 1000.0, "train-1": 1000.0}
    c.pool.add(make_pooled("train-0", [0.0, 1.0]))
    now[0] = 1059.0
    assert asyncio.run(c.issuer.expire_overdue_tasks()) == 0
    now[0] = 1061.0
    assert asyncio.run(c.issuer.expire_overdue_tasks()) == 1  # train-1; train-0 came back (pooled)
    assert c.store.state.outstanding == {"train-0": 0} and c.store.state.dropped == {"timeout": 1}
    assert c.stats.dropped["timeout"] == 1
    assert c.issuer.num_tasks_to_issue() == 1 and c.store.state.accounting()["unaccounted"] == 0
    late = FakeDelivery(make_rollout("train-1", [0.0, 1.0]))
    asyncio.run(c.on_rollout(late))
    assert late.acked and "train-1" not in c.pool  # a late rollout is ignored


def test_issue_tasks_issues_nothing_while_paused_and_what_is_due_on_resume():
    c = make_coordinator(async_level=0)

    async def pause_then_resume():
        c.service.pause("test")
        loop = asyncio.create_task(c.issue_tasks())
        c.changed.set()
        await asyncio.sleep(0.05)
        assert c.bus.published_to(c.bus.subjects.tasks) == []
        c.service.resume()
        for _ in range(100):
            if c.bus.published_to(c.bus.subjects.tasks):
                break
            await asyncio.sleep(0.01)
        c.done.set()
        c.changed.set()
        await asyncio.wait_for(loop, 1)

    asyncio.run(pause_then_resume())
    published = c.bus.published_to(c.bus.subjects.tasks)
    assert [t.task_id for t in published] == ["train-0", "train-1"]
    assert c.store.state.cursor == 2 and c.store.state.publishing == []


def test_backoff_max_below_backoff_is_one_clear_error():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="http.backoff_max_s"):
        OrchestratorConfig(http={"backoff_s": 10.0, "backoff_max_s": 1.0})
