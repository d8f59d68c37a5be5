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

import json
import logging
import os
import tempfile
import uuid
from pathlib import Path

import pytest
import structlog

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
def restore_logging():
    """setup_logging configures process-wide state: put the defaults back for other tests."""
    yield
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    root.setLevel(logging.WARNING)
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


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


SLOW_GROUP = "slow"
SLOW_IDS_VAR = "RLBUS_TEST_SLOW_IDS"
"""A file the xdist workers write the ids of the collected `slow` tests to, for the controller's
scheduler (`SlowTogetherScheduling`)."""


def pytest_configure(config):
    """The controller of an xdist run names the file its workers report slow tests in (they
    inherit the environment when they start)."""
    if not hasattr(config, "workerinput") and config.getvalue("dist") == "loadgroup":
        handle, path = tempfile.mkstemp(prefix="rlbus-slow-ids-", suffix=".json")
        os.close(handle)
        os.environ[SLOW_IDS_VAR] = path


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput") and os.environ.get(SLOW_IDS_VAR):
        Path(os.environ.pop(SLOW_IDS_VAR)).unlink(missing_ok=True)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session):
    """A worker writes the ids of its `slow` tests before xdist reports its collection."""
    path = os.environ.get(SLOW_IDS_VAR)
    if path and hasattr(session.config, "workerinput"):
        ids = [i.nodeid for i in session.items if i.get_closest_marker("slow") is not None]
        tmp = f"{path}.{os.getpid()}"
        Path(tmp).write_text(json.dumps(ids), encoding="utf-8")
        os.replace(tmp, path)


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` (the README's whole-suite command) runs every `slow` test on one worker,
    one after the other as a serial run would, while the other workers take the fast tests beside
    them: two vLLM or torchrun tests never share the 2 cores of a CI machine, and the fast tier no
    longer waits for them. (xdist's own loadgroup cannot group them under pytest 9: it renames
    `item._nodeid`, which pytest 9 no longer reads.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SlowTogetherScheduling(LoadScopeScheduling):
        slow_ids: set[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.slow_ids is None:
                text = Path(os.environ[SLOW_IDS_VAR]).read_text(encoding="utf-8")
                self.slow_ids = set(json.loads(text)) if text else set()
            return SLOW_GROUP if nodeid in self.slow_ids else nodeid

    return SlowTogetherScheduling(config, log)
