"""Poison messages on a real nats-server: a handler that always raises, a garbage weights record,
and the dead-letter records they leave (`Bus.dead_letters`)."""

import asyncio
import os
import socket

from bus_factories import make_task, wait_for
from structlog.testing import capture_logs

from rlbus.wire import tasks, weights
from rlbus.wire.subjects import WEIGHTS_LATEST_KEY


async def test_always_failing_handler_quarantines_after_max_deliver_and_goes_on(make_bus):
    bus = await make_bus(max_deliver=3, name="worker")
    s = bus.subjects
    await bus.publish(s.tasks, make_task(0), msg_id="0-0")
    await bus.publish(s.tasks, make_task(1), msg_id="0-1")
    attempts: list[tuple[str, int]] = []
    handled: list[str] = []

    async def handle(delivery):
        attempts.append((delivery.data.task_id, delivery.num_delivered))
        if delivery.data.task_id == "0-0":
            raise ValueError("bad reward function input")
        handled.append(delivery.data.task_id)

    async with bus.consumer(
        s.tasks_stream, s.tasks_durable, tasks.decoder, handle, nak_delay_s=0.05
    ) as consumer:
        await wait_for(lambda: handled and consumer.num_dead == 1, 20)
        await asyncio.sleep(0.5)  # a wrong term would show as a 4th delivery here
    assert handled == ["0-1"]
    assert [n for task_id, n in attempts if task_id == "0-0"] == [1, 2, 3]
    (dead,) = await bus.dead_letters()
    assert (dead.kind, dead.stream, dead.subject) == ("task", s.tasks_stream, s.tasks)
    assert dead.msg_id == "0-0" and dead.num_delivered == 3 and dead.stream_seq == 1
    assert "ValueError: bad reward function input" in dead.reason
    assert dead.origin == f"worker@{socket.gethostname()}:{os.getpid()}"
    assert dead.time > 0
    assert await bus.dead_letter_count() == 1
    assert (await bus.js.stream_info(s.tasks_stream)).state.messages == 0  # terminated


async def test_a_durable_with_old_settings_is_updated_and_jetstream_never_gives_up(make_bus):
    old = await make_bus(ack_wait_s=50)
    s = old.subjects
    # as an older rlbus left it: a JetStream delivery limit that would drop deferred tasks silently
    config = (await old.js.consumer_info(s.tasks_stream, s.tasks_durable)).config
    config.max_deliver = 6
    await old.js.add_consumer(s.tasks_stream, config)
    assert (await old.js.consumer_info(s.tasks_stream, s.tasks_durable)).config.max_deliver == 6
    new = await make_bus(ack_wait_s=20)  # a restart with new settings updates the durable
    info = await new.js.consumer_info(s.tasks_stream, s.tasks_durable)
    assert (info.config.ack_wait, info.config.max_deliver) == (20, -1)


async def test_deferrals_do_not_drop_a_message_but_count_toward_the_bound(make_bus):
    bus = await make_bus(max_deliver=3)
    s = bus.subjects
    await bus.publish(s.tasks, make_task(0), msg_id="0-0")
    attempts: list[int] = []

    async def handle(delivery):  # defers (like a worker with no replica), then fails
        attempts.append(delivery.num_delivered)
        if delivery.num_delivered <= 4:
            await delivery.nak(0.05)
            return
        raise RuntimeError("broken after all")

    async with bus.consumer(
        s.tasks_stream, s.tasks_durable, tasks.decoder, handle, nak_delay_s=0.05
    ) as consumer:
        await wait_for(lambda: consumer.num_dead == 1, 20)
    assert attempts == [1, 2, 3, 4, 5]  # five deliveries: more than max_deliver, none dropped
    (dead,) = await bus.dead_letters()
    assert dead.num_delivered == 5 and "RuntimeError: broken after all" in dead.reason


async def test_quarantining_the_same_message_twice_stores_it_once(make_bus):
    first = await make_bus(name="trainer")
    second = await make_bus(name="trainer-restarted")  # another process, same bad message
    s = first.subjects
    headers = {"Nats-Msg-Id": "batch-7"}
    for bus in (first, first, second):
        await bus.dead_letter(s.batches_stream, s.batch(7), b"\xc1", headers, "bad batch")
    (dead,) = await first.dead_letters()
    assert (dead.kind, dead.msg_id, dead.subject) == ("batch", "batch-7", s.batch(7))


async def test_garbage_weights_record_is_quarantined_and_the_watch_goes_on(bus, make_bus):
    trainer = await make_bus(name="trainer")
    records = trainer.kv(trainer.subjects.weights_bucket)
    good = weights.WeightsPublished(version=1, transport="filesystem", location="/w/1")
    later = weights.WeightsPublished(version=2, transport="filesystem", location="/w/2")
    seen: list[int] = []

    async def watch():
        kv = bus.kv(bus.subjects.weights_bucket)
        async for entry in kv.watch(WEIGHTS_LATEST_KEY, weights.published_decoder):
            seen.append(entry.value.version)

    with capture_logs() as logs:
        watcher = asyncio.create_task(watch())
        try:
            await records.put(WEIGHTS_LATEST_KEY, good)
            await wait_for(lambda: seen == [1], 10)
            garbage_revision = await records.put(WEIGHTS_LATEST_KEY, b"\xc1 garbage")
            await records.put(WEIGHTS_LATEST_KEY, weights.encoder.encode(later))
            await wait_for(lambda: seen == [1, 2], 10)
            assert not watcher.done()
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
    quarantined = [e for e in logs if e["event"] == "kv_entry_quarantined"]
    assert [e["revision"] for e in quarantined] == [garbage_revision]
    (dead,) = await bus.dead_letters()
    assert (dead.kind, dead.stream_seq) == ("weights-record", garbage_revision)
    assert "DecodeError" in dead.reason


async def test_a_lease_whose_key_expired_in_an_outage_within_grace_recreates_it(bus, make_bus):
    bucket = bus.subjects.replicas_bucket
    lost = asyncio.Event()
    lease = await bus.lease(
        bucket, "r0", b"mine", ttl_s=1, heartbeat_s=0.3, on_lost=lost.set, grace_s=20
    ).acquire()
    lease._task.cancel()  # no heartbeats for longer than the TTL (as in an outage)
    presence = bus.kv(bucket).watch_presence(poll_s=0.2)
    assert await anext(presence) == ("added", "r0")
    assert await asyncio.wait_for(anext(presence), 10) == ("expired", "r0")
    await presence.aclose()
    lease._task = asyncio.create_task(lease._heartbeat())
    await wait_for(lambda: lease.revision is not None and lease.held, 5)
    await asyncio.sleep(1.0)
    entry = await bus.kv(bucket).get("r0")
    assert entry is not None and entry.value == b"mine" and not lost.is_set()
    await lease.release()


async def test_a_lease_out_for_longer_than_its_grace_is_lost(bus):
    bucket = bus.subjects.replicas_bucket
    lost = asyncio.Event()
    lease = await bus.lease(
        bucket, "r1", b"mine", ttl_s=1, heartbeat_s=0.3, on_lost=lost.set, grace_s=0.5
    ).acquire()
    lease._task.cancel()
    await asyncio.sleep(2.5)  # the key expired, and the last good heartbeat is older than grace
    lease._task = asyncio.create_task(lease._heartbeat())
    await asyncio.wait_for(lost.wait(), 5)
    assert not lease.held
