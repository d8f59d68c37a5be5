"""The batcher: stale pooled groups dropped, then batches published, saved, acked, in order."""

import asyncio

from coordinator_fakes import make_parts, make_pooled, make_weights

from rlbus_orchestrator.batcher import Batcher
from rlbus_orchestrator.step_traces import StepTraces


def make_batcher(**overrides):
    config, store, pool, stats = make_parts(**overrides)
    published_steps = []
    batcher = Batcher(
        store.bus,
        config,
        store=store,
        pool=pool,
        weights=make_weights(config, store, stats=stats),
        stats=stats,
        traces=StepTraces(),
        done=asyncio.Event(),
        on_published=published_steps.append,
    )
    return batcher, published_steps


def pool_groups(batcher, *groups):
    for group in groups:
        batcher.store.record_issued({group.task_id: int(group.task_id.split("-")[1])})
        batcher.pool.add(group)


def test_pooled_group_that_became_stale_is_dropped_before_batching():
    batcher, published_steps = make_batcher(max_off_policy_steps=0, batch_size=2)
    old = make_pooled("train-0", [0.0, 1.0], version=0)
    pool_groups(batcher, old)
    batcher.store.state.next_step, batcher.weights.applied_version = 3, 2
    asyncio.run(batcher.build_batches())
    assert not batcher.pool and old.delivery.acked and batcher.stats.dropped["stale"] == 1
    assert batcher.store.state.dropped == {"stale": 1} and published_steps == []
    assert not [p for p in batcher.bus.published if ".batches" in p[0]]


def test_a_batch_is_stored_then_saved_then_acked_and_the_next_step_begins():
    batcher, published_steps = make_batcher(batch_size=4)
    groups = [make_pooled(f"train-{i}", [0.0, 1.0]) for i in range(3)]
    pool_groups(batcher, *groups)
    batcher.stats.completion_tokens = 99
    asyncio.run(batcher.build_batches())
    subjects = [subject for subject, _, _ in batcher.bus.published]
    assert subjects == [batcher.bus.subjects.batch(1), batcher.bus.subjects.metrics("orchestrator")]
    [(saved, num_published_before)] = batcher.store.saved
    assert num_published_before == 1  # the batch was stored before the state said so
    assert saved.next_step == 2 and saved.trained == 2 and saved.outstanding == {"train-2": 2}
    assert [g.delivery.acked for g in groups] == [True, True, False]
    assert [g.task_id for g in batcher.pool.groups.values()] == ["train-2"]
    assert published_steps == [1] and batcher.stats.completion_tokens == 0  # counters reset


def test_no_batch_is_built_past_what_the_applied_weights_allow():
    batcher, published_steps = make_batcher(batch_size=2, async_level=0)
    pool_groups(batcher, make_pooled("train-0", [0.0, 1.0]), make_pooled("train-1", [0.0, 1.0]))
    asyncio.run(batcher.build_batches())
    assert published_steps == [1]  # step 2 waits for version 1
    batcher.weights.applied_version = 1
    asyncio.run(batcher.build_batches())
    assert published_steps == [1, 2]


def test_a_batch_holds_its_groups_packed_per_rank_with_their_policy_versions():
    batcher, _ = make_batcher(batch_size=4, num_train_ranks=2, max_off_policy_steps=3)
    batcher.store.state.next_step = 3
    groups = [
        make_pooled("train-0", [0.0, 1.0], version=1),
        make_pooled("train-1", [1.0, 0.0], version=2),
    ]
    batch = batcher.make_batch(3, groups)
    assert batch.task_ids == ["train-0", "train-1"] and len(batch.micro_batches) == 2
    assert (batch.min_policy_version, batch.max_policy_version) == (1, 2)
    assert batch.num_samples == 4 and batch.metrics["off_policy_lag/1"] == 2.0
