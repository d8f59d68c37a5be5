"""Lease.update racing the heartbeat must not make a live lease look lost (seen in the e2e run:
the inference replica died with 'wrong last sequence' right after applying weights)."""

import asyncio


async def test_updates_concurrent_with_heartbeats_keep_the_lease(bus):
    async with bus.lease(
        bus.subjects.replicas_bucket, "replica", b"v0", ttl_s=1, heartbeat_s=0.01
    ) as lease:
        for round_ in range(20):
            await asyncio.gather(*(lease.update(f"v{round_}-{i}".encode()) for i in range(5)))
            await asyncio.sleep(0.01)
        assert lease.held and not lease.lost.is_set()
