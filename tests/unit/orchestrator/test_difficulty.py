"""Difficulty filtering (difficulty.py): outcomes of groups, streaks, skips and their expiry, the
cursors the task issuer passes over, the livelock guard, per-environment settings, and the
coordinator recording outcomes as tasks end (the real bus and a resume:
tests/integration/orchestrator/test_difficulty_filter_bus.py)."""

import asyncio
import uuid
from collections import Counter

import pytest
from coordinator_fakes import FakeDelivery, make_coordinator, make_rollout, make_store
from test_task_issue import make_issuer, published_tasks

from rlbus.configs.orchestrator import DifficultyFilterConfig
from rlbus_orchestrator.difficulty import (
    FAILED,
    NEITHER,
    SOLVED,
    DifficultyFilter,
    group_outcome,
    next_streak,
)

SMALL_ENV = [{"id": "reverse-text", "args": {"num_train": 4}}]
"""Four train prompts: cursor c draws a shuffled example of epoch c // 4."""


def make_filter(consecutive=2, skip_steps=3, **fields):
    """A filter over four prompts of environment `e`: cursor c is example c % 4."""
    config = DifficultyFilterConfig(
        enabled=True, consecutive=consecutive, skip_steps=skip_steps, **fields
    )
    return DifficultyFilter(
        {"e": config}, make_store(), prompt_of=lambda c: ("e", c % 4), num_prompts={"e": 4}
    )


SOLVED_GROUP, FAILED_GROUP, MIXED_GROUP = [1.0, 1.0], [0.0, 0.0], [0.0, 1.0]


@pytest.mark.parametrize(
    ("rewards", "outcome"),
    [
        ([1.0, 1.0, 1.0], SOLVED),
        ([1.0, 1.5], SOLVED),
        ([0.0, 0.0], FAILED),
        ([-1.0, 0.0], FAILED),
        ([0.0, 1.0], NEITHER),
        ([0.5, 0.5], NEITHER),  # flat, but neither solved nor failed
        ([0.99, 1.0], NEITHER),
    ],
)
def test_a_group_is_solved_or_failed_only_when_every_sample_is(rewards, outcome):
    assert group_outcome(rewards, DifficultyFilterConfig()) == outcome


def test_the_thresholds_decide_what_solved_and_failed_mean():
    config = DifficultyFilterConfig(solved_threshold=0.8, failed_threshold=0.2)
    assert group_outcome([0.9, 0.8], config) == SOLVED
    assert group_outcome([0.1, 0.2], config) == FAILED
    assert group_outcome([0.1, 0.9], config) == NEITHER


def test_a_streak_grows_in_its_direction_and_restarts_on_a_change():
    assert [next_streak(2, SOLVED), next_streak(-2, SOLVED), next_streak(3, NEITHER)] == [3, 1, 0]
    assert [next_streak(-1, FAILED), next_streak(2, FAILED), next_streak(0, FAILED)] == [-2, -1, -1]


def test_k_solved_visits_in_a_row_skip_a_prompt_for_m_steps_then_its_streak_restarts():
    f = make_filter(consecutive=2, skip_steps=3)
    state = f.store.state
    f.record("train-0", SOLVED_GROUP)  # prompt 0: one solved
    assert state.prompts == {"e": {"0": [1, 0]}}
    f.record("train-4", MIXED_GROUP)  # the streak is broken: no entry
    assert state.prompts == {"e": {}}
    f.record("train-8", SOLVED_GROUP)
    f.record("train-12", SOLVED_GROUP)  # two in a row at step 1: skipped for steps 1, 2, 3
    assert state.prompts == {"e": {"0": [2, 4]}}
    assert [f.skipped(step) for step in (1, 3, 4)] == [{("e", 0): "easy"}] * 2 + [{}]
    f.record("train-16", FAILED_GROUP)  # issued before the skip: ignored while skipped
    assert state.prompts == {"e": {"0": [2, 4]}}
    state.next_step = 4  # eligible again: a new streak, from nothing
    f.record("train-20", FAILED_GROUP)
    assert state.prompts == {"e": {"0": [-1, 0]}}
    f.record("train-24", FAILED_GROUP)  # two failed in a row at step 4: hard until step 7
    assert state.prompts == {"e": {"0": [-2, 7]}}
    assert f.num_skipped(6) == Counter(hard=1) and f.num_skipped(7) == Counter()


def test_the_solved_after_a_failure_does_not_count_toward_the_streak():
    f = make_filter(consecutive=2)
    for task_id, rewards in [("train-1", SOLVED_GROUP), ("train-5", FAILED_GROUP)]:
        f.record(task_id, rewards)
    assert f.store.state.prompts == {"e": {"1": [-1, 0]}} and not f.skipped(1)


def test_outcomes_of_untracked_prompts_eval_tasks_and_a_disabled_filter_are_not_recorded():
    f = make_filter(consecutive=1)
    f.prompt_of = lambda c: None  # a generated dataset
    f.record("train-0", SOLVED_GROUP)
    f.record("eval-1-0-0", SOLVED_GROUP)
    off = DifficultyFilter(
        {"e": DifficultyFilterConfig(consecutive=1)},
        make_store(),
        prompt_of=lambda c: ("e", c),
        num_prompts={"e": 4},
    )
    off.record("train-0", SOLVED_GROUP)
    assert f.store.state.prompts == {} and off.store.state.prompts == {}
    assert not off.selection(1).kinds


def test_the_cursors_of_skipped_prompts_are_passed_over_and_counted_by_kind():
    f = make_filter(consecutive=1)
    f.record("train-1", SOLVED_GROUP)
    f.record("train-2", FAILED_GROUP)
    selection = f.selection(1)
    kept = [c for c in range(8) if not selection.passes_over(c)]
    assert kept == [0, 3, 4, 7]
    assert selection.num_skips == Counter(easy=2, hard=2) and selection.num_forced == 0


def test_when_every_prompt_of_an_environment_is_skipped_its_tasks_are_issued_and_counted():
    f = make_filter(consecutive=1)
    for i in range(4):
        f.record(f"train-{i}", SOLVED_GROUP)
    selection = f.selection(1)
    assert not any(selection.passes_over(c) for c in range(6))
    assert selection.num_forced == 6 and not selection.num_skips


def test_the_issuer_passes_skipped_examples_over_and_the_ledger_still_adds_up():
    issuer = make_issuer(
        async_level=0,
        batch_size=4,
        env=SMALL_ENV,
        difficulty_filter={"enabled": True, "consecutive": 1},
    )
    first_epoch = [issuer.make_task(c).example_id for c in range(4)]
    issuer.difficulty.record("train-0", SOLVED_GROUP)  # the first cursor's example, easy
    issuer.difficulty.record("train-1", FAILED_GROUP)  # the second's, hard
    assert asyncio.run(issuer.issue_due_tasks()) == 2
    tasks = published_tasks(issuer)
    assert [t.task_id for t in tasks] == ["train-2", "train-3"]
    assert [t.example_id for t in tasks] == first_epoch[2:]
    state = issuer.store.state
    assert (state.cursor, state.skipped, state.num_issued()) == (4, 2, 2)
    assert state.accounting()["unaccounted"] == 0
    assert issuer.stats.prompt_skips == Counter(easy=1, hard=1)
    # the write-ahead cursors are the issued ones, not a range over the skipped
    assert issuer.store.saved[0][0].publishing == [2, 3]


def test_an_environment_with_every_example_skipped_still_gets_its_tasks():
    issuer = make_issuer(
        async_level=0,
        batch_size=4,
        env=SMALL_ENV,
        difficulty_filter={"enabled": True, "consecutive": 1},
    )
    for c in range(4):
        issuer.difficulty.record(f"train-{c}", SOLVED_GROUP)
    assert asyncio.run(issuer.issue_due_tasks()) == 2
    assert [t.task_id for t in published_tasks(issuer)] == ["train-0", "train-1"]
    assert issuer.stats.prompts_forced == 2 and issuer.store.state.skipped == 0


def test_the_coordinator_records_flat_and_trained_groups_and_reports_the_skips():
    c = make_coordinator(
        env=SMALL_ENV, difficulty_filter={"enabled": True, "consecutive": 1, "skip_steps": 5}
    )
    example_of = {cursor: c.issuer.make_task(cursor).example_id for cursor in range(3)}
    state = c.store.state

    async def feed():
        await c.issuer.issue_due_tasks()  # train-0 .. train-3 (batch 4, group 2, one step ahead)
        for task_id, rewards in [("train-0", [1.0, 1.0]), ("train-1", [0.0, 1.0])]:
            await c.on_rollout(FakeDelivery(make_rollout(task_id, rewards)))
        await c.issuer.issue_due_tasks()  # the flat group's replacement
        await c.on_rollout(FakeDelivery(make_rollout("train-2", [0.0, 0.5])))

    asyncio.run(feed())
    # the flat, solved group was dropped and recorded at once: its example skipped until 1 + 5
    assert state.prompts["reverse-text"] == {str(example_of[0]): [1, 6]}
    [batch] = c.bus.published_to(c.bus.subjects.batch(1))
    assert batch.task_ids == ["train-1", "train-2"]
    assert batch.metrics["difficulty/skipped_easy"] == 1
    assert batch.metrics["difficulty/skipped_hard"] == 0
    assert batch.metrics["dropped/zero_advantage"] == 1
    issued = [t.example_id for t in c.bus.published_to(c.bus.subjects.tasks)]
    assert issued.count(example_of[0]) == 1  # never issued again while skipped
    assert batch.metrics["difficulty/skips"] == state.skipped > 0
    assert batch.metrics["tasks/issued"] == state.num_issued()


def test_without_the_filter_a_step_has_no_difficulty_metrics():
    c = make_coordinator()

    async def feed():
        await c.issuer.issue_due_tasks()
        for task_id in ("train-0", "train-1"):
            await c.on_rollout(FakeDelivery(make_rollout(task_id, [0.0, 1.0])))

    asyncio.run(feed())
    [batch] = c.bus.published_to(c.bus.subjects.batch(1))
    assert not [key for key in batch.metrics if key.startswith("difficulty/")]
    assert c.store.state.prompts == {}


FOUR_PROMPTS_ENV = """
def length_reward(text):
    return len(text) / 10


class _Rubric:
    funcs = [length_reward]


class _Env:
    dataset = [{"question": f"q{i}", "answer": ""} for i in range(4)]
    rubric = _Rubric()


def load_environment(**args):
    return _Env()
"""


@pytest.fixture
def four_prompt_envs(tmp_path, monkeypatch):
    """Two more environment ids of four prompts each (verifiers-style modules)."""
    suffix = uuid.uuid4().hex[:6]
    names = [f"partial_{suffix}", f"unfiltered_{suffix}"]
    for name in names:
        (tmp_path / f"{name}.py").write_text(FOUR_PROMPTS_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    return [name.replace("_", "-") for name in names]


def test_an_environment_sets_its_own_filter_over_the_orchestrator_s(four_prompt_envs):
    partial, unfiltered = four_prompt_envs
    issuer = make_issuer(
        async_level=0,
        batch_size=4,
        env=[
            *SMALL_ENV,
            {"id": partial, "difficulty_filter": {"solved_threshold": 0.5, "skip_steps": 9}},
            {"id": unfiltered, "difficulty_filter": {"enabled": False}},
        ],
        difficulty_filter={"enabled": True, "consecutive": 1},
    )
    cursors = {}  # env id -> the first cursor that draws it
    for cursor in range(40):
        cursors.setdefault(issuer.mix.of_cursor(cursor).env_id, cursor)
    for env_id in ("reverse-text", partial, unfiltered):
        issuer.difficulty.record(f"train-{cursors[env_id]}", [0.6, 0.7])
        issuer.difficulty.record(f"train-{cursors[env_id]}", [1.0, 1.0])
    prompts = issuer.store.state.prompts
    assert set(prompts) == {"reverse-text", partial}  # the third is not filtered
    assert list(prompts[partial].values()) == [[1, 10]]  # 0.6 is solved there: skipped at once
    assert list(prompts["reverse-text"].values()) == [[1, 21]]  # only 1.0 is, here
