"""A client that knows only docs/bus-schema.json reads every message rlbus puts on a real
nats-server, and rejects messages that break the contract (schema_client.py)."""

import ast
from pathlib import Path

import msgspec
import schema_client
from bus_factories import make_batch
from schema_client import SchemaClient

from rlbus.wire import control
from rlbus.wire.subjects import COORDINATOR_LEADER_KEY, WEIGHTS_LATEST_KEY
from rlbus_launch.schema import REGISTRY

EXAMPLES = {spec.name: spec.example for spec in REGISTRY}
PUBLISHED_AS_IS = {
    "Task",
    "Rollout",
    "TrainBatch",
    "WeightsPublished",
    "WeightsApplied",
    "WeightsFailed",
    "StepMetrics",
    "Lifecycle",
    "ReplicaInfo",
    "CoordinatorLeader",
    "Drain",
    "Stop",
    "Pause",
    "Resume",
}
"""Examples published unchanged (read back equal to them)."""
CLIENT_MODULES = {
    "dataclasses",
    "hashlib",
    "json",
    "jsonschema",
    "msgspec",
    "pathlib",
    "re",
    "typing",
}


async def publish_every_stored_message(bus) -> None:
    """Each stored message of the contract, through the code path its sender uses."""
    s = bus.subjects
    task, rollout = EXAMPLES["Task"], EXAMPLES["Rollout"]
    await bus.publish(s.tasks, task, msg_id=task.task_id)
    await bus.publish(s.rollouts, rollout, msg_id=rollout.task_id)
    assert await bus.step_log.publish(EXAMPLES["TrainBatch"])
    published = EXAMPLES["WeightsPublished"]
    await bus.kv(s.weights_bucket).create(WEIGHTS_LATEST_KEY, published)
    await bus.publish(
        s.weights_published, published, msg_id=f"weights-{published.version}-filesystem"
    )
    await bus.publish(s.weights_applied, EXAMPLES["WeightsApplied"], msg_id="applied-replica-0-3")
    await bus.publish(s.weights_failed, EXAMPLES["WeightsFailed"])
    await bus.publish(s.metrics("trainer"), EXAMPLES["StepMetrics"])
    await bus.publish(s.evals("orchestrator"), EXAMPLES["EvalResult"])
    await bus.publish(s.lifecycle("trainer"), EXAMPLES["Lifecycle"])
    replica = EXAMPLES["ReplicaInfo"]
    await bus.lease(s.replicas_bucket, replica.replica_id, replica, ttl_s=30).acquire()
    leader = EXAMPLES["CoordinatorLeader"]
    await bus.lease(s.state_bucket, COORDINATOR_LEADER_KEY, leader, ttl_s=30).acquire()
    await bus.mark_finished(EXAMPLES["RunFinished"].last_step)


def test_the_schema_client_knows_only_the_json_file():
    tree = ast.parse(Path(schema_client.__file__).read_text())
    imported = {
        (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported <= CLIENT_MODULES, imported - CLIENT_MODULES


async def test_a_schema_only_client_reads_every_message_rlbus_puts_on_the_bus(
    bus, make_bus, tmp_path
):
    client = SchemaClient(bus.nc, bus.subjects.run_id, storage_dir=tmp_path)
    await publish_every_stored_message(bus)
    claim_bus = await make_bus(name="big", claim_check_bytes=1024)
    assert await claim_bus.step_log.publish(make_batch(step=4, num_tokens=2000))

    # Control, both ways: rlbus asks the client, and the client asks an rlbus service.
    served = await client.serve("ControlReply", {"ok": True, "service": "x"}, service="x")
    for name in ("Drain", "Stop", "Pause", "Resume"):
        reply = await bus.request("x", EXAMPLES[name])
        assert reply == control.ControlReply(ok=True, service="x")
    requests: list[control.ControlRequest] = []

    async def handle(request: control.ControlRequest) -> control.ControlReply:
        requests.append(request)
        return control.ControlReply(ok=True, service="trainer", state="stopping")

    await bus.serve_control("trainer", handle)
    stop_values = {"reason": "schema client", "requested_at": 1.0}
    reply = await client.request("Stop", stop_values, service="trainer")
    assert requests == [control.Stop(**stop_values)]
    assert reply.value["state"] == "stopping"

    checked = await client.read_streams() + await client.read_kv() + served + [reply]
    assert [(c.subject, c.problems) for c in checked if c.problems] == []
    names = {c.name for c in checked} | {"ClaimCheck" for c in checked if c.claim is not None}
    assert names == set(client.doc["messages"])
    for c in checked:
        if c.name in PUBLISHED_AS_IS and c.claim is None:
            assert c.value == msgspec.to_builtins(EXAMPLES[c.name]), c.name
    (claimed,) = [c for c in checked if c.claim is not None]
    assert claimed.name == "TrainBatch" and claimed.value["step"] == 4


async def test_the_schema_client_rejects_messages_that_break_the_contract(bus, tmp_path):
    client = SchemaClient(bus.nc, bus.subjects.run_id, storage_dir=tmp_path)
    s = bus.subjects
    task = msgspec.to_builtins(EXAMPLES["Task"]) | {"step": -1}
    rollout = dict(reversed(msgspec.to_builtins(EXAMPLES["Rollout"]).items()))
    lifecycle = msgspec.to_builtins(EXAMPLES["Lifecycle"]) | {"type": "reborn"}
    batch = msgspec.to_builtins(EXAMPLES["TrainBatch"])
    batch["micro_batches"][0][0][0] = ["one", "two"]  # MicroBatch.input_ids, by position
    task_order = msgspec.to_builtins(EXAMPLES["Task"])
    task_order["sampling"] = dict(reversed(task_order["sampling"].items()))
    for subject, message in [
        (s.tasks, task),
        (s.rollouts, rollout),
        (s.lifecycle("trainer"), lifecycle),
        (s.batch(5), batch),
        (s.tasks, task_order),
    ]:
        await bus.publish(subject, msgspec.msgpack.encode(message))
    await bus.publish(f"{s.prefix}.events.gossip.trainer", EXAMPLES["StepMetrics"])

    problems = [" ".join(c.problems) for c in await client.read_streams()]

    assert len(problems) == 6 and all(problems), problems
    for expected in [
        "Task['step']: -1 is less than the minimum of 0",
        "Task.sampling: keys ['extra', 'seed',",
        "Rollout: keys ['finished_at', 'prompt',",
        "TrainBatch['micro_batches'][0][0][0][0]: 'one' is not of type 'integer'",
        "events.lifecycle.trainer: no message of the contract fits",
        "events.gossip.trainer: no message of the contract fits",
    ]:
        assert sum(expected in problem for problem in problems) == 1, (expected, problems)
