"""Monitors: the run's step events (bus) -> `<run_dir>/metrics.jsonl` and, when enabled, wandb.

    events stream ──(durable "monitor")──▶ StepJoiner ──rows──▶ JsonlSink / WandbSink
                                                          └─▶ ack the events of written rows

Trainer and orchestrator each publish a `StepMetrics` per step; the joiner writes one row per step
once both have arrived (or when the run has moved on, so a missing one never blocks the file).
Events are acked only after their row is written, so a monitor killed mid-run re-reads what it
had not written yet; a restarted monitor starts from the steps already in metrics.jsonl, so each
step has one row across restarts (monitors/join.py). Every row carries `dead_letters/total`. `python -m rlbus_launch.monitor @ <run_dir>/configs/rl.toml` runs it as a process.

The monitor is the run's only wandb writer: one wandb run for the whole RL run, each service's
metrics under `<service>/`, finished when the monitor stops (also on SIGTERM).
"""

from rlbus.obs.sinks import JoinedRow, JsonlSink, WandbSink, build_sinks, check_sinks_installed
from rlbus_launch.monitor.join import StepJoiner

__all__ = [
    "JoinedRow",
    "JsonlSink",
    "StepJoiner",
    "WandbSink",
    "build_sinks",
    "check_sinks_installed",
]
