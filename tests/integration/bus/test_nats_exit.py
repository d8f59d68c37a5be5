"""`rlbus-nats --exit-when-finished` (the sidecar of compose and SLURM) as a real process: it keeps
serving after the run's finished record while a service is still connected, exits 0 once the
last one disconnects, and after `--linger-s` at the latest."""

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlbus.bus import Bus
from rlbus.configs.bus import BusConfig

RLBUS_NATS = Path(sys.executable).parent / "rlbus-nats"
READY_S = 30.0
RUN = "sidecar-run"


class Sidecar:
    """One `rlbus-nats` process on free ports; stopped by its PID (SIGTERM stops its server)."""

    def __init__(self, store: Path, ports: list[int], linger_s: float):
        self.url = f"nats://127.0.0.1:{ports[0]}"
        self.log = store.parent / "rlbus-nats.log"
        argv = [RLBUS_NATS, "--store", store, "--port", str(ports[0]), "--http-port",
                str(ports[1]), "--run-id", RUN, "--exit-when-finished", "--linger-s",
                str(linger_s)]  # fmt: skip
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)

    async def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_S
        while "nats-server ready" not in self.log.read_text():
            assert self.process.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, f"rlbus-nats not ready: {self.log.read_text()}"
            await asyncio.sleep(0.1)

    async def exit_code(self, timeout_s: float) -> int | None:
        """The exit code once it exits within `timeout_s`, else None (still running)."""
        deadline = time.monotonic() + timeout_s
        while self.process.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        return self.process.poll()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def sidecar(tmp_path, free_ports):
    made: list[Sidecar] = []

    def make(linger_s: float) -> Sidecar:
        made.append(Sidecar(tmp_path / "nats", free_ports(2), linger_s))
        return made[-1]

    try:
        yield make
    finally:
        for one in made:
            one.stop()


async def connect(url: str) -> Bus:
    return await Bus.connect(BusConfig(url=url, connect_retry_s=5.0), run_id=RUN, name="trainer")


@pytest.mark.timeout(120)
async def test_sidecar_outlives_the_finish_until_the_last_service_disconnects(sidecar):
    nats = sidecar(linger_s=60)
    await nats.wait_ready()
    trainer = await connect(nats.url)
    monitor = await connect(nats.url)
    await trainer.mark_finished(3)
    await trainer.close()
    # A service still connected (draining): the sidecar keeps serving it.
    assert await nats.exit_code(timeout_s=4) is None
    assert (await monitor.run_finished()).last_step == 3
    await monitor.close()
    assert await nats.exit_code(timeout_s=15) == 0, nats.log.read_text()
    assert "run_finished_seen" in nats.log.read_text()


@pytest.mark.timeout(120)
async def test_sidecar_stops_after_linger_even_with_a_client_left(sidecar):
    nats = sidecar(linger_s=3)
    await nats.wait_ready()
    stuck = await connect(nats.url)
    try:
        await stuck.mark_finished(1)
        assert await nats.exit_code(timeout_s=20) == 0, nats.log.read_text()
        assert "nats_clients_left" in nats.log.read_text()
    finally:
        await stuck.close()


@pytest.mark.timeout(60)
async def test_exit_when_finished_without_run_id_is_one_usage_error(tmp_path):
    result = subprocess.run(
        [RLBUS_NATS, "--store", tmp_path / "s", "--exit-when-finished"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 2 and "--exit-when-finished needs --run-id" in result.stderr
    assert not (tmp_path / "s").exists()
