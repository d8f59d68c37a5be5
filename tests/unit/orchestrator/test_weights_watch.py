"""The weights watcher: how far ahead the applied version lets the coordinator work (its bus
subscriptions: tests/integration/orchestrator/test_coordinator_bus.py)."""

import asyncio

from coordinator_fakes import make_config, make_store, make_weights


def test_max_step_is_async_level_ahead_of_the_applied_version_and_never_past_max_steps():
    store = make_store()
    weights = make_weights(make_config(async_level=2), store)
    assert weights.max_step() == 3
    weights.applied_version = 5
    assert weights.max_step() == 8
    capped = make_weights(make_config(async_level=2, max_steps=4), store)
    capped.applied_version = 5
    assert capped.max_step() == 4


def test_only_a_newer_version_moves_the_applied_version_and_wakes_the_coordinator():
    changed = asyncio.Event()
    weights = make_weights(make_config(), make_store(), changed=changed)
    weights.on_weights_applied(2)
    assert weights.applied_version == 2 and changed.is_set()
    changed.clear()
    weights.on_weights_applied(1)
    assert weights.applied_version == 2 and not changed.is_set()
