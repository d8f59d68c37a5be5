"""structlog setup (rlbus.obs.logging): console renderer on a terminal, JSON otherwise, one JSON
log file per service in the run directory, run_id/service/step bound as context."""

import io
import json
import logging
import re

import pytest
import structlog

from rlbus.obs.logging import bind_step, log_file_path, setup_logging


@pytest.fixture(autouse=True)
def _restore_logging(restore_logging):
    """Every test here leaves logging as it found it (conftest's `restore_logging`)."""


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_piped_console_gets_json_with_run_service_and_step_context(tmp_path):
    stream = io.StringIO()
    setup_logging("orchestrator", run_dir=tmp_path, run_id="run-1", stream=stream)

    bind_step(7)
    structlog.get_logger().info("batch_published", num_rollouts=32)

    (event,) = json_lines(stream.getvalue())
    assert event["event"] == "batch_published" and event["num_rollouts"] == 32
    assert (event["run_id"], event["service"], event["step"], event["level"]) == (
        "run-1",
        "orchestrator",
        7,
        "info",
    )


def test_terminal_console_gets_the_readable_renderer(tmp_path):
    stream = FakeTerminal()
    setup_logging("trainer", run_id="r", stream=stream)

    structlog.get_logger().info("step_done", loss=0.5)

    line = re.sub(r"\x1b\[[0-9;]*m", "", stream.getvalue())  # drop the colours
    assert "step_done" in line and "loss=0.5" in line and "service=trainer" in line
    assert not line.lstrip().startswith("{")


def test_each_service_writes_json_lines_into_its_own_log_file(tmp_path):
    setup_logging("inference", run_dir=tmp_path, run_id="r", stream=FakeTerminal())
    structlog.get_logger().warning("replica_ready", port=8000)
    logging.getLogger("vllm.engine").info("foreign library line")  # stdlib loggers land there too
    setup_logging("trainer", run_dir=tmp_path, run_id="r", stream=FakeTerminal(), rank=1)
    structlog.get_logger().info("rank_ready")
    logging.shutdown()

    inference = json_lines(log_file_path(tmp_path, "inference").read_text())
    trainer_rank1 = json_lines((tmp_path / "logs" / "trainer-rank1.log").read_text())
    assert [e["event"] for e in inference] == ["replica_ready", "foreign library line"]
    assert all(e["service"] == "inference" for e in inference)
    assert trainer_rank1[0]["event"] == "rank_ready" and trainer_rank1[0]["rank"] == 1


def test_no_second_copy_when_stderr_already_is_the_log_file(tmp_path):
    path = log_file_path(tmp_path, "orchestrator")
    path.parent.mkdir(parents=True)
    with open(path, "a") as redirected:  # what the launcher does with a service's output
        setup_logging("orchestrator", run_dir=tmp_path, run_id="r", stream=redirected)
        structlog.get_logger().info("once")
        redirected.flush()

    assert [e["event"] for e in json_lines(path.read_text())] == ["once"]


def test_log_level_filters_events(tmp_path):
    stream = io.StringIO()
    setup_logging("orchestrator", stream=stream, level="warning")

    structlog.get_logger().info("hidden")
    structlog.get_logger().warning("shown")

    assert [e["event"] for e in json_lines(stream.getvalue())] == ["shown"]
