"""Claim-check files on a real nats-server: deleted once their message is consumed, kept while
a dead letter or a resumable step may still need them, and forged paths never read."""

from bus_factories import make_batch, make_task, wait_for

from rlbus.bus.claimcheck import CLAIM_HEADER
from rlbus.wire import tasks
from rlbus.wire.claims import ClaimCheck
from rlbus.wire.claims import encoder as claim_encoder


def big_task(index: int) -> tasks.Task:
    task = make_task(index)
    task.problem.info = {"blob": f"{index}" * 40_000}
    return task


def claim_files(root) -> list:
    return sorted((root / "claims").rglob("*.bin")) if (root / "claims").exists() else []


async def test_an_acked_message_leaves_no_claim_file_and_a_dead_letter_keeps_its_own(
    make_bus, tmp_path
):
    bus = await make_bus(claim_check_bytes=16 * 1024, max_deliver=1)
    s = bus.subjects
    await bus.publish(s.tasks, big_task(0), msg_id="0-0")
    await bus.publish(s.tasks, big_task(1), msg_id="0-1")
    assert len(claim_files(tmp_path)) == 2
    seen = []

    async def handle(delivery):
        if delivery.data.task_id == "0-1":
            raise ValueError("poison")  # quarantined after bus.max_deliver=1
        seen.append(delivery.data.task_id)

    async with bus.consumer(s.tasks_stream, s.tasks_durable, tasks.decoder, handle) as consumer:
        await wait_for(lambda: seen and consumer.num_dead == 1, 20)
    # The acked task's file is gone; the quarantined one's stays for whoever inspects it.
    (kept,) = claim_files(tmp_path)
    dead = await bus.js.get_last_msg(s.dead_stream, s.dead(s.tasks_stream))
    assert bus.decode_payload(dead.data, dead.headers) == (kept.read_bytes())


async def test_a_forged_claim_path_is_quarantined_without_being_read(make_bus, tmp_path):
    bus = await make_bus(max_deliver=1)
    secret = tmp_path / "configs" / "rl.toml"
    secret.parent.mkdir()
    secret.write_text("token = 'x'\n")
    s = bus.subjects
    forged = ClaimCheck(path="claims/../configs/rl.toml", size=secret.stat().st_size, sha256="0")
    await bus.publish(
        s.tasks, claim_encoder.encode(forged), msg_id="forged", headers={CLAIM_HEADER: "1"}
    )
    await bus.publish(s.tasks, make_task(1), msg_id="0-1")
    seen = []

    async def handle(delivery):
        seen.append(delivery.data.task_id)

    async with bus.consumer(s.tasks_stream, s.tasks_durable, tasks.decoder, handle) as consumer:
        await wait_for(lambda: seen and consumer.num_dead == 1, 20)
    assert seen == ["0-1"]
    dead = await bus.js.get_last_msg(s.dead_stream, s.dead(s.tasks_stream))
    assert "'..' is not allowed" in dead.headers["Rlbus-Dead-Reason"]
    assert secret.read_text() == "token = 'x'\n"


async def test_batch_claims_are_deleted_through_the_given_step_only(make_bus, tmp_path):
    bus = await make_bus(claim_check_bytes=16 * 1024)
    for step in (1, 2, 3):
        await bus.step_log.publish(make_batch(step, num_tokens=20_000))
    assert bus.step_log.discard_claims(2) == [bus.subjects.batch(1), bus.subjects.batch(2)]
    assert [p.parent.name for p in claim_files(tmp_path)] == [bus.subjects.batch(3)]
    assert (await bus.step_log.get(3, timeout_s=2)).step == 3
