"""The example reader (examples/bus-reader/read_bus.py), written from docs/bus-messages.md and
docs/bus-schema.json alone, reads a run the `rl` launcher planned: it finds the bus in
`<run_dir>/configs/bus.json`, reads every stored message of real rlbus senders valid, skips the
state bucket's private key, and watches the work-queue streams without taking work."""

import ast
import asyncio
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from bus_factories import make_batch, wait_for
from test_schema_client import EXAMPLES, publish_every_stored_message

from rlbus.bus import Bus, Delivery
from rlbus.configs.bus import BusConfig
from rlbus.wire import tasks

REPO = Path(__file__).resolve().parents[3]
READER = REPO / "examples" / "bus-reader" / "read_bus.py"
READER_MODULES = {
    "argparse", "asyncio", "hashlib", "json", "re", "ssl", "sys", "pathlib", "typing",
    "msgpack", "nats", "jsonschema",
}  # fmt: skip
NOT_STORED = {"Drain", "Stop", "Pause", "Resume", "ControlReply", "ClaimCheck"}
"""Messages of the contract that no stream or bucket holds (control) or that stand for another."""


def test_the_reader_imports_nothing_from_rlbus():
    tree = ast.parse(READER.read_text())
    imported = {
        (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported <= READER_MODULES, imported - READER_MODULES


@pytest.fixture
def planned_run(tmp_path):
    """`rl --dry-run` of the debug config, then its embedded nats-server started by the script
    the launcher wrote for it (stopped by PID at the end)."""
    rl = Path(sys.executable).parent / "rl"
    argv = [str(rl), "@", "configs/debug/rl.toml", "--output-dir", str(tmp_path)]
    subprocess.run(
        [*argv, "--run.name", "reader", "--dry-run"],
        cwd=REPO, check=True, timeout=120, capture_output=True,
    )  # fmt: skip
    run_dir = tmp_path / "reader"
    server = subprocess.Popen(
        ["bash", str(run_dir / "scripts" / "nats.sh")],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield run_dir
    finally:
        server.terminate()  # nats.sh execs nats-server: this PID is the server
        server.wait(30)


async def run_reader(run_dir: Path, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, str(READER), str(run_dir), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def records_of(reader: asyncio.subprocess.Process) -> list[dict]:
    stdout, stderr = await asyncio.wait_for(reader.communicate(), 60)
    assert reader.returncode == 0, stdout.decode()[-2000:] + stderr.decode()[-2000:]
    return [json.loads(line) for line in stdout.decode().splitlines()]


async def test_the_reader_reads_a_planned_run_valid_and_takes_no_work(planned_run):
    bus_file = json.loads((planned_run / "configs" / "bus.json").read_text())
    assert bus_file["run"] == "reader"
    assert bus_file["server_config"] == str((planned_run / "configs" / "nats.conf").absolute())
    config = BusConfig(url=bus_file["url"], connect_retry_s=10.0)
    bus = await Bus.connect(config, run_id="reader", storage_dir=planned_run, name="services")
    claim_bus = await Bus.connect(
        config.model_copy(update={"claim_check_bytes": 1024}),
        run_id="reader", storage_dir=planned_run, name="big",
    )  # fmt: skip
    try:
        await publish_every_stored_message(bus)
        assert await claim_bus.step_log.publish(make_batch(step=4, num_tokens=2000))
        await bus.kv(bus.subjects.state_bucket).put("orchestrator", b'{"cursor": 3}')

        reader = await run_reader(planned_run, "--follow", "4")
        await asyncio.sleep(2)
        # stored while the reader watches
        late = msgspec.structs.replace(EXAMPLES["Task"], task_id="train-13")
        await bus.publish(bus.subjects.tasks, late, msg_id=late.task_id)
        records = await records_of(reader)

        assert [(r["subject"], r["problems"]) for r in records if r["problems"]] == []
        doc = json.loads((REPO / "docs" / "bus-schema.json").read_text())
        assert {r["message"] for r in records} == set(doc["messages"]) - NOT_STORED
        assert [r["task_id"] for r in records if r["message"] == "Task"] == [
            "train-12",
            "train-13",
        ]
        (rollout,) = [r for r in records if r["message"] == "Rollout"]
        assert rollout["rewards"] == [s.reward for s in EXAMPLES["Rollout"].samples]
        # the coordinator's state record (KV key `orchestrator`) is not a message of the contract
        assert not any(r["subject"].endswith("_state.orchestrator") for r in records)

        # the reader took no work: both tasks are still there for the rollout workers' durable
        stats = await bus.stream_stats(bus.subjects.tasks_stream)
        pending = sorted((c.durable, c.num_pending) for c in stats.consumers)
        assert pending == [("eval-workers", 0), ("rollout-workers", 2)]
        delivered: list[str] = []

        async def take(delivery: Delivery[tasks.Task]) -> None:
            delivered.append(delivery.data.task_id)

        s = bus.subjects
        async with bus.consumer(s.tasks_stream, s.tasks_durable, tasks.decoder, take):
            await wait_for(lambda: len(delivered) == 2, 20)
        assert delivered == ["train-12", "train-13"]
    finally:
        await claim_bus.close()
        await bus.close()
