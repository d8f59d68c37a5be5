"""The bus under failure: dead consumers, a killed server, corrupt claim checks, poison messages,
expired leases, wrong credentials."""

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from bus_factories import make_batch, make_task, wait_for

from rlbus.bus import Bus, BusAuthError, LeaseHeld
from rlbus.bus.errors import PoisonBatch
from rlbus.configs.bus import BusConfig
from rlbus.wire import tasks
from rlbus_launch.natsserver import NatsServer

DYING_WORKER = textwrap.dedent(
    """
    import asyncio, sys, pathlib
    from rlbus.bus import Bus
    from rlbus.configs.bus import BusConfig
    from rlbus.wire import tasks

    async def main(url, run_id, marker):
        bus = await Bus.connect(BusConfig(url=url, ack_wait_s=2), run_id=run_id, name="dying-worker")
        async def handle(delivery):
            pathlib.Path(marker).write_text(delivery.data.task_id)
            await asyncio.sleep(3600)   # never acks: killed with -9 while "working"
        s = bus.subjects
        await bus.consumer(s.tasks_stream, s.tasks_durable, tasks.decoder, handle).run()

    asyncio.run(main(*sys.argv[1:]))
    """
)


async def test_task_of_a_killed_worker_is_redelivered_to_another_worker(make_bus, tmp_path):
    bus = await make_bus(ack_wait_s=2)
    marker = tmp_path / "taken"
    worker = subprocess.Popen(
        [sys.executable, "-c", DYING_WORKER, bus.config.url, bus.subjects.run_id, str(marker)],
        start_new_session=True,
    )
    try:
        await bus.publish(bus.subjects.tasks, make_task(0), msg_id="0-0")
        await wait_for(marker.exists, 20)
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    received = asyncio.get_running_loop().create_future()

    async def handle(delivery):
        if not received.done():
            received.set_result((delivery.data.task_id, delivery.num_delivered))

    s = bus.subjects
    async with bus.consumer(s.tasks_stream, s.tasks_durable, tasks.decoder, handle):
        task_id, num_delivered = await asyncio.wait_for(received, 10)
    assert marker.read_text() == task_id == "0-0"
    assert num_delivered == 2


async def test_long_handler_is_kept_alive_by_in_progress_heartbeats(make_bus):
    bus = await make_bus(ack_wait_s=1.5)  # heartbeats every 0.5 s: slack for a loaded machine
    await bus.publish(bus.subjects.tasks, make_task(0), msg_id="0-0")
    deliveries = []

    async def slow(delivery):
        deliveries.append(delivery.num_delivered)
        await asyncio.sleep(4.0)  # > 2.5x AckWait

    s = bus.subjects
    async with bus.consumer(s.tasks_stream, s.tasks_durable, tasks.decoder, slow, concurrency=2):
        await wait_for(lambda: deliveries, 5)
        await asyncio.sleep(4.5)
    assert deliveries == [1]


async def test_killed_server_restarted_on_same_store_loses_no_message(nats_server, make_bus):
    num_messages = 1500
    publisher = await make_bus(name="publisher", publish_timeout_s=1.0)
    consumer_bus = await make_bus(name="consumer")
    received: list[str] = []

    async def handle(delivery):
        received.append(delivery.msg_id)

    async def publish_all():
        for index in range(num_messages):
            await publisher.publish(publisher.subjects.tasks, make_task(index), msg_id=f"0-{index}")

    s = consumer_bus.subjects
    async with consumer_bus.consumer(
        s.tasks_stream, s.tasks_durable, tasks.decoder, handle, concurrency=16
    ):
        publishing = asyncio.create_task(publish_all())
        await wait_for(lambda: len(received) >= num_messages // 3, 30)
        nats_server.kill()
        await asyncio.sleep(0.5)
        await asyncio.to_thread(nats_server.start)
        await asyncio.wait_for(publishing, 60)
        await wait_for(lambda: set(received) >= {f"0-{i}" for i in range(num_messages)}, 60)
    num_duplicates = len(received) - len(set(received))
    print(f"delivered {len(received)} for {num_messages} ids ({num_duplicates} duplicates)")
    assert set(received) == {f"0-{i}" for i in range(num_messages)}


async def test_corrupted_claim_check_is_detected(make_bus, tmp_path):
    bus = await make_bus(claim_check_bytes=16 * 1024)
    await bus.step_log.publish(make_batch(1, num_tokens=20_000))
    (claim_file,) = (tmp_path / "claims").rglob("*.bin")
    data = bytearray(claim_file.read_bytes())
    data[100] ^= 0xFF
    claim_file.write_bytes(bytes(data))
    # The step log names the step and keeps the stored bytes, for the trainer to dead-letter.
    with pytest.raises(PoisonBatch, match="step 1 .*ClaimCheckError.*sha256") as poison:
        await bus.step_log.get(1, timeout_s=2)
    assert poison.value.step == 1 and poison.value.data


async def test_corrupted_claim_check_message_goes_to_dead_letter(make_bus, tmp_path):
    bus = await make_bus(claim_check_bytes=16 * 1024)
    big = make_task(0)
    big.problem.info = {"blob": "x" * 40_000}
    await bus.publish(bus.subjects.tasks, big, msg_id="0-0")
    (claim_file,) = (tmp_path / "claims").rglob("*.bin")
    claim_file.write_bytes(claim_file.read_bytes()[:-10])
    await bus.publish(bus.subjects.tasks, make_task(1), msg_id="0-1")
    seen = []

    async def handle(delivery):
        seen.append(delivery.data.task_id)

    s = bus.subjects
    async with bus.consumer(s.tasks_stream, s.tasks_durable, tasks.decoder, handle) as consumer:
        await wait_for(lambda: seen, 10)
    assert seen == ["0-1"] and consumer.num_dead == 1
    dead = await bus.js.get_last_msg(s.dead_stream, s.dead(s.tasks_stream))
    assert "ClaimCheckError" in dead.headers["Rlbus-Dead-Reason"]


async def test_undecodable_message_goes_to_dead_letter_and_next_is_handled(bus):
    s = bus.subjects
    await bus.publish(s.tasks, b"\xc1 not msgpack", msg_id="poison")
    await bus.publish(s.tasks, make_task(1), msg_id="0-1")
    seen = []

    async def handle(delivery):
        seen.append(delivery.data.task_id)

    async with bus.consumer(s.tasks_stream, s.tasks_durable, tasks.decoder, handle) as consumer:
        await wait_for(lambda: seen, 10)
    assert seen == ["0-1"] and consumer.num_dead == 1
    dead = await bus.js.get_last_msg(s.dead_stream, s.dead(s.tasks_stream))
    assert dead.data == b"\xc1 not msgpack"
    assert dead.headers["Rlbus-Dead-Msg-Id"] == "poison"
    assert dead.headers["Rlbus-Dead-Subject"] == s.tasks
    await asyncio.sleep(0.2)
    assert (
        await bus.js.stream_info(s.tasks_stream)
    ).state.messages == 0  # terminated, not redelivered


async def test_lease_stays_alive_while_heartbeating_past_several_ttls(bus):
    bucket = bus.subjects.replicas_bucket
    async with bus.lease(bucket, "r0", b"info", ttl_s=1, heartbeat_s=0.3) as lease:
        await asyncio.sleep(3.5)
        assert lease.held
        assert (await bus.kv(bucket).get("r0")).value == b"info"
        with pytest.raises(LeaseHeld):
            await bus.lease(bucket, "r0", b"other", ttl_s=1).acquire()


async def test_lease_expires_when_its_holder_stops_heartbeating(bus, make_bus):
    bucket = bus.subjects.replicas_bucket
    lost = asyncio.Event()
    lease = await bus.lease(
        bucket, "r0", b"info", ttl_s=1, heartbeat_s=0.3, on_lost=lost.set
    ).acquire()
    presence = bus.kv(bucket).watch_presence(poll_s=0.2)
    assert await anext(presence) == ("added", "r0")
    lease._task.cancel()  # the holder hangs: no more heartbeats
    assert await asyncio.wait_for(anext(presence), 10) == ("expired", "r0")
    other = await make_bus(name="other")
    async with other.lease(bucket, "r0", b"new holder", ttl_s=5):
        # the old holder finds out at its next heartbeat
        lease._task = asyncio.create_task(lease._heartbeat())
        await asyncio.wait_for(lost.wait(), 5)
        assert not lease.held
        assert (await bus.kv(bucket).get("r0")).value == b"new holder"
    await presence.aclose()


@pytest.fixture
def nats_server_with_token(tmp_path):
    server = NatsServer(tmp_path / "nats-auth", token="s3cret").start()
    try:
        yield server
    finally:
        server.kill()


async def test_wrong_token_fails_with_a_clear_error(nats_server_with_token):
    config = BusConfig(url=nats_server_with_token.url, connect_retry_s=5).with_secrets(
        token="wrong"
    )
    started = time.monotonic()
    with pytest.raises(BusAuthError, match="bus.token"):
        await Bus.connect(config, run_id="auth")
    assert time.monotonic() - started < 3  # not retried like an absent server


async def test_right_token_connects(nats_server_with_token, tmp_path):
    config = BusConfig(url=nats_server_with_token.url).with_secrets(token="s3cret")
    bus = await Bus.connect(config, run_id="auth", storage_dir=tmp_path)
    try:
        ack = await bus.publish(bus.subjects.tasks, make_task(0), msg_id="0-0")
        assert ack.seq == 1
    finally:
        await bus.close()


async def test_server_restarted_on_an_empty_store_gets_the_topology_back(nats_server, make_bus):

    bus = await make_bus()
    nats_server.kill()
    shutil.rmtree(nats_server.store_dir / "jetstream")
    await asyncio.to_thread(nats_server.start)
    ack = await asyncio.wait_for(bus.publish(bus.subjects.tasks, make_task(0), msg_id="0-0"), 20)
    assert ack.stream == bus.subjects.tasks_stream
    seen = []

    async def handle(delivery):
        seen.append(delivery.data.task_id)

    s = bus.subjects
    async with bus.consumer(s.tasks_stream, s.tasks_durable, tasks.decoder, handle):
        await wait_for(lambda: seen, 10)
    assert seen == ["0-0"]
    await wait_for(lambda: not bus._background, 10)
    assert (await bus.kv(s.weights_bucket).keys()) == []  # buckets are back too


async def test_user_password_auth_right_and_wrong(tmp_path):
    server = NatsServer(tmp_path / "nats-user", user="rl", password="pw").start()
    try:
        with pytest.raises(BusAuthError, match="bus.user"):
            await Bus.connect(
                BusConfig(url=server.url, user="rl").with_secrets(password="nope"), run_id="auth"
            )
        bus = await Bus.connect(
            BusConfig(url=server.url, user="rl").with_secrets(password="pw"), run_id="auth"
        )
        await bus.close()
    finally:
        server.kill()


def make_tls_files(directory) -> dict[str, str]:
    """A CA and a server certificate for 127.0.0.1, made with the openssl command."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = {name: str(directory / f"{name}.pem") for name in ("ca", "ca_key", "cert", "key")}
    csr, ext = directory / "server.csr", directory / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    run = lambda *args: subprocess.run(["openssl", *args], check=True, capture_output=True)  # noqa: E731
    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=rlbus-test-ca",
        "-keyout",
        paths["ca_key"],
        "-out",
        paths["ca"],
    )
    run(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        paths["key"],
        "-out",
        str(csr),
    )
    run(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        paths["ca"],
        "-CAkey",
        paths["ca_key"],
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        str(ext),
        "-out",
        paths["cert"],
    )
    return paths


async def test_tls_connection_verifies_the_server_with_the_ca(tmp_path):
    if not shutil.which("openssl"):
        pytest.skip("openssl command not available")
    files = make_tls_files(tmp_path / "tls")
    server = NatsServer(tmp_path / "nats-tls", tls_cert=files["cert"], tls_key=files["key"]).start()
    try:
        bus = await Bus.connect(BusConfig(url=server.url, tls_ca=files["ca"]), run_id="tls")
        assert (await bus.publish(bus.subjects.tasks, make_task(0), msg_id="0-0")).seq == 1
        await bus.close()
    finally:
        server.kill()
