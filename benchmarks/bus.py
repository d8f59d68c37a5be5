"""Publish + consume throughput: rlbus's bus layer vs a bare nats-py loop, same server, same sizes.

    uv run python benchmarks/bus.py [--url nats://...] [--sizes 1024,65536,1048576]

Both sides publish msgpack-encoded payloads one by one with a JetStream ack per message, each with
a `Nats-Msg-Id` header (the bus always sends one, and server-side dedup has a cost of its own; the
`bare, no id` column shows plain `js.publish` for reference), into a work-queue stream, then consume them all with a durable pull consumer (bare: fetch(64) + decode + ack;
bus: `bus.consumer(..., concurrency=64)` + decode + auto-ack). Printed as messages/s, MB/s and
the ratio bus / bare (target >= 0.8). The `pub_many` row is `bus.publish_many` (pipelined, acks
collected at the end) against the same bare one-by-one loop.
"""

import argparse
import asyncio
import tempfile
import time
import uuid

import msgspec
import nats
import structlog
from nats.js import api

from rlbus.bus import Bus
from rlbus.configs.bus import BusConfig
from rlbus_launch.natsserver import NatsServer

COUNTS = {1024: 4000, 64 * 1024: 1500, 1024 * 1024: 150}
DECODER = msgspec.msgpack.Decoder(bytes)


async def bare_round(url: str, size: int, count: int) -> tuple[float, float, float]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    stream, subject = f"BARE_{uuid.uuid4().hex[:6]}", f"bare.{uuid.uuid4().hex[:6]}"
    await js.add_stream(name=stream, subjects=[subject], retention=api.RetentionPolicy.WORK_QUEUE)
    payload = msgspec.msgpack.encode(b"x" * size)
    start = time.perf_counter()
    for _ in range(count):
        await js.publish(subject, payload)
    no_id_s = time.perf_counter() - start
    await js.purge_stream(stream)
    start = time.perf_counter()
    for index in range(count):
        await js.publish(subject, payload, headers={"Nats-Msg-Id": str(index)})
    publish_s = time.perf_counter() - start
    sub = await js.pull_subscribe(subject, durable="bench", stream=stream)
    received = 0
    start = time.perf_counter()
    while received < count:
        try:
            msgs = await sub.fetch(64, timeout=1)
        except (TimeoutError, nats.errors.TimeoutError):
            continue
        for msg in msgs:
            DECODER.decode(msg.data)
            await msg.ack()
            received += 1
    consume_s = time.perf_counter() - start
    await js.delete_stream(stream)
    await nc.close()
    return publish_s, consume_s, no_id_s


async def bus_round(url: str, size: int, count: int, storage: str) -> tuple[float, float, float]:
    bus = await Bus.connect(
        BusConfig(url=url), run_id=f"bench_{uuid.uuid4().hex[:6]}", storage_dir=storage
    )
    s = bus.subjects
    payload = msgspec.msgpack.encode(b"x" * size)
    start = time.perf_counter()
    for index in range(count):
        await bus.publish(s.tasks, payload, msg_id=str(index))
    publish_s = time.perf_counter() - start
    await bus.js.purge_stream(s.tasks_stream)
    start = time.perf_counter()
    await bus.publish_many([(s.tasks, payload, f"many-{index}") for index in range(count)])
    many_s = time.perf_counter() - start
    done = asyncio.Event()
    received = 0

    async def handle(delivery) -> None:
        nonlocal received
        received += 1
        if received == count:
            done.set()

    start = time.perf_counter()
    async with bus.consumer(s.tasks_stream, s.tasks_durable, DECODER, handle, concurrency=64):
        await done.wait()
        consume_s = time.perf_counter() - start
    for stream in s.streams():
        await bus.js.delete_stream(stream.name)
    await bus.close()
    return publish_s, consume_s, many_s


def rate_line(
    label: str, size: int, count: int, bare_s: float, bus_s: float, no_id_s: float | None
) -> str:
    bare_rate, bus_rate = count / bare_s, count / bus_s
    no_id = f"{count / no_id_s:>13.0f}" if no_id_s else " " * 13
    return (
        f"| {label:<7} | {size // 1024:>5} KiB | {count:>5} | {no_id} | {bare_rate:>10.0f} | "
        f"{bare_rate * size / 1e6:>9.1f} | {bus_rate:>9.0f} | {bus_rate * size / 1e6:>8.1f} | {bus_rate / bare_rate:>5.2f}x |"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="existing nats-server (default: start an embedded one)")
    parser.add_argument(
        "--sizes", default=",".join(map(str, COUNTS)), help="payload sizes in bytes"
    )
    parser.add_argument("--repeat", type=int, default=3, help="rounds per side (best is kept)")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    storage = tempfile.mkdtemp(prefix="rlbus-bench-")
    server = None if args.url else NatsServer(f"{storage}/nats").start()
    url = args.url or server.url
    try:
        print(
            "| phase   |      size | count | bare, no id/s | bare msg/s | bare MB/s | bus msg/s | bus MB/s | ratio |"
        )
        print(
            "| ------- | --------- | ----- | ------------- | ---------- | --------- | --------- | -------- | ----- |"
        )
        for size in map(int, args.sizes.split(",")):
            count = COUNTS.get(size, 1000)
            bare, ours = [], []
            for _ in range(args.repeat):  # interleaved, best kept: the machine is shared and noisy
                ours.append(await bus_round(url, size, count, storage))
                bare.append(await bare_round(url, size, count))
            best_bare = [min(b[i] for b in bare) for i in range(3)]
            best_ours = [min(o[i] for o in ours) for i in range(3)]
            print(rate_line("publish", size, count, best_bare[0], best_ours[0], best_bare[2]))
            print(rate_line("consume", size, count, best_bare[1], best_ours[1], None))
            print(rate_line("pub_many", size, count, best_bare[0], best_ours[2], None))
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    asyncio.run(main())
