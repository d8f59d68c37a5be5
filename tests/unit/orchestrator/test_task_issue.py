"""Task issue: how many tasks are due, what a task holds, the write-ahead publish, resume and
expiry."""

import asyncio

from coordinator_fakes import make_parts, make_pooled, make_weights

from rlbus_orchestrator import task_issue
from rlbus_orchestrator.step_traces import StepTraces
from rlbus_orchestrator.task_issue import TaskIssuer, dataset_index, load_run_envs


def make_issuer(**overrides):
    config, store, pool, stats = make_parts(**overrides)
    weights = make_weights(config, store, stats=stats)
    return TaskIssuer(
        store.bus,
        config,
        load_run_envs(config),
        store=store,
        pool=pool,
        weights=weights,
        traces=StepTraces(),
        stats=stats,
    )


def published_tasks(issuer):
    return issuer.bus.published_to(issuer.bus.subjects.tasks)


def test_tasks_in_flight_and_pooled_samples_count_toward_the_target():
    issuer = make_issuer(async_level=0)
    issuer.store.state.outstanding = {"train-0": 0, "train-1": 1}
    assert issuer.num_tasks_to_issue() == 0
    issuer.pool.add(make_pooled("train-0", [0.0, 1.0]))
    assert issuer.num_tasks_to_issue() == 0
    del issuer.store.state.outstanding["train-1"]  # dropped: a replacement is due
    assert issuer.num_tasks_to_issue() == 1


def test_due_tasks_are_saved_as_write_ahead_cursors_before_they_are_published():
    issuer = make_issuer(async_level=0)
    assert asyncio.run(issuer.issue_due_tasks()) == 2
    tasks = published_tasks(issuer)
    assert [(t.task_id, t.step, t.group_size) for t in tasks] == [
        ("train-0", 1, 2),
        ("train-1", 1, 2),
    ]
    [(ahead, num_published_before), (after, _)] = issuer.store.saved
    assert ahead.publishing == [0, 1] and num_published_before == 0
    assert after.publishing == [] and after.outstanding == {"train-0": 0, "train-1": 1}
    assert asyncio.run(issuer.issue_due_tasks()) == 0  # all due tasks are on the way


def test_a_task_asks_for_weights_no_older_than_max_off_policy_steps_allows():
    issuer = make_issuer(max_off_policy_steps=1)
    issuer.store.state.next_step = 5
    task = issuer.make_task(3)
    assert (task.task_id, task.min_policy_version) == ("train-3", 3)
    assert task.problem == issuer.make_task(3).problem  # a cursor is always the same problem


def test_the_environment_of_a_cursor_follows_the_weights_and_is_the_same_every_time():
    envs = [
        {"id": "reverse-text", "weight": 3.0},
        {"id": "reverse-text", "weight": 1.0, "args": {"min_len": 1, "max_len": 1}},
    ]
    issuer = make_issuer(env=envs)
    picks = [issuer.make_task(c).env_args for c in range(400)]
    num_second = sum(1 for args in picks if args)
    assert 60 < num_second < 140  # about a quarter
    assert picks == [issuer.make_task(c).env_args for c in range(400)]


def test_a_finite_dataset_is_walked_in_a_new_seeded_order_each_epoch():
    first = [dataset_index(c, 5, seed=1) for c in range(5)]
    second = [dataset_index(c, 5, seed=1) for c in range(5, 10)]
    assert sorted(first) == sorted(second) == [0, 1, 2, 3, 4]
    assert first == [dataset_index(c, 5, seed=1) for c in range(5)]
    assert dataset_index(123, None, seed=1) == 123  # generated data: the cursor itself


def test_resume_republishes_an_interrupted_publish_and_restarts_the_clocks(monkeypatch):
    monkeypatch.setattr(task_issue.time, "monotonic", lambda: 50.0)
    issuer = make_issuer()
    issuer.store.state.outstanding = {"train-3": 3, "train-4": 4}
    issuer.store.state.publishing = [4]
    asyncio.run(issuer.resume())
    assert [t.task_id for t in published_tasks(issuer)] == ["train-4"]
    assert issuer.issued_at == {"train-3": 50.0, "train-4": 50.0}


def test_without_a_task_timeout_nothing_expires():
    issuer = make_issuer(task_timeout_s=None)
    issuer.store.state.outstanding = {"train-0": 0}
    issuer.issued_at = {"train-0": 0.0}
    assert issuer.expiry_poll_s() is None and issuer.overdue_tasks(now=1e9) == []
    assert make_issuer(task_timeout_s=8.0).expiry_poll_s() == 2.0


TWO_ENVS = [
    {
        "id": "reverse-text",
        "group_size": 2,
        "sampling": {"temperature": 0.5},
        "max_turns": 3,
        "episode_timeout_s": 20,
    },
    {"id": "reverse-text", "group_size": 6, "args": {"min_len": 1, "max_len": 2}},
]


def test_a_task_carries_its_environments_sampling_group_size_and_limits():
    issuer = make_issuer(env=TWO_ENVS, batch_size=12, sampling={"max_tokens": 16})
    tasks = [issuer.make_task(c) for c in range(40)]
    small = next(t for t in tasks if t.group_size == 2)
    large = next(t for t in tasks if t.group_size == 6)
    assert (small.sampling.temperature, small.sampling.max_tokens) == (0.5, 16)
    assert (small.limits.max_turns, small.limits.deadline_s) == (3, 20.0)
    assert (large.sampling.temperature, large.sampling.max_tokens) == (1.0, 16)
    assert large.limits.max_turns is None and large.env_args == {"min_len": 1, "max_len": 2}
    assert {t.env_id for t in tasks} == {"reverse-text"}


def test_issuing_counts_each_task_by_its_environments_group_size():
    issuer = make_issuer(env=TWO_ENVS, batch_size=12, async_level=0)
    sizes = [issuer.mix.of_cursor(c).group_size for c in range(20)]
    num = issuer.num_tasks_to_issue()
    assert sum(sizes[:num]) >= 12 > sum(sizes[: num - 1])  # just enough groups for one step
    asyncio.run(issuer.issue_due_tasks())
    assert [t.group_size for t in published_tasks(issuer)] == sizes[:num]
    assert issuer.samples_on_the_way() == sum(sizes[:num])
    assert issuer.num_tasks_to_issue() == 0
    assert issuer.expected_steps(list(range(num))) == [1 + sum(sizes[:k]) // 12 for k in range(num)]
