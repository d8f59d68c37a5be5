"""The coordinator's state, batch adoption and weights tracking through the bus facade, on a real
nats-server (no inference replica needed)."""

import asyncio

from rlbus.configs.orchestrator import OrchestratorConfig
from rlbus.wire import replicas, weights
from rlbus.wire.batches import TrainBatch
from rlbus_orchestrator.coordinator import Coordinator
from rlbus_orchestrator.state_store import STATE_KEY, CoordinatorState


def make_coordinator(bus) -> Coordinator:
    return Coordinator(bus, OrchestratorConfig(batch_size=2, group_size=2, seq_len=64))


async def test_restart_adopts_a_batch_stored_before_the_crash_and_saves_the_state(bus):
    state = CoordinatorState(next_step=1, cursor=2, outstanding={"train-0": 0, "train-1": 1})
    await bus.kv(bus.subjects.state_bucket).put(STATE_KEY, state.encode())
    await bus.publish(
        bus.subjects.batch(1),
        TrainBatch(step=1, micro_batches=[[]], task_ids=["train-0"]),
        msg_id=bus.subjects.batch_msg_id(1),
    )
    coordinator = make_coordinator(bus)
    await coordinator.load_state()
    assert (coordinator.store.state.next_step, coordinator.store.state.outstanding) == (
        2,
        {"train-1": 1},
    )
    saved = await bus.kv(bus.subjects.state_bucket).get(STATE_KEY)
    assert CoordinatorState.decode(saved.value) == coordinator.store.state


async def test_restart_steps_over_a_stored_batch_that_is_poison_instead_of_crashing(bus):
    """The trainer quarantines and skips an undecodable stored step; a restarted coordinator must
    count it as published too (it used to raise on every restart)."""
    state = CoordinatorState(next_step=1, cursor=2, outstanding={"train-0": 0, "train-1": 1})
    await bus.kv(bus.subjects.state_bucket).put(STATE_KEY, state.encode())
    await bus.publish(
        bus.subjects.batch(1), b"\xc1 not msgpack", msg_id=bus.subjects.batch_msg_id(1)
    )
    await bus.publish(
        bus.subjects.batch(2),
        TrainBatch(step=2, micro_batches=[[]], task_ids=["train-1"]),
        msg_id=bus.subjects.batch_msg_id(2),
    )
    coordinator = make_coordinator(bus)
    await coordinator.load_state()
    assert (coordinator.store.state.next_step, coordinator.store.state.outstanding) == (
        3,
        {"train-0": 0},
    )


async def test_fresh_run_starts_at_step_one(bus):
    coordinator = make_coordinator(bus)
    await coordinator.load_state()
    assert coordinator.store.state == CoordinatorState()


async def test_applied_weights_are_seen_by_event_and_by_registry(bus, make_bus):
    coordinator = make_coordinator(bus)
    subscription = await coordinator.weights.subscribe_weights_applied()
    replica_bus = await make_bus(name="inference")
    applied = weights.WeightsApplied(version=3, replica_id="r0")
    await replica_bus.publish(replica_bus.subjects.weights_applied, weights.encoder.encode(applied))
    for _ in range(50):
        if coordinator.weights.applied_version == 3:
            break
        await asyncio.sleep(0.1)
    assert coordinator.weights.applied_version == 3
    await subscription.unsubscribe()

    info = replicas.ReplicaInfo(
        replica_id="r0", base_url="http://r0/v1", model="m", weights_version=5
    )
    await replica_bus.kv(replica_bus.subjects.replicas_bucket).put("r0", info)
    assert await coordinator.weights.newest_applied_version() == 5


async def test_a_refused_weights_version_is_logged_with_its_reason(bus, make_bus):
    from structlog.testing import capture_logs

    coordinator = make_coordinator(bus)
    replica_bus = await make_bus(name="inference")
    failed = weights.WeightsFailed(version=4, replica_id="r0", reason="tensor x: holds NaN")
    with capture_logs() as logs:
        subscription = await coordinator.weights.subscribe_weights_failed()
        await replica_bus.publish(
            replica_bus.subjects.weights_failed, weights.encoder.encode(failed)
        )
        for _ in range(50):
            if any(e["event"] == "weights_failed_seen" for e in logs):
                break
            await asyncio.sleep(0.1)
        await subscription.unsubscribe()
    seen = [e for e in logs if e["event"] == "weights_failed_seen"]
    assert seen and (seen[0]["version"], seen[0]["replica_id"]) == (4, "r0")
    assert seen[0]["reason"] == "tensor x: holds NaN" and seen[0]["log_level"] == "error"


async def test_restart_sends_the_metrics_of_a_batch_published_without_them(bus):
    """Killed between storing step 2's batch and publishing its StepMetrics: the restarted
    coordinator sends them from the stored batch (marked replayed); step 1's are on the bus
    already and are not sent twice."""
    from rlbus.wire import events

    await bus.kv(bus.subjects.state_bucket).put(
        STATE_KEY, CoordinatorState(next_step=3, cursor=4).encode()
    )
    for step in (1, 2):
        await bus.publish(
            bus.subjects.batch(step),
            TrainBatch(step=step, micro_batches=[[]], metrics={"reward/mean": step / 10}),
            msg_id=bus.subjects.batch_msg_id(step),
        )
    await bus.publish(
        bus.subjects.metrics("orchestrator"),
        events.StepMetrics(service="orchestrator", step=1, metrics={"reward/mean": 0.1}),
    )
    await make_coordinator(bus).load_state()
    raw = await bus.last_stored(bus.subjects.events_stream, bus.subjects.metrics("orchestrator"))
    sent = events.decoder.decode(raw.data)
    assert (sent.step, sent.metrics) == (2, {"reward/mean": 0.2, "replayed": 1.0})
    info = await bus.js.stream_info(bus.subjects.events_stream)
    assert info.state.messages == 2  # step 1's were not sent again
