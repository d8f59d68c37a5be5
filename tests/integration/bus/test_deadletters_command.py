"""`python -m rlbus_launch.deadletters`: the listing of a run's quarantined messages, on a run-dir-shaped
store with a real nats-server (live, and stopped: the command starts a temporary one)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlbus.bus import Bus
from rlbus.configs.bus import BusConfig
from rlbus_launch.natsserver import NatsServer

RUN_ID = "dl-run"


def run_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlbus_launch.deadletters", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def servers_on_store(store: Path) -> list[int]:
    """PIDs of live nats-servers started on `store` (read from /proc, for the leak check)."""
    conf = str(store / "nats-server.conf").encode()
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and conf in (proc / "cmdline").read_bytes().split(b"\0"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


@pytest.fixture
def run_dir(tmp_path):
    """A run directory as `rl` leaves it: configs/rl.toml without bus.url, configs/nats.conf, and
    the embedded server's store in nats/ (the server runs; tests stop it as they need)."""
    run_dir = tmp_path / "run"
    (run_dir / "configs").mkdir(parents=True)
    (run_dir / "logs").mkdir()
    (run_dir / "configs" / "rl.toml").write_text(
        f'[bus]\nrun_id = "{RUN_ID}"\n\n[run]\nname = "{RUN_ID}"\n'
    )
    server = NatsServer(run_dir / "nats").start()
    (run_dir / "configs" / "nats.conf").write_text(server.config_text())
    try:
        yield run_dir, server
    finally:
        server.kill()


async def quarantine_two(url: str) -> None:
    bus = await Bus.connect(BusConfig(url=url), run_id=RUN_ID, name="worker")
    try:
        s = bus.subjects
        await bus.dead_letter(s.tasks_stream, s.tasks, b"\xc1", {"Nats-Msg-Id": "0-3"}, "bad\ntask")
        await bus.dead_letter(
            s.weights_bucket, "$KV.w.latest", b"\xc1", None, "DecodeError: x", stream_seq=9
        )
    finally:
        await bus.close()


async def test_lists_the_dead_letters_of_a_live_run_as_json(run_dir):
    run_dir, server = run_dir
    await quarantine_two(server.url)
    result = run_command(str(run_dir), "--json")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["seq"], r["kind"], r["msg_id"]) for r in rows] == [
        (1, "task", "0-3"),
        (2, "weights-record", None),
    ]
    assert rows[0]["origin"].startswith("worker@") and rows[1]["stream_seq"] == 9


async def test_a_stopped_run_is_read_through_a_temporary_server_that_is_stopped_after(run_dir):
    run_dir, server = run_dir
    await quarantine_two(server.url)
    server.stop()
    result = run_command(str(run_dir))
    assert result.returncode == 0, result.stderr
    header, *lines = result.stdout.splitlines()
    assert header.split() == ["seq", "time", "kind", "subject", "origin", "reason"]
    assert len(lines) == 2
    assert lines[0].split()[2:4] == ["task", f"rlbus.{RUN_ID}.tasks"]
    assert lines[0].endswith("bad task")  # a reason is one line
    assert servers_on_store(run_dir / "nats") == []


async def test_no_dead_letters_is_said_and_exits_0(run_dir):
    run_dir, server = run_dir
    server.stop()
    result = run_command(str(run_dir))
    assert (result.returncode, result.stdout.strip()) == (0, "no dead letters")


def test_a_bad_run_dir_or_an_unreachable_bus_is_one_line_and_exit_2(tmp_path, free_ports):
    result = run_command(str(tmp_path / "nope"))
    assert result.returncode == 2
    assert "not a run directory" in result.stderr and len(result.stderr.splitlines()) == 1
    (port,) = free_ports(1)
    result = run_command("--bus.url", f"nats://127.0.0.1:{port}", "--run-id", "x")
    assert result.returncode == 2
    assert "no NATS server answered" in result.stderr and len(result.stderr.splitlines()) == 1
