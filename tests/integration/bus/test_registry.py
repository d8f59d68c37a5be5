"""`Bus.read_replicas`: the one reader of the inference replica registry, on a real nats-server."""

import asyncio

from structlog.testing import capture_logs

from rlbus.wire import replicas


def info(replica_id: str, version: int = 0) -> replicas.ReplicaInfo:
    return replicas.ReplicaInfo(
        replica_id=replica_id,
        base_url=f"http://{replica_id}/v1",
        model="m",
        weights_version=version,
    )


async def test_empty_registry_reads_as_no_replicas(bus):
    assert await bus.read_replicas() == []


async def test_registered_leases_are_read_decoded(bus, make_bus):
    replica_bus = await make_bus(name="inference")
    bucket = replica_bus.subjects.replicas_bucket
    async with (
        replica_bus.lease(bucket, "a", replicas.encoder.encode(info("a", 3)), ttl_s=5),
        replica_bus.lease(bucket, "b", info("b", 4), ttl_s=5),
    ):
        found = sorted(await bus.read_replicas(), key=lambda i: i.replica_id)
        assert [(i.replica_id, i.weights_version, i.base_url) for i in found] == [
            ("a", 3, "http://a/v1"),
            ("b", 4, "http://b/v1"),
        ]
    assert await bus.read_replicas() == []  # released leases leave the registry


async def test_a_garbage_entry_is_skipped_and_quarantined_once_not_fatal(bus):
    registry = bus.kv(bus.subjects.replicas_bucket)
    await registry.put("good", info("good", 2))
    await registry.put("garbage", b"\xc1 not msgpack")
    await registry.put("wrong-shape", replicas.encoder.encode({"replica_id": 7}))
    with capture_logs() as logs:
        found = await bus.read_replicas()
        again = await bus.read_replicas()  # polled again: no second dead letter, no second line
    assert [(i.replica_id, i.weights_version) for i in found] == [("good", 2)]
    assert [i.replica_id for i in again] == ["good"]
    skipped = sorted(e["key"] for e in logs if e["event"] == "kv_entry_quarantined")
    assert skipped == ["garbage", "wrong-shape"]
    dead = await bus.dead_letters()
    assert sorted(d.subject for d in dead) == [
        f"$KV.{bus.subjects.replicas_bucket}.garbage",
        f"$KV.{bus.subjects.replicas_bucket}.wrong-shape",
    ]
    assert {d.kind for d in dead} == {"replica-entry"}


async def test_an_expired_lease_drops_out(bus):
    lease = await bus.lease(
        bus.subjects.replicas_bucket, "r0", info("r0"), ttl_s=1, heartbeat_s=0.3
    ).acquire()
    assert [i.replica_id for i in await bus.read_replicas()] == ["r0"]
    lease._task.cancel()  # the holder hangs: the TTL runs out
    for _ in range(50):
        if not await bus.read_replicas():
            break
        await asyncio.sleep(0.2)
    assert await bus.read_replicas() == []
