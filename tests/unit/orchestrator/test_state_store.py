"""The state store: the task ledger's accounting, the state's JSON form, write-ahead saves and
bus retries (its loads against a real bus: tests/integration/orchestrator/test_coordinator_bus.py)."""

import asyncio

import pytest
from coordinator_fakes import make_store

from rlbus.bus.core import RETRYABLE_PUBLISH_ERRORS
from rlbus_orchestrator.state_store import CoordinatorState, StateStore


def test_every_issued_task_is_trained_dropped_or_outstanding():
    store = make_store()
    store.record_issued({"train-0": 0, "train-1": 1, "train-2": 2, "train-3": 3})
    store.record_trained(["train-0", "train-9"])  # train-9 was never outstanding: not counted
    assert store.record_dropped("train-1", "stale")
    assert not store.record_dropped("train-1", "timeout")  # ended already: counted once
    assert store.state.accounting() == {
        "issued": 4,
        "skipped": 0,
        "trained": 1,
        "dropped": 1,
        "outstanding": 2,
        "unaccounted": 0,
    }
    assert store.state.dropped == {"stale": 1} and not store.is_outstanding("train-1")


def test_state_round_trips_through_its_json_form():
    state = CoordinatorState(
        next_step=7,
        cursor=9,
        outstanding={"train-8": 8},
        publishing=[8],
        trained=5,
        dropped={"error": 3},
        skipped=2,
        prompts={"reverse-text": {"3": [2, 27], "5": [-1, 0]}},
    )
    assert CoordinatorState.decode(state.encode()) == state


def test_a_state_saved_before_difficulty_filtering_still_loads():
    old = b'{"next_step": 3, "cursor": 4, "outstanding": {}, "publishing": [], "trained": 4, "dropped": {}}'
    state = CoordinatorState.decode(old)
    assert (state.skipped, state.prompts, state.accounting()["unaccounted"]) == (0, {}, 0)


def test_cursors_passed_over_are_skipped_not_issued():
    store = make_store()
    store.record_issued({"train-0": 0, "train-3": 3}, next_cursor=4)  # 1 and 2 passed over
    assert (store.state.cursor, store.state.skipped, store.state.num_issued()) == (4, 2, 2)
    assert store.state.accounting()["unaccounted"] == 0


def test_write_ahead_cursors_are_saved_before_the_publish_and_cleared_after():
    store = make_store()
    asyncio.run(store.save_write_ahead([4, 5]))
    asyncio.run(store.save_published())
    assert [saved.publishing for saved, _ in store.saved] == [[4, 5], []]


def test_state_save_is_retried_through_a_transient_bus_error_and_fails_past_the_deadline():
    transient = RETRYABLE_PUBLISH_ERRORS[0]
    store = StateStore(bus=None, retry_s=1.0)
    calls = []

    async def flaky(fail_times):
        calls.append(1)
        if len(calls) <= fail_times:
            raise transient()
        return "saved"

    assert asyncio.run(store.retry_bus("save_state", lambda: flaky(2))) == "saved"
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(transient):  # past bus.publish_retry_s: the task fails (exit 1, one line)
        asyncio.run(store.retry_bus("save_state", lambda: flaky(1000)))
    assert 3 <= len(calls) < 20
