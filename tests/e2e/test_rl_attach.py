"""`rl` runs one after another against one plain `inference` (the two-terminal workflow, with the
same config file for both: `inference @ configs/debug/rl.toml`): two runs finish their steps,
neither starts a vLLM of its own, each starts from the run's model again; a run stopped with
Ctrl-C and resumed continues from its own latest weights; the server outlives all of them."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import pytest
from e2e_support import DEBUG_RL, RlLaunch, alive_groups, steps_with, wait_for
from replica_support import start_standalone

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

STEPS = 3
STOPPED_STEPS = 20
"""At ~0.5 s per step a 3-step run can end before the Ctrl-C that should stop it mid-run."""


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


def attached_args(server, starting_model, steps: int = STEPS) -> list[str]:
    return [
        "--model.name",
        str(starting_model.path),
        "--max-steps",
        str(steps),
        "--inference.attach",
        server.public_url,
        "--inference.attach.admin-url",
        server.engine_url,
    ]


def server_serves(server) -> bool:
    return (
        server.proc.poll() is None
        and httpx.get(server.public_url + "/health", timeout=10).status_code == 200
    )


def test_two_runs_attach_to_one_server_and_leave_it_serving(server, starting_model, tmp_path):
    for name in ("first", "second"):
        launch = RlLaunch(tmp_path, name, *attached_args(server, starting_model))
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
        assert server_serves(server)


def test_a_run_stopped_with_ctrl_c_leaves_the_server_and_resumes_from_its_weights(
    server, starting_model, tmp_path
):
    args = attached_args(server, starting_model, STOPPED_STEPS)
    first = RlLaunch(tmp_path, "stopped", *args)
    try:
        wait_for(
            lambda: steps_with(first.run_dir, "loss") or first.popen.poll() is not None,
            480,
            "a trained step",
        )
        assert first.popen.poll() is None, first.output()[-3000:]
        first.popen.send_signal(signal.SIGINT)
        assert first.wait(120) == 130, first.output()[-3000:]
        assert alive_groups(first.run_dir) == []
    finally:
        first.kill()
    assert server_serves(server)

    resumed = RlLaunch(tmp_path, "stopped", *args, "--resume")
    try:
        assert resumed.wait() == 0, resumed.output()[-4000:]
    finally:
        resumed.kill()
    assert steps_with(resumed.run_dir, "loss") == list(range(1, STOPPED_STEPS + 1))
    events = service_events(resumed.run_dir / "logs" / "inference.log")
    attach = events[len(events) - events[::-1].index("attached_weights_reset") - 1 :]
    # reset to the model, then the run's latest published version, before registering
    assert attach.index("weights_applied") < attach.index("replica_registered"), attach
    assert server_serves(server)
