"""The RL trainer over a real nats-server: trains bus batches, checkpoints, publishes weights,
survives kill -9 + --resume without training a step twice or skipping one."""

import asyncio
import os
import shutil
import signal
import time

import pytest
from msgspec.structs import replace
from trainer_support import (
    descendants,
    is_alive,
    kill_tree,
    make_train_batch,
    make_trainer_config,
    start_ranks,
    wait_ranks,
)
from transformers import AutoModelForCausalLM

from rlbus.checksums import sha256_file
from rlbus.wire import events, weights
from rlbus.wire.subjects import WEIGHTS_LATEST_KEY
from rlbus_trainer.ckpt import complete_steps
from rlbus_trainer.tiny_model import build_tiny_model


async def read_stream(bus, subject: str, stream: str) -> list:
    """Every message stored on `subject` (oldest first)."""
    sub = await bus.js.pull_subscribe(subject, stream=stream)
    out = []
    while True:
        try:
            msgs = await sub.fetch(100, timeout=1)
        except (TimeoutError, Exception):
            break
        out += msgs
    await sub.unsubscribe()
    return out


async def read_step_metrics(bus) -> list[events.StepMetrics]:
    msgs = await read_stream(bus, bus.subjects.metrics("trainer"), bus.subjects.events_stream)
    return [events.decoder.decode(m.data) for m in msgs]


async def published_versions(bus) -> list[int]:
    """Versions in the order the trainer announced them (weights-published events)."""
    stream = await bus.js.find_stream_name_by_subject(bus.subjects.weights_published)
    msgs = await read_stream(bus, bus.subjects.weights_published, stream)
    return [weights.published_decoder.decode(m.data).version for m in msgs]


async def metrics_reached(bus, step: int) -> bool:
    return any(m.step >= step for m in await read_step_metrics(bus))


async def wait_until(predicate, timeout_s=240.0):
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


async def ranks_exit(*args, **kwargs) -> None:
    """`wait_ranks` on a thread: the test's NATS client keeps answering meanwhile (a blocked
    event loop for a whole trainer run stalls its connection)."""
    await asyncio.to_thread(wait_ranks, *args, **kwargs)


async def is_none(awaitable) -> bool:
    return await awaitable is None


async def trainer_run(make_bus, nats_server, tmp_path, name: str, **overrides):
    """(a client bus, the trainer config) of a fresh run on the tiny model."""
    model = build_tiny_model(tmp_path / "tiny")
    bus = await make_bus()
    bus_cfg = {"url": nats_server.url, "token": nats_server.token, "run_id": bus.subjects.run_id}
    return bus, make_trainer_config(model, tmp_path / "out", name, bus_cfg, **overrides)


@pytest.mark.slow
async def test_trainer_trains_checkpoints_publishes_and_resumes_after_kill(
    make_bus, nats_server, tmp_path
):
    bus, config = await trainer_run(
        make_bus,
        nats_server,
        tmp_path,
        "rl",
        max_steps=6,
        ckpt={"interval": 2, "keep_last": 2},
        weight_broadcast={"keep_last": 2},
    )
    run_dir = tmp_path / "out" / "rl"
    for step in (1, 2, 3):
        await bus.step_log.publish(make_train_batch(step))

    proc = start_ranks(tmp_path, config, 1, "trainer")
    try:
        await wait_until(lambda: asyncio.sleep(0, 2 in complete_steps(run_dir)))
        await wait_until(lambda: asyncio.sleep(0, (run_dir / "broadcasts" / "step_3").exists()))
        # step metrics go out after the weights publish: wait for them before the kill
        await wait_until(lambda: metrics_reached(bus, 3))
        assert descendants(proc.pid), "no rank processes under torchrun"
    finally:
        kill_tree(proc)  # kill -9 while it waits for step 4, which is not published yet
    first = await read_step_metrics(bus)
    assert [m.step for m in first] == [1, 2, 3]
    assert await bus.run_finished() is None  # killed at step 3 of 6: not finished

    # A finished record left from before (a run extended with more steps) is cleared at start,
    # so no --exit-when-finished service stops while steps are left.
    await bus.mark_finished(3)
    config["resume"] = {}
    proc = start_ranks(tmp_path, config, 1, "trainer")
    try:
        await wait_until(lambda: is_none(bus.run_finished()))
        for step in (4, 5, 6):
            await bus.step_log.publish(make_train_batch(step))
        await bus.step_log.publish(make_train_batch(2))  # a repeat of a trained step: no-op
    except BaseException:
        kill_tree(proc)
        raise
    await ranks_exit(tmp_path, proc, config, "trainer", timeout_s=300)
    assert (await bus.run_finished()).last_step == 6

    metrics = await read_step_metrics(bus)
    steps = [m.step for m in metrics]
    # Resumed from checkpoint 2: step 3 is retrained from the same state, nothing else repeats.
    assert steps == [1, 2, 3, 3, 4, 5, 6]
    last = metrics[-1].metrics
    for key in (
        "loss",
        "entropy",
        "mismatch_kl",
        "masked_low_frac",
        "masked_high_frac",
        "grad_norm",
        "lr",
        "tokens_per_s",
        "peak_memory_gb",
        "wait_s",
        "forward_backward_s",
        "optimizer_s",
        "publish_s",
    ):
        assert key in last, key
    assert metrics[2].metrics["loss"] == pytest.approx(metrics[3].metrics["loss"], rel=1e-5)
    assert complete_steps(run_dir) == [4, 6]

    entry = await bus.kv(bus.subjects.weights_bucket).get(
        WEIGHTS_LATEST_KEY, weights.published_decoder
    )
    published = entry.value
    assert published.version == 6 and published.transport == "filesystem"
    location = tmp_path / "out" / "rl" / "broadcasts" / "step_6"
    assert os.path.samefile(published.location, location)
    for f in published.files:
        assert sha256_file(location / f.name) == f.sha256
    assert sorted(p.name for p in (run_dir / "broadcasts").iterdir()) == ["step_5", "step_6"]
    AutoModelForCausalLM.from_pretrained(location)


async def read_lifecycle(bus) -> list[events.Lifecycle]:
    sub = await bus.js.pull_subscribe(
        bus.subjects.lifecycle("trainer"), stream=bus.subjects.events_stream
    )
    try:
        msgs = await sub.fetch(10, timeout=2)
    finally:
        await sub.unsubscribe()
    return [events.decoder.decode(m.data) for m in msgs]


@pytest.mark.slow
async def test_a_drain_request_ends_the_trainer_after_the_step_in_hand_with_exit_0(
    make_bus, nats_server, tmp_path
):
    from rlbus.wire import control

    bus, config = await trainer_run(make_bus, nats_server, tmp_path, "drain", max_steps=None)
    for step in (1, 2):
        await bus.step_log.publish(make_train_batch(step))

    proc = start_ranks(tmp_path, config, 1, "trainer")
    try:
        await wait_until(lambda: metrics_reached(bus, 2))
        reply = await bus.request("trainer", control.Drain(reason="test"), timeout_s=10)
        assert reply.ok and reply.state == "draining"
        refused = await bus.request("trainer", control.Pause(), timeout_s=10)
        assert not refused.ok and "not supported" in refused.message
    except BaseException:
        kill_tree(proc)
        raise
    await ranks_exit(tmp_path, proc, config, "trainer", timeout_s=60)

    stopped = [e for e in await read_lifecycle(bus) if e.state == "stopped"]
    assert [e.reason for e in stopped] == ["control drain: test"]
    assert [m.step for m in await read_step_metrics(bus)] == [1, 2]


@pytest.mark.slow
async def test_a_stop_request_leaves_no_checkpoint_nor_weights_for_the_step_in_hand(
    make_bus, nats_server, tmp_path
):
    from rlbus.wire import control

    bus, config = await trainer_run(
        make_bus, nats_server, tmp_path, "stop", max_steps=None, ckpt={"interval": 1}
    )
    run_dir = tmp_path / "out" / "stop"
    await bus.step_log.publish(make_train_batch(1))

    proc = start_ranks(tmp_path, config, 1, "trainer")
    try:
        await wait_until(lambda: metrics_reached(bus, 1))
        # The Stop lands while step 2 is polled or trained (which one is timing): either way
        # step 2 must leave no checkpoint, no weights and no metrics.
        await bus.step_log.publish(make_train_batch(2))
        reply = await bus.request("trainer", control.Stop(reason="test"), timeout_s=10)
        assert reply.ok and reply.state == "stopping"
    except BaseException:
        kill_tree(proc)
        raise
    await ranks_exit(tmp_path, proc, config, "trainer", timeout_s=60)

    assert [m.step for m in await read_step_metrics(bus)] == [1]
    assert complete_steps(run_dir) == [1]
    assert not (run_dir / "broadcasts" / "step_2").exists()
    entry = await bus.kv(bus.subjects.weights_bucket).get(
        WEIGHTS_LATEST_KEY, weights.published_decoder
    )
    assert entry.value.version == 1


@pytest.mark.slow
async def test_a_trainer_started_again_with_its_original_command_continues_the_run(
    make_bus, nats_server, tmp_path
):
    """No `resume` in the config (what `rl`, compose and SLURM restart with): the trainer resumes
    from its newest checkpoint, retrains up to the bus's version without publishing it again, and
    once the checkpoints are gone it refuses (exit != 0, one line) instead of starting over."""
    bus, config = await trainer_run(
        make_bus,
        nats_server,
        tmp_path,
        "again",
        max_steps=6,
        ckpt={"interval": 2, "keep_last": 2},
    )
    assert "resume" not in config
    run_dir = tmp_path / "out" / "again"
    for step in (1, 2, 3):
        await bus.step_log.publish(make_train_batch(step))
    proc = start_ranks(tmp_path, config, 1, "trainer")
    try:
        await wait_until(lambda: metrics_reached(bus, 3))
    finally:
        kill_tree(proc)
    assert complete_steps(run_dir) == [2]

    for step in (4, 5, 6):
        await bus.step_log.publish(make_train_batch(step))
    await ranks_exit(
        tmp_path, start_ranks(tmp_path, config, 1, "trainer"), config, "trainer", timeout_s=300
    )
    metrics = await read_step_metrics(bus)
    # Checkpoint 2's metrics were on the bus before the kill: they are not sent again.
    assert [m.step for m in metrics] == [1, 2, 3, 3, 4, 5, 6]
    assert not any(m.metrics.get("replayed") for m in metrics)
    assert [m.metrics.get("retrained", 0.0) for m in metrics] == [0, 0, 0, 1.0, 0, 0, 0]
    assert metrics[2].metrics["loss"] == pytest.approx(metrics[3].metrics["loss"], rel=1e-5)
    # Version 3 was on the bus before the kill: it is never announced a second time.
    assert await published_versions(bus) == [1, 2, 3, 4, 5, 6]
    log_text = (tmp_path / "trainer-again.log").read_text()
    assert "trainer_resumed" in log_text and "latest_checkpoint" in log_text

    # Killed between checkpoint 6 and its publish and metrics: the bus says version 5 and has
    # no metrics for 6. Version 6 is published right after loading (the orchestrator would wait
    # for it forever) and checkpoint 6's saved metrics are sent, marked `replayed`.
    kv = bus.kv(bus.subjects.weights_bucket)
    entry = await kv.get(WEIGHTS_LATEST_KEY, weights.published_decoder)
    await kv.put(WEIGHTS_LATEST_KEY, weights.encoder.encode(replace(entry.value, version=5)))
    await bus.js.purge_stream(bus.subjects.events_stream, subject=bus.subjects.metrics("trainer"))
    await ranks_exit(
        tmp_path, start_ranks(tmp_path, config, 1, "trainer"), config, "trainer", timeout_s=300
    )
    entry = await kv.get(WEIGHTS_LATEST_KEY, weights.published_decoder)
    assert entry.value.version == 6
    replayed = await read_step_metrics(bus)
    assert [(m.step, m.metrics.get("replayed")) for m in replayed] == [(6, 1.0)]
    assert replayed[0].metrics["loss"] == metrics[-1].metrics["loss"]

    shutil.rmtree(run_dir / "checkpoints")
    config["max_steps"] = 8
    proc = start_ranks(tmp_path, config, 1, "trainer")
    try:
        rc = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    log_text = (tmp_path / "trainer-again.log").read_text()
    assert rc != 0, log_text[-3000:]
    assert "exitcode  : 2" in log_text or "exitcode: 2" in log_text, log_text[-3000:]
    refusal = [line for line in log_text.splitlines() if "trainer_cannot_resume" in line]
    assert len(refusal) == 1, log_text[-3000:]
    assert "weights version 6" in refusal[0] and str(run_dir / "checkpoints") in refusal[0]
    versions = await published_versions(
        bus
    )  # the re-announce of 6 may fall out of the dedup window
    assert versions[:6] == [1, 2, 3, 4, 5, 6] and set(versions[6:]) <= {6}


@pytest.mark.slow
async def test_poison_batches_are_quarantined_and_their_steps_skipped(
    make_bus, nats_server, tmp_path
):
    """Undecodable bytes at batches.2 and out-of-vocabulary token ids at batches.3: both go to
    the dead-letter stream, both steps are skipped (no update, version still published), step 4
    trains."""
    bus, config = await trainer_run(
        make_bus,
        nats_server,
        tmp_path,
        "poison",
        max_steps=4,
        ckpt={"interval": 1, "keep_last": 4},
    )
    subjects = bus.subjects
    await bus.step_log.publish(make_train_batch(1))
    await bus.publish(subjects.batch(2), b"\xc1 not msgpack", msg_id=subjects.batch_msg_id(2))
    bad = make_train_batch(3)
    bad.micro_batches[0][0].input_ids[0] = 10**7
    await bus.step_log.publish(bad)
    await bus.step_log.publish(make_train_batch(4))

    await ranks_exit(
        tmp_path, start_ranks(tmp_path, config, 1, "trainer"), config, "trainer", timeout_s=300
    )
    metrics = await read_step_metrics(bus)
    assert [m.step for m in metrics] == [1, 2, 3, 4]
    assert [m.metrics.get("skipped", 0.0) for m in metrics] == [0, 1.0, 1.0, 0]
    assert "loss" in metrics[3].metrics and "loss" not in metrics[1].metrics
    assert await published_versions(bus) == [1, 2, 3, 4]

    dead = await read_stream(bus, subjects.dead(subjects.batches_stream), subjects.dead_stream)
    assert [m.headers["Rlbus-Dead-Subject"] for m in dead] == [subjects.batch(2), subjects.batch(3)]
    assert dead[0].data == b"\xc1 not msgpack"
    assert "DecodeError" in dead[0].headers["Rlbus-Dead-Reason"]
    assert "outside the vocabulary" in dead[1].headers["Rlbus-Dead-Reason"]
    log_text = (tmp_path / "trainer-poison.log").read_text()
    assert log_text.count("batch_quarantined") == 2

    # A restart from checkpoint 1 meets both poison entries again: skipped again, no crash.
    run_dir = tmp_path / "out" / "poison"
    for step in (2, 3, 4):
        shutil.rmtree(run_dir / "checkpoints" / f"step_{step}")
    await ranks_exit(
        tmp_path, start_ranks(tmp_path, config, 1, "trainer"), config, "trainer", timeout_s=300
    )
    again = (await read_step_metrics(bus))[4:]
    assert [m.step for m in again] == [2, 3, 4]
    assert [m.metrics.get("skipped", 0.0) for m in again] == [1.0, 1.0, 0]
    assert all(m.metrics["retrained"] == 1.0 for m in again)
    assert await published_versions(bus) == [1, 2, 3, 4]
    # Quarantined again under the same dead-letter id: the stream still holds one letter each.
    dead = await read_stream(bus, subjects.dead(subjects.batches_stream), subjects.dead_stream)
    assert [m.headers["Rlbus-Dead-Msg-Id"] for m in dead] == ["batch-2", "batch-3"]


async def wait_for_ranks(proc, count: int, timeout_s: float = 120.0) -> list[int]:
    """PIDs of `count` ranks under the torchrun agent `proc` (python processes below it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ranks = [pid for pid in descendants(proc.pid) if is_alive(pid)]
        if len(ranks) >= count:
            return ranks
        assert proc.poll() is None and time.monotonic() < deadline, "ranks did not start"
        await asyncio.sleep(0.2)


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        if is_alive(pid):
            os.kill(pid, signal.SIGKILL)


async def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (alive := [pid for pid in pids if is_alive(pid)]) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return alive


@pytest.mark.slow
async def test_no_rank_outlives_a_sigkilled_torchrun_agent_and_a_killed_rank_ends_the_agent(
    make_bus, nats_server, tmp_path
):
    bus, config = await trainer_run(make_bus, nats_server, tmp_path, "agent", max_steps=None)
    run_log = tmp_path / "trainer-agent.log"
    proc = start_ranks(tmp_path, config, 2, "trainer")  # no batch: the ranks wait for step 1
    ranks: list[int] = []
    try:
        await wait_until(
            lambda: asyncio.sleep(0, run_log.read_text().count("trainer_started") >= 2)
        )
        ranks = await wait_for_ranks(proc, 2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert await wait_gone(ranks, 10.0) == [], run_log.read_text()[-3000:]
    finally:
        kill_tree(proc)
        kill_pids(ranks)  # reparented away from the agent: kill_tree no longer finds them

    config["run"]["name"] = "agent2"
    run_log = tmp_path / "trainer-agent2.log"
    proc = start_ranks(tmp_path, config, 2, "trainer")
    try:
        await wait_until(
            lambda: asyncio.sleep(0, run_log.read_text().count("trainer_started") >= 2)
        )
        ranks = await wait_for_ranks(proc, 2)
        os.kill(ranks[-1], signal.SIGKILL)
        rc = await asyncio.to_thread(proc.wait, 60)
        assert rc != 0  # torchrun's max_restarts is 0: a dead rank ends the group
        assert await wait_gone(ranks, 10.0) == []
    finally:
        kill_tree(proc)
        kill_pids(ranks)


@pytest.mark.slow
async def test_the_trainer_rides_out_a_20_s_nats_outage(make_bus, nats_server, tmp_path):
    """nats-server SIGKILLed for 20 s while the trainer waits for step 3 (and restarted on the
    same store): the trainer keeps polling, then trains 3..4 and exits 0, steps consecutive."""
    bus, config = await trainer_run(make_bus, nats_server, tmp_path, "outage", max_steps=4)
    for step in (1, 2):
        await bus.step_log.publish(make_train_batch(step))
    proc = start_ranks(tmp_path, config, 1, "trainer")
    try:
        await wait_until(lambda: metrics_reached(bus, 2))
        nats_server.kill()
        await asyncio.sleep(20)
        nats_server.start()
        for step in (3, 4):
            await bus.step_log.publish(make_train_batch(step))
    except BaseException:
        kill_tree(proc)
        raise
    await ranks_exit(tmp_path, proc, config, "trainer", timeout_s=300)
    assert [m.step for m in await read_step_metrics(bus)] == [1, 2, 3, 4]
    assert await published_versions(bus) == [1, 2, 3, 4]
