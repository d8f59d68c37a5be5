"""Shared pytest fixtures: a real `nats-server -js` per test (or per module/session) and bus clients.

- `environment_dir` (autouse, session): `$RLBUS_ENV_DIR` is a temp folder, never ~/.cache.
- `nats_server`: a fresh server on free ports with a temp store dir, stopped by PID at teardown.
  Crash it with `nats_server.kill()` and bring it back on the same ports and store with
  `nats_server.restart(kill=True)` (or `.start()` after a kill).
- `nats_server_module` / `nats_server_session`: one server shared by a module / the whole run
  (cheaper; give each test its own run id, which `bus` and `make_bus` do).
- `bus`: a connected `rlbus.bus.Bus` on `nats_server` with a unique run id and `tmp_path` as the
  claim-check storage.
- `free_ports`: `free_ports(n)` gives n distinct free loopback ports.
- `make_bus`: `await make_bus(server=None, run_id=None, **config_overrides)` for more clients
  (several workers of one run); all are closed at teardown.
"""

import os
import uuid
from pathlib import Path

import pytest

from rlbus import envindex, netutil
from rlbus.bus import Bus
from rlbus.configs.bus import BusConfig
from rlbus_launch.natsserver import NatsServer


@pytest.fixture(scope="session", autouse=True)
def environment_dir(tmp_path_factory):
    """No test reads or writes the user's environment index (`rl env install`,
    ~/.cache/rlbus/envs): RLBUS_ENV_DIR names an empty temp folder, inherited by subprocesses."""
    os.environ[envindex.ENV_DIR_VAR] = str(tmp_path_factory.mktemp("rlbus-envs"))


@pytest.fixture
def free_ports():
    """`free_ports(n)`: n distinct free loopback ports (the one place tests get ports from)."""
    return netutil.free_ports


def start_nats_server(store_dir: Path, **kwargs) -> NatsServer:
    return NatsServer(store_dir, **kwargs).start()


def stop_nats_server(server: NatsServer) -> None:
    try:
        server.stop(timeout_s=5)
    finally:
        server.kill()


@pytest.fixture
def nats_server(tmp_path):
    server = start_nats_server(tmp_path / "nats")
    try:
        yield server
    finally:
        stop_nats_server(server)


@pytest.fixture(scope="module")
def nats_server_module(tmp_path_factory):
    server = start_nats_server(tmp_path_factory.mktemp("nats"))
    try:
        yield server
    finally:
        stop_nats_server(server)


@pytest.fixture(scope="session")
def nats_server_session(tmp_path_factory):
    server = start_nats_server(tmp_path_factory.mktemp("nats"))
    try:
        yield server
    finally:
        stop_nats_server(server)


def make_bus_config(server: NatsServer, **overrides) -> BusConfig:
    """A BusConfig pointing at `server`, with short test-friendly retry windows."""
    fields = dict(url=server.url, connect_retry_s=5.0, publish_retry_s=30.0)
    return BusConfig(**(fields | overrides)).with_secrets(token=server.token)


@pytest.fixture
async def make_bus(nats_server, tmp_path):
    buses: list[Bus] = []
    default_run_id = f"test_{uuid.uuid4().hex[:8]}"

    async def make(
        server: NatsServer | None = None, run_id: str | None = None, name: str = "test", **overrides
    ) -> Bus:
        config = make_bus_config(server or nats_server, **overrides)
        bus = await Bus.connect(
            config, run_id=run_id or default_run_id, storage_dir=tmp_path, name=name
        )
        buses.append(bus)
        return bus

    try:
        yield make
    finally:
        for bus in buses:
            await bus.close()


@pytest.fixture
async def bus(make_bus) -> Bus:
    return await make_bus()
