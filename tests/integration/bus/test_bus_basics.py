"""Publish, consume, step log, KV and leases against a real nats-server."""

import asyncio

import pytest
from bus_factories import make_batch, make_task

from rlbus.bus import BusError, CasMismatch, LeaseHeld, StepNotFound
from rlbus.wire import control, events, tasks


async def test_publish_with_same_msg_id_twice_stores_one_message(bus):
    first = await bus.publish(bus.subjects.tasks, make_task(1), msg_id="0-1")
    second = await bus.publish(bus.subjects.tasks, make_task(1), msg_id="0-1")
    assert not first.duplicate and second.duplicate and first.seq == second.seq
    info = await bus.js.stream_info(bus.subjects.tasks_stream)
    assert info.state.messages == 1


async def test_consumer_receives_decoded_tasks_and_acks_them(bus):
    for index in range(5):
        await bus.publish(bus.subjects.tasks, make_task(index), msg_id=f"0-{index}")
    seen: list[str] = []
    done = asyncio.Event()

    async def handle(delivery):
        seen.append(delivery.data.task_id)
        if len(seen) == 5:
            done.set()

    s = bus.subjects
    async with bus.consumer(s.tasks_stream, s.tasks_durable, tasks.decoder, handle, concurrency=2):
        await asyncio.wait_for(done.wait(), 10)
    assert sorted(seen) == [f"0-{i}" for i in range(5)]
    await asyncio.sleep(0.2)  # acks are fire-and-forget
    info = await bus.js.stream_info(s.tasks_stream)
    assert info.state.messages == 0  # work queue: acked messages are removed


async def test_handler_error_naks_and_message_is_redelivered(bus):
    await bus.publish(bus.subjects.tasks, make_task(0), msg_id="0-0")
    deliveries: list[int] = []
    done = asyncio.Event()

    async def flaky(delivery):
        deliveries.append(delivery.num_delivered)
        if delivery.num_delivered == 1:
            raise RuntimeError("transient")
        done.set()

    s = bus.subjects
    async with bus.consumer(s.tasks_stream, s.tasks_durable, tasks.decoder, flaky, nak_delay_s=0.1):
        await asyncio.wait_for(done.wait(), 10)
    assert deliveries == [1, 2]


async def test_step_log_publishes_once_and_reads_by_step(bus):
    assert await bus.step_log.last_step() is None
    assert await bus.step_log.publish(make_batch(1))
    assert not await bus.step_log.publish(make_batch(1))
    assert await bus.step_log.publish(make_batch(2))
    assert (await bus.step_log.get(1, timeout_s=1)).step == 1
    assert await bus.step_log.last_step() == 2
    with pytest.raises(StepNotFound):
        await bus.step_log.get(7, timeout_s=0.3)


async def test_step_log_get_waits_for_a_later_publish(bus, make_bus):
    reader = await make_bus(name="trainer")
    waiting = asyncio.create_task(reader.step_log.get(3, timeout_s=10))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    await bus.step_log.publish(make_batch(3))
    assert (await asyncio.wait_for(waiting, 5)).step == 3


async def test_claim_check_round_trip_for_a_big_batch(make_bus, tmp_path):
    bus = await make_bus(claim_check_bytes=64 * 1024)
    big = make_batch(5, num_tokens=50_000)
    await bus.step_log.publish(big)
    assert list((tmp_path / "claims").rglob("*.bin"))
    assert await bus.step_log.get(5, timeout_s=2) == big


async def test_big_payload_without_storage_dir_fails_clearly(make_bus):
    bus = await make_bus(claim_check_bytes=64 * 1024)
    bus.storage_dir = None
    with pytest.raises(BusError, match="storage_dir"):
        await bus.step_log.publish(make_batch(5, num_tokens=50_000))


async def test_kv_create_update_compare_and_set(bus):
    kv = bus.kv(bus.subjects.state_bucket)
    assert await kv.get("trainer") is None
    rev = await kv.create("trainer", b"1")
    with pytest.raises(CasMismatch):
        await kv.create("trainer", b"2")
    rev2 = await kv.update("trainer", b"2", revision=rev)
    with pytest.raises(CasMismatch):
        await kv.update("trainer", b"3", revision=rev)
    entry = await kv.get("trainer")
    assert entry.value == b"2" and entry.revision == rev2
    assert await kv.keys() == ["trainer"]


async def test_kv_keys_lists_live_keys_and_leaves_no_consumer_behind(bus):
    """A registry polled twice a second for hours: each keys() must not cost a server consumer
    (nats-py's own keys() leaves one per call; 1000 of them and every read fails)."""
    kv = bus.kv(bus.subjects.replicas_bucket)
    assert await kv.keys() == []
    await kv.put("a", b"1")
    await kv.put("b", b"2")
    await kv.put("c", b"3")
    await kv.delete("b")
    for _ in range(50):
        assert await kv.keys() == ["a", "c"]
    info = await bus.js.stream_info(f"KV_{bus.subjects.replicas_bucket}")
    assert info.state.consumer_count == 0


async def test_kv_watch_sees_current_and_new_values(bus):
    kv = bus.kv(bus.subjects.weights_bucket)
    await kv.put("latest", b"v1")
    seen = []

    async def watch():
        async for entry in kv.watch("latest"):
            seen.append(entry.value)
            if len(seen) == 2:
                return

    task = asyncio.create_task(watch())
    await asyncio.sleep(0.2)
    await kv.put("latest", b"v2")
    await asyncio.wait_for(task, 5)
    assert seen == [b"v1", b"v2"]


async def test_second_lease_holder_is_refused(bus):
    async with bus.lease(bus.subjects.replicas_bucket, "coordinator", b"a", ttl_s=5) as lease:
        assert lease.held
        with pytest.raises(LeaseHeld):
            await bus.lease(bus.subjects.replicas_bucket, "coordinator", b"b", ttl_s=5).acquire()
    # released on exit: another holder can take it at once
    async with bus.lease(bus.subjects.replicas_bucket, "coordinator", b"b", ttl_s=5) as lease:
        assert lease.held


async def test_every_bucket_takes_per_key_ttls(bus):
    """No bucket needs a TTL switch (BucketSpec has none): a key with a TTL expires in any of them."""
    for bucket in (spec.name for spec in bus.subjects.buckets()):
        await bus.kv(bucket).create("short-lived", b"x", ttl_s=1)
    await asyncio.sleep(2.5)
    for bucket in (spec.name for spec in bus.subjects.buckets()):
        assert await bus.kv(bucket).get("short-lived") is None, bucket


async def test_control_request_gets_the_service_reply(bus, make_bus):
    service = await make_bus(name="orchestrator")
    received = []

    async def handle(request):
        received.append(request)
        return control.ControlReply(ok=True, service="orchestrator", state="draining")

    await service.serve_control("orchestrator", handle)
    reply = await bus.request("orchestrator", control.Drain(reason="test"))
    assert reply.ok and reply.state == "draining"
    assert isinstance(received[0], control.Drain)


async def test_events_can_be_read_by_an_adhoc_durable(bus):
    await bus.publish(
        bus.subjects.metrics("trainer"),
        events.StepMetrics(service="trainer", step=1, metrics={"loss": 1.0}),
    )
    got = asyncio.Event()
    seen = []

    async def handle(delivery):
        seen.append(delivery.data)
        got.set()

    s = bus.subjects
    async with bus.consumer(
        s.events_stream, "monitor-file", events.decoder, handle, filter_subject=s.events_all
    ):
        await asyncio.wait_for(got.wait(), 5)
    assert seen[0].metrics == {"loss": 1.0}


async def test_step_log_read_returns_none_for_a_missing_step(bus):
    assert await bus.step_log.read(4) is None
    await bus.step_log.publish(make_batch(4))
    assert (await bus.step_log.read(4)).step == 4


async def test_subscribe_delivers_live_notifications_and_skips_garbage(bus, make_bus):
    from rlbus.wire import weights

    listener = await make_bus(name="coordinator")
    seen = []
    got = asyncio.Event()

    async def on_applied(message, headers):
        seen.append(message)
        got.set()

    await listener.subscribe(listener.subjects.weights_applied, weights.decoder, on_applied)
    await bus.publish(bus.subjects.weights_applied, b"garbage")
    await bus.publish(
        bus.subjects.weights_applied, weights.WeightsApplied(version=2, replica_id="r0")
    )
    await asyncio.wait_for(got.wait(), 5)
    assert seen == [
        weights.WeightsApplied(version=2, replica_id="r0", applied_at=seen[0].applied_at)
    ]


async def test_publish_many_stores_each_id_once_in_order(bus):
    items = [(bus.subjects.tasks, make_task(i), f"0-{i}") for i in range(50)]
    acks = await bus.publish_many(items)
    assert [ack.seq for ack in acks] == list(range(1, 51))
    again = await bus.publish_many(items[:5])
    assert all(ack.duplicate for ack in again)
    assert (await bus.js.stream_info(bus.subjects.tasks_stream)).state.messages == 50
