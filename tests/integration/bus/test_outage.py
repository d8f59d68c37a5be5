"""A NATS outage ridden out (real nats-server): SIGSTOP for 9 s, then a SIGKILL and a restart on the
same port and store 20 s later. A consumer, a publisher, a KV watcher and a lease all carry on; no
message is lost, and none is duplicated beyond at-least-once redelivery."""

import asyncio
import os
import signal

import pytest
from bus_factories import make_task, wait_for

from rlbus.wire import tasks

STOPPED_S = 9.0
DOWN_S = 20.0


@pytest.mark.slow  # about a minute of outages
@pytest.mark.timeout(300)
async def test_consumer_publisher_watcher_and_lease_ride_out_a_stop_and_a_kill(
    nats_server, make_bus
):
    publisher = await make_bus(name="publisher", publish_timeout_s=1.0)
    consumer_bus = await make_bus(name="consumer")
    watcher_bus = await make_bus(name="watcher")
    holder = await make_bus(name="holder")
    s = publisher.subjects
    received: list[str] = []
    published: list[str] = []
    seen_versions: list[int] = []
    seen_revisions: list[int] = []
    written_versions: list[int] = []
    lost = asyncio.Event()
    stop_publishing = asyncio.Event()

    async def handle(delivery):
        received.append(delivery.msg_id)

    async def publish_all():
        index = 0
        while not stop_publishing.is_set():
            await publisher.publish(s.tasks, make_task(index), msg_id=f"0-{index}")
            published.append(f"0-{index}")
            index += 1
            await asyncio.sleep(0.02)

    async def write_versions():
        records = publisher.kv(s.weights_bucket)
        version = 0
        while not stop_publishing.is_set():
            version += 1
            await records.put("latest", str(version).encode())
            written_versions.append(version)
            await asyncio.sleep(0.5)

    async def watch():
        async for entry in watcher_bus.kv(s.weights_bucket).watch("latest"):
            seen_versions.append(int(entry.value))
            seen_revisions.append(entry.revision)

    lease = holder.lease(
        s.replicas_bucket, "r0", b"replica r0", ttl_s=3, heartbeat_s=1.0, on_lost=lost.set
    )
    async with (
        consumer_bus.consumer(
            s.tasks_stream, s.tasks_durable, tasks.decoder, handle, concurrency=8
        ),
        lease,
    ):
        background = [
            asyncio.create_task(publish_all()),
            asyncio.create_task(write_versions()),
            asyncio.create_task(watch()),
        ]
        try:
            await wait_for(lambda: len(received) >= 50 and seen_versions, 30)
            os.kill(nats_server.pid, signal.SIGSTOP)
            await asyncio.sleep(STOPPED_S)
            os.kill(nats_server.pid, signal.SIGCONT)
            count = len(received)
            await wait_for(lambda: len(received) > count + 50, 60)
            nats_server.kill()
            await asyncio.sleep(DOWN_S)
            await asyncio.to_thread(nats_server.start)
            count = len(received)
            await wait_for(lambda: len(received) > count + 50, 60)
            stop_publishing.set()
            await asyncio.wait_for(asyncio.gather(*background[:2]), 60)
            await wait_for(lambda: set(received) >= set(published), 60)
            await wait_for(lambda: seen_versions and seen_versions[-1] == written_versions[-1], 30)
            assert not background[2].done(), "the watch ended"
            assert lease.held and not lost.is_set()
            entry = await watcher_bus.kv(s.replicas_bucket).get("r0")
            assert entry is not None and entry.value == b"replica r0"
        finally:
            stop_publishing.set()
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
    # No revision twice, versions never backwards (a put retried after a lost ack may store the
    # same version twice: two revisions, both yielded).
    assert seen_revisions == sorted(set(seen_revisions))
    assert seen_versions == sorted(seen_versions)
    duplicates = len(received) - len(set(received))
    print(f"published {len(published)}, delivered {len(received)} ({duplicates} redelivered)")
    assert set(received) == set(published)
