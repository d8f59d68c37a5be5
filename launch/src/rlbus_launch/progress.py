"""Live progress of an RL run on the launcher's terminal, read from `<run_dir>/metrics.jsonl`.

The monitor process writes one JSON row per step (trainer and orchestrator metrics joined, once
across any restart: rlbus_launch.monitor). `MetricsTail` reads the new complete lines on each poll and
merges rows by step (files written by older versions may still hold a second, weights-only row
for a step); `step_line` renders one step as the parseable console line

    Step 3 | Reward 0.4213 | Loss 0.0123 | Tok/s 512 | Weights v2 (vm-8000: v2) | Lag 0.50

(`-` for a value not known yet; a run of several environments shows each one's mean reward after
the overall one, `Reward 0.4213 (math 0.51, reverse-text 0.33)`, from `env/<id>/reward/mean`),
followed by `| Quarantined N` once the run has quarantined
messages (`dead_letters/total`, docs/bus.md "Dead letters"). Each step is printed once, when
the step's row has both the trainer's and the orchestrator's metrics (or, when the run ends, any
step a service reported; a row holding only weights acks is never a step line of its own).

On a terminal the lines scroll above a rich Live panel holding the newest step and
`progress_line` (`step 12 of 40 · ETA 25s`, from `eta_s`); otherwise only the plain lines are
printed. While the panel is shown, everything else that reaches the terminal goes above it
through the panel's console, never straight to the terminal (where it would land on the
panel's border and make the next refresh draw the panel a second time): the launcher's console
log handler is pointed at `LinesAbovePanel` (rlbus.obs.logging.console_handler), and rich
redirects `print` and direct `sys.stderr` writes. `Progress.close` stops the panel once, erasing
it; what is printed after starts on a line of its own.
"""

import io
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, cast

from rlbus.obs.logging import console_handler

if TYPE_CHECKING:  # rich is imported where it is used: only a terminal needs it
    from rich.console import Console
    from rich.live import Live
    from rich.panel import Panel

APPLIED_PREFIX = "weights/applied/"
"""Per-replica key the monitor writes for each WeightsApplied: `weights/applied/<replica_id>` = version."""


@dataclass
class MetricsTail:
    """Reads the lines appended to a metrics.jsonl since the last call, merged by step."""

    path: Path
    offset: int = 0
    steps: dict[int, dict[str, Any]] = field(default_factory=dict)

    def poll(self) -> list[int]:
        """Steps whose row changed since the last poll, in order."""
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        self.offset += end
        changed = set()
        for line in data[:end].splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            step = int(row.get("step", -1))
            self.steps.setdefault(step, {}).update(row)
            changed.add(step)
        return sorted(changed)


def is_complete(row: dict[str, Any]) -> bool:
    """Whether a row has both the trainer's (`loss`) and the orchestrator's (`reward/mean`) part."""
    return "loss" in row and "reward/mean" in row


def trainer_tokens_per_s(row: dict[str, Any]) -> float | None:
    """Both services report `tokens_per_s`; the monitor prefixes the one that arrived second."""
    if "trainer/tokens_per_s" in row:
        return row["trainer/tokens_per_s"]
    if "orchestrator/tokens_per_s" in row or "loss" in row:
        return row.get("tokens_per_s")
    return None


LAG_HISTOGRAM_PREFIX = "off_policy_lag/"
"""The orchestrator reports lag as a histogram: `off_policy_lag/<lag>` = number of samples."""


def mean_lag(row: dict[str, Any]) -> float | None:
    """Mean off-policy lag of the step's samples (None without a lag histogram)."""
    counts = {
        int(key[len(LAG_HISTOGRAM_PREFIX) :]): value
        for key, value in row.items()
        if key.startswith(LAG_HISTOGRAM_PREFIX) and key[len(LAG_HISTOGRAM_PREFIX) :].isdigit()
    }
    total = sum(counts.values())
    return sum(lag * n for lag, n in counts.items()) / total if total else None


def replica_versions(steps: dict[int, dict[str, Any]]) -> dict[str, int]:
    """Newest weights version each replica acked (`weights/applied/<replica>` holds the version;
    the monitor puts a late ack into the next row, so the row's step is not the version)."""
    versions: dict[str, int] = {}
    for row in steps.values():
        for key, value in row.items():
            if key.startswith(APPLIED_PREFIX):
                replica = key[len(APPLIED_PREFIX) :]
                versions[replica] = max(versions.get(replica, -1), int(value))
    return versions


def has_step_metrics(row: dict[str, Any]) -> bool:
    """Whether a service reported this step (not just a weights ack carried into a later row)."""
    return "loss" in row or "reward/mean" in row


ENV_REWARD_PREFIX, ENV_REWARD_SUFFIX = "env/", "/reward/mean"
"""The orchestrator's per-environment mean reward: `env/<id>/reward/mean`."""


def env_rewards(row: dict[str, Any]) -> dict[str, float]:
    """Mean reward of each environment that had samples in the step (key order kept)."""
    return {
        key[len(ENV_REWARD_PREFIX) : -len(ENV_REWARD_SUFFIX)]: value
        for key, value in row.items()
        if key.startswith(ENV_REWARD_PREFIX) and key.endswith(ENV_REWARD_SUFFIX)
    }


def reward_text(row: dict[str, Any]) -> str:
    """`0.4213`, with each environment's `(id 0.51, ...)` when the step had several."""
    text = _fmt(row.get("reward/mean"), ".4f")
    per_env = env_rewards(row)
    if len(per_env) < 2:
        return text
    return f"{text} ({', '.join(f'{env} {value:.2f}' for env, value in per_env.items())})"


DEAD_LETTERS_KEY = "dead_letters/total"
"""How many messages the run had quarantined when the monitor wrote the row."""


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def step_line(step: int, row: dict[str, Any], replicas: dict[str, int]) -> str:
    """`Step N | Reward x.xxxx | Loss x.xxxx | Tok/s n | Weights v<k> (<replica>: v<k>, ...) | Lag l`
    (`| Quarantined N` appended when N > 0)."""
    newest = max(replicas.values(), default=None)
    per_replica = ", ".join(f"{name}: v{version}" for name, version in sorted(replicas.items()))
    weights = "-" if newest is None else f"v{newest} ({per_replica})"
    quarantined = int(row.get(DEAD_LETTERS_KEY, 0))
    return " | ".join([
        f"Step {step}",
        f"Reward {reward_text(row)}",
        f"Loss {_fmt(row.get('loss'), '.4f')}",
        f"Tok/s {_fmt(trainer_tokens_per_s(row), '.0f')}",
        f"Weights {weights}",
        f"Lag {_fmt(mean_lag(row), '.2f')}",
        *([f"Quarantined {quarantined}"] if quarantined > 0 else []),
    ])  # fmt: skip


ETA_WINDOW = 10
"""Steps whose mean duration estimates the time left: recent enough to follow a change of pace."""


def eta_s(
    done_times: Sequence[float], steps_left: int, now: float, window: int = ETA_WINDOW
) -> float | None:
    """Seconds until the last step: the mean duration of the last <= `window` steps (between
    their completion times `done_times`, ascending) times `steps_left`, less the time since the
    newest step. None before 2 steps are done (no duration yet)."""
    if len(done_times) < 2:
        return None
    recent = done_times[-(window + 1) :]
    mean_step_s = (recent[-1] - recent[0]) / (len(recent) - 1)
    return max(0.0, mean_step_s * steps_left - (now - recent[-1]))


def format_duration(seconds: float) -> str:
    """`42s`, `3m 05s`, `2h 03m`."""
    total = round(seconds)
    if total < 60:
        return f"{total}s"
    if total < 3600:
        return f"{total // 60}m {total % 60:02d}s"
    return f"{total // 3600}h {total % 3600 // 60:02d}m"


def progress_line(step: int, max_steps: int | None, eta: float | None) -> str:
    """`step 12 of 40 · ETA 25s` (`ETA --` while unknown); `step 12` without max_steps."""
    if max_steps is None:
        return f"step {step}"
    return f"step {step} of {max_steps} · ETA {'--' if eta is None else format_duration(eta)}"


class LinesAbovePanel(io.TextIOBase):
    """A text stream that prints each complete line above a live panel (its console's `print`),
    colours kept: where the console log handler writes while the panel is shown."""

    def __init__(self, console: "Console") -> None:
        self.console = console
        self._partial = ""

    def write(self, text: str) -> int:
        from rich.text import Text

        *lines, self._partial = (self._partial + text).split("\n")
        if lines:
            # soft_wrap: a long line is left to the terminal to wrap, never cut by rich
            self.console.print(Text("\n").join(map(Text.from_ansi, lines)), soft_wrap=True)
        return len(text)

    def isatty(self) -> bool:
        return True


class Progress:
    """Prints each step once; on a terminal also keeps a rich Live panel with the newest step,
    the step count and an ETA, and routes console log lines above it while it is shown."""

    def __init__(
        self,
        metrics_path: Path,
        tty: bool,
        services: list[str] | None = None,
        max_steps: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tail = MetricsTail(metrics_path)
        # A resumed run appends to its metrics.jsonl: steps already complete there were shown
        # by the launch that trained them.
        self.tail.poll()
        self.printed: set[int] = {step for step, row in self.tail.steps.items() if is_complete(row)}
        self.tty = tty
        self.services = services or []
        self.max_steps = max_steps
        self.clock = clock
        self.done_times: list[float] = []
        """When each step of this launch was printed (`clock`): the ETA's step durations."""
        self._latest: str | None = None
        self._live: Live | None = None
        self._console: Console | None = None
        self._log_route: tuple[logging.StreamHandler[TextIO], TextIO] | None = None
        """The console log handler pointed above the panel, and its own stream."""
        if tty:
            self._start_panel()

    def _start_panel(self) -> None:
        import rich.console
        import rich.live

        self._console = rich.console.Console()
        handler = console_handler()
        if handler is not None and handler.stream.isatty():  # the terminal, not a log file
            self._log_route = (handler, handler.stream)
            handler.setStream(cast(TextIO, LinesAbovePanel(self._console)))
        # rich sends `print` and `sys.stderr` writes above the panel too; stderr only when it
        # is a terminal (`2> file` keeps its lines in the file).
        self._live = rich.live.Live(
            self._panel(),
            console=self._console,
            refresh_per_second=2,
            transient=True,
            redirect_stderr=sys.stderr.isatty(),
        )
        self._live.start()

    def _panel(self) -> "Panel":
        from rich.panel import Panel
        from rich.text import Text

        step = max(self.printed, default=0)
        left = None if self.max_steps is None else max(0, self.max_steps - step)
        eta = None if left is None else eta_s(self.done_times, left, self.clock())
        body = self._latest or (
            "waiting for the first step (services are starting; logs in <run_dir>/logs/)"
        )
        return Panel(
            Text(f"{body}\n{progress_line(step, self.max_steps, eta)}"),
            title="rl: " + ", ".join(self.services),
            expand=False,
        )

    def emit(self, line: str) -> None:
        if self._console is not None:
            self._console.print(line, highlight=False, soft_wrap=True)
        else:
            print(line, flush=True)

    def note(self, line: str) -> None:
        """One plain line about the run itself (a service died, came back), between step lines."""
        self.emit(line)

    def update(self, final: bool = False) -> None:
        """Read new rows; print steps that are complete (all remaining ones when `final`)."""
        self.tail.poll()
        replicas = replica_versions(self.tail.steps)
        for step in sorted(self.tail.steps):
            row = self.tail.steps[step]
            if (
                step in self.printed
                or step < 0
                or not (is_complete(row) or (final and has_step_metrics(row)))
            ):
                continue
            self._latest = step_line(step, row, replicas)
            self.emit(self._latest)
            self.printed.add(step)
            self.done_times.append(self.clock())
        if self._live is not None:
            self._live.update(self._panel())  # every poll: the ETA counts down between steps

    def close(self) -> None:
        """Print the remaining steps, then stop the panel (once; it is erased) and give the
        console log handler its stream back."""
        self.update(final=True)
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._log_route is not None:
            handler, stream = self._log_route
            handler.setStream(stream)
            self._log_route = None
