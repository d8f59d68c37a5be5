"""The monitor's `dead_letters/total` on the launcher's Step line (rlbus_launch.progress); kept here,
next to the monitor that writes the count, to leave tests/unit/launch to the launcher's tests."""

from rlbus_launch.progress import step_line


def test_step_line_shows_quarantined_only_when_there_are_some():
    row = {"step": 4, "reward/mean": 0.5, "loss": 0.1}
    plain = "Step 4 | Reward 0.5000 | Loss 0.1000 | Tok/s - | Weights - | Lag -"
    assert step_line(4, {**row, "dead_letters/total": 0}, {}) == plain
    assert step_line(4, row, {}) == plain
    assert step_line(4, {**row, "dead_letters/total": 3}, {}) == plain + " | Quarantined 3"
