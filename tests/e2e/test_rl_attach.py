"""Two `rl` runs in a row against one plain `inference` (the two-terminal workflow, with the same
config file for both: `inference @ configs/debug/rl.toml`): both finish their steps, neither
starts a vLLM of its own, the second one starts from the run's model again, and the server
outlives both."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from e2e_support import DEBUG_RL, RlLaunch, alive_groups, steps_with
from replica_support import start_standalone

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

STEPS = 3


def service_events(log: Path) -> list[str]:
    """The `event` of every JSON line of a service log."""
    events = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            events.append(json.loads(line)["event"])
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return events


@pytest.fixture(scope="module")
def server(tmp_path_factory, starting_model):
    root = tmp_path_factory.mktemp("attach-server")
    replica = start_standalone(
        starting_model.path,
        root / "server.out",
        vllm_args=["@", str(DEBUG_RL)],  # the rl config's engine settings (seq_len, dtype)
    )
    try:
        yield replica
    finally:
        replica.stop()


def test_two_runs_attach_to_one_server_and_leave_it_serving(server, starting_model, tmp_path):
    for name in ("first", "second"):
        launch = RlLaunch(
            tmp_path,
            name,
            "--model.name",
            str(starting_model.path),
            "--max-steps",
            str(STEPS),
            "--inference.attach.url",
            server.router_url,
            "--inference.attach.admin-url",
            server.engine_url,
        )
        try:
            code = launch.wait()
        finally:
            launch.kill()
        assert code == 0, launch.output()[-4000:]
        run_dir = launch.run_dir
        assert steps_with(run_dir, "loss") == list(range(1, STEPS + 1))
        assert not list((run_dir / "logs").glob("inference-engine*"))  # no vLLM of its own
        events = service_events(run_dir / "logs" / "inference.log")
        assert "attached_weights_reset" in events and "replica_withdrawn" in events
        assert alive_groups(run_dir) == []
        assert server.proc.poll() is None
        assert httpx.get(server.router_url + "/health", timeout=10).status_code == 200
