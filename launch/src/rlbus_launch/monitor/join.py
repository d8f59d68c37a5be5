"""Joining the per-service step metrics of one step into one row, once per step.

A step's row is written once across monitor restarts: a restarted monitor starts from the steps
already in metrics.jsonl (`StepJoiner.resume`), and events of a step already written (redelivered
because the monitor died between writing and acking, or republished by a trainer that retrains
the step after a resume) are acked without a second row. A row that is not ready when the monitor
stops is not written: its events stay unacked for the next monitor (`held_tokens`), so a partial
row (e.g. only weights acks for step k+1) never takes the place of the real one.

Rows are written in step order: a row waits up to `gap_wait_s` for earlier steps this monitor
has not seen (held by a monitor that was killed, redelivered after the ack wait).

Metrics a service sends again after a restart (`replayed`) fill a row that lacks the service
and are otherwise only acked. When the run is over, `rows_with_metrics` lets the last monitor
write the rows still missing a service (nobody will send the rest).

A row missing a service is written without it only after `wait_s` (a restarting coordinator or
trainer republishes a step's metrics a minute or more later, and a row written without them
would drop them for good), and when `lookahead` later steps are complete.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlbus.obs.sinks import JoinedRow
from rlbus.wire.events import StepMetrics
from rlbus.wire.weights import WeightsApplied, WeightsFailed

JOINED_SERVICES = ("orchestrator", "trainer")
REPLAYED_KEY = "replayed"
"""Set (1.0) on a service's step metrics sent again after a restart, in case they were lost."""
MONITOR_PREFIXES = ("weights/", "dead_letters/")
"""Keys the monitor adds to a row itself (weights acks, the dead-letter count)."""


def has_step_metrics(row: dict[str, Any]) -> bool:
    """Whether a written row holds a service's metrics (not only what the monitor adds to it)."""
    return any(key != "step" and not key.startswith(MONITOR_PREFIXES) for key in row)


@dataclass
class PendingRow:
    values: dict[str, Any] = field(default_factory=dict)
    services: set[str] = field(default_factory=set)
    service_keys: dict[str, str] = field(default_factory=dict)
    """Row key -> `<service>/<metric>` (see JoinedRow)."""
    tokens: list[Any] = field(default_factory=list)
    """Whatever the caller wants back when the row is written (e.g. deliveries to ack)."""
    since: float = 0.0
    """When the row's first event arrived (the joiner's clock)."""


@dataclass
class StepJoiner:
    """Buffers step events until every expected service reported the step.

    A row is also released once it waited `wait_s` and a step `lookahead` steps later is complete,
    so a service that never reports a step delays its row but never blocks the file.
    """

    expected: tuple[str, ...] = JOINED_SERVICES
    lookahead: int = 2
    wait_s: float = 180.0
    """How long a row waits for a missing service (a restart takes up to a few minutes on CPU)."""
    gap_wait_s: float = 60.0
    """How long a row waits for earlier steps this monitor has not seen at all: the events a
    killed monitor held come back only after the consumer's ack wait (`bus.ack_wait_s`, 30 s),
    and the later steps must not be written before them (metrics.jsonl is in step order)."""
    max_pending: int = 256
    """A row is released anyway once this many newer steps have data (a service is gone)."""
    clock: Callable[[], float] = time.monotonic
    pending: dict[int, PendingRow] = field(default_factory=dict)
    last_written: int = -1
    written: set[int] = field(default_factory=set)
    """Steps whose row (with a service's metrics) is written: never written again."""

    def resume(self, rows: list[dict[str, Any]]) -> None:
        """Start after the rows a previous monitor wrote (metrics.jsonl, in file order)."""
        steps = [int(row["step"]) for row in rows if "step" in row]
        self.written.update(
            int(row["step"]) for row in rows if "step" in row and has_step_metrics(row)
        )
        self.last_written = max([self.last_written, *steps])

    def is_written(self, step: int) -> bool:
        return step in self.written

    def add_metrics(
        self, event: StepMetrics, token: Any = None
    ) -> list[tuple[JoinedRow, list[Any]]]:
        """Add a service's metrics of a step; the caller skips (and acks) a step `is_written`."""
        assert not self.is_written(event.step), "ack a step already written, do not add it"
        row = self._row(event.step, token)
        if event.metrics.get(REPLAYED_KEY) and event.service in row.services:
            return self.ready()  # sent again after a restart: the row has them already
        for key, value in event.metrics.items():
            # Same metric name from two services: keep both, prefixed by service.
            name = f"{event.service}/{key}"
            if key in row.values and key not in _own_keys(row, event.service):
                row.values[name] = value
                row.service_keys[name] = name
            else:
                row.values[key] = value
                row.service_keys[key] = name
        row.values.setdefault("time", event.time)
        row.values["time"] = max(row.values["time"], event.time)
        row.services.add(event.service)
        return self.ready()

    def add_weights(
        self, event: WeightsApplied | WeightsFailed, token: Any = None
    ) -> list[tuple[JoinedRow, list[Any]]]:
        """A weights ack goes into the row of the step that published its version, or, when that
        row is already written (acks usually arrive after the trainer's metrics), into the next
        row, so no step is written twice. `weights/applied/<replica>` holds the version applied."""
        step = event.version if event.version > self.last_written else self._next_step()
        row = self._row(step, token)
        if isinstance(event, WeightsApplied):
            row.values["weights/num_applied"] = row.values.get("weights/num_applied", 0) + 1
            key = f"weights/applied/{event.replica_id}"
            row.values[key] = max(row.values.get(key, -1), event.version)
            row.values["weights/apply_s"] = max(
                row.values.get("weights/apply_s", 0.0), event.duration_s
            )
        else:
            row.values["weights/num_failed"] = row.values.get("weights/num_failed", 0) + 1
        return self.ready()

    def _next_step(self) -> int:
        """The first step not written yet that already has data, else the one after the last written."""
        later = [step for step in self.pending if step > self.last_written]
        return min(later, default=self.last_written + 1)

    def ready(self) -> list[tuple[JoinedRow, list[Any]]]:
        """Rows that can be written now, in step order: (row, tokens)."""
        complete = [s for s, r in self.pending.items() if set(self.expected) <= r.services]
        late = max(complete, default=-1) - self.lookahead
        crowded = max(self.pending, default=-1) - self.max_pending
        now = self.clock()
        out = []
        for step in sorted(self.pending):
            row = self.pending[step]
            unseen_before = step > max(self.last_written, 0) + 1  # steps 1.. are numbered
            if unseen_before and now - row.since < self.gap_wait_s and step > crowded:
                break
            overdue = step <= late and now - row.since >= self.wait_s
            if set(self.expected) <= row.services or overdue or step <= crowded:
                out.append(self._pop(step))
            else:
                break
        return out

    def rows_with_metrics(self) -> list[tuple[JoinedRow, list[Any]]]:
        """Every buffered row that holds a service's metrics, complete or not (the run is over:
        no restarted service will send what is missing, and no later monitor will write it)."""
        steps = [s for s, r in self.pending.items() if r.services]
        return [self._pop(step) for step in sorted(steps)]

    def complete_rows(self) -> list[tuple[JoinedRow, list[Any]]]:
        """Every complete buffered row, even behind an incomplete one (at a clean stop: a step
        whose metrics were lost for good must not keep the later, complete rows out of the file)."""
        done = [s for s, r in self.pending.items() if set(self.expected) <= r.services]
        return [self._pop(step) for step in sorted(done)]

    def flush(self) -> list[tuple[JoinedRow, list[Any]]]:
        """Every buffered row, complete or not (a one-shot join; the monitor uses `held_tokens`)."""
        return [self._pop(step) for step in sorted(self.pending)]

    def held_tokens(self) -> list[Any]:
        """Tokens of the rows not written yet (at shutdown: handed back for the next monitor)."""
        return [token for row in self.pending.values() for token in row.tokens]

    def _row(self, step: int, token: Any) -> PendingRow:
        row = self.pending.get(step)
        if row is None:
            row = self.pending[step] = PendingRow(since=self.clock())
        if token is not None:
            row.tokens.append(token)
        return row

    def _pop(self, step: int) -> tuple[JoinedRow, list[Any]]:
        row = self.pending.pop(step)
        self.last_written = max(self.last_written, step)
        out = JoinedRow({"step": step, **row.values}, row.service_keys)
        if has_step_metrics(out):
            self.written.add(step)
        return out, row.tokens


def _own_keys(row: PendingRow, service: str) -> set[str]:
    """Keys a service wrote itself (only known when it is the only one so far)."""
    return set(row.values) if row.services <= {service} else set()
