"""The live panel on a terminal (rlbus_launch.progress): log lines never land on its border, it
shows `step N of M` with an ETA, and it is gone, once, when the run ends."""

import io
import json
import logging
import re
import sys

import pytest
import structlog

from rlbus.obs.logging import setup_logging
from rlbus_launch.progress import Progress

CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
"""ANSI control sequences (colours, cursor moves, erases)."""
BOX = "╭╮╰╯│─"


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def terminal(restore_logging):
    """One fake terminal behind the console log handler (stderr); `to_terminal` puts it behind
    stdout (the panel) too."""
    term = FakeTerminal()
    setup_logging("rl", stream=term)
    return term


def to_terminal(monkeypatch, term: FakeTerminal) -> None:
    # in the test itself: pytest puts its own sys.stdout back between a fixture and the test
    monkeypatch.setattr(sys, "stdout", term)


def screen_lines(text: str) -> list[str]:
    """What the terminal was sent, split at every carriage return and newline, controls removed."""
    return re.split(r"[\r\n]", CONTROL.sub("", text))


def write_rows(path, *rows: dict) -> None:
    with open(path, "a") as f:
        f.write("".join(json.dumps(row) + "\n" for row in rows))


def make_complete_row(step: int) -> dict:
    return {"step": step, "loss": 0.1, "reward/mean": 0.5}


def test_a_log_line_while_the_panel_is_live_gets_a_line_of_its_own(terminal, tmp_path, monkeypatch):
    to_terminal(monkeypatch, terminal)
    metrics = tmp_path / "metrics.jsonl"
    progress = Progress(metrics, tty=True, services=["trainer"], max_steps=3)
    write_rows(metrics, make_complete_row(1))
    progress.update()
    structlog.get_logger().info("run_finished", run_dir="here")
    progress.close()
    structlog.get_logger().info("launcher_exit", exit_code=0)

    for event in ("run_finished", "launcher_exit"):
        lines = [line for line in screen_lines(terminal.getvalue()) if event in line]
        assert len(lines) == 1, lines
        assert not any(char in lines[0] for char in BOX), lines[0]
        assert re.match(r"\d{4}-\d\d-\d\dT", lines[0]), lines[0]  # the timestamp opens the line


def test_the_panel_is_stopped_once_and_the_log_handler_gets_its_stream_back(
    terminal, tmp_path, monkeypatch
):
    to_terminal(monkeypatch, terminal)
    progress = Progress(tmp_path / "metrics.jsonl", tty=True, services=["trainer"])
    handler = logging.getLogger().handlers[0]
    assert handler.stream is not terminal  # above the panel while it is shown
    progress.close()
    shown = terminal.getvalue()
    progress.close()
    assert terminal.getvalue() == shown
    assert handler.stream is terminal


def test_the_panel_shows_the_step_of_max_steps_and_the_eta(terminal, tmp_path, monkeypatch):
    to_terminal(monkeypatch, terminal)
    metrics = tmp_path / "metrics.jsonl"
    now = [100.0]
    progress = Progress(metrics, tty=True, services=["trainer"], max_steps=10, clock=lambda: now[0])
    write_rows(metrics, make_complete_row(1))
    progress.update()
    assert "step 1 of 10 · ETA --" in panel_text(progress)
    now[0] = 104.0
    write_rows(metrics, make_complete_row(2))
    progress.update()
    assert "step 2 of 10 · ETA 32s" in panel_text(progress)  # 4 s a step, 8 steps left
    progress.close()


def panel_text(progress: Progress) -> str:
    from rich.console import Console

    console = Console(file=io.StringIO(), width=100)
    with console.capture() as capture:
        console.print(progress._panel())
    return capture.get()


def test_no_panel_off_a_terminal_and_the_console_log_handler_is_left_alone(
    tmp_path, capsys, restore_logging
):
    pipe = io.StringIO()
    setup_logging("rl", stream=pipe)
    progress = Progress(tmp_path / "metrics.jsonl", tty=False, max_steps=3)
    write_rows(tmp_path / "metrics.jsonl", make_complete_row(1))
    progress.close()
    assert logging.getLogger().handlers[0].stream is pipe
    assert capsys.readouterr().out.splitlines() == [
        "Step 1 | Reward 0.5000 | Loss 0.1000 | Tok/s - | Weights - | Lag -"
    ]
