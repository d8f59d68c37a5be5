"""Prometheus scrape targets of an `rl` run: `<run_dir>/metrics/targets.json`.

The file is in Prometheus' file-based service discovery format (`file_sd_configs`), one entry per
process that serves /metrics: the launcher itself (`rl`: its restart counter) and each service it
started, on the ports rlbus_launch.plan wrote into their configs:

    [{"targets": ["127.0.0.1:40123"],
      "labels": {"service": "trainer", "instance": "trainer", "run": "<run name>"}}, ...]

`service` is the kind of process (`inference`, `orchestrator`, `worker`, `trainer`, `rl`),
`instance` the process's name in the run (`inference-1`, `worker-0`, ...), `run` the run's name (a
Prometheus watching several runs' files tells them apart; it is a target label, never a metric's).
A process is listed once it has been started; a restart keeps its port, so its entry stays. The
list is emptied when the launcher exits: a Prometheus watching the file (it re-reads it on change)
scrapes exactly the processes of the live run. Each write replaces the file atomically, so
Prometheus never reads half of one. The monitor and nats-server serve no rlbus metrics.
"""

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from rlbus.obs import metrics
from rlbus_launch.metrics import count_restart
from rlbus_launch.plan import Launch

log = structlog.get_logger()

TARGETS_FILE = Path("metrics") / "targets.json"


def service_of(process: str) -> str:
    """`inference` for process `inference-1`, `worker` for `worker-0`; other names as they are."""
    return re.sub(r"-\d+$", "", process)


@dataclass
class ScrapeTargets:
    """The targets file of one launch (see module docstring)."""

    path: Path
    run: str
    planned: dict[str, str]
    """process -> `host:port` of its /metrics."""
    listed: dict[str, str] = field(default_factory=dict)

    @classmethod
    def for_launch(cls, launch: Launch) -> "ScrapeTargets":
        """Serve the launcher's own /metrics (`rl`'s `metrics` block; `--no-metrics`: no server,
        and no service has one either) and list it."""
        targets = cls(launch.run_dir / TARGETS_FILE, launch.config.run.name or "", launch.metrics)
        if metrics.serve_metrics("rl", launch.config.metrics) is not None:
            address = metrics.serving_address()
            assert address is not None, "serve_metrics returned a URL: it serves"
            targets.listed["rl"] = metrics.host_port(*address)
            targets.write()
        if targets.planned:
            log.info("metrics_targets", path=str(targets.path), num_services=len(targets.planned))
        return targets

    def started(self, process: str) -> None:
        """`process` was started: list it (its restart counter exists from now on, at 0)."""
        if process not in self.planned or process in self.listed:
            return
        self.listed[process] = self.planned[process]
        count_restart(process, 0)
        self.write()

    def close(self) -> None:
        """The launch is over: nothing left to scrape."""
        if self.listed:
            self.listed.clear()
            self.write()

    def entries(self) -> list[dict]:
        return [
            {
                "targets": [address],
                "labels": {"service": service_of(name), "instance": name, "run": self.run},
            }
            for name, address in self.listed.items()
        ]

    def write(self) -> None:
        """Replace the file atomically; a failed write is a warning line (metrics never stop a
        run, nor the launcher's shutdown)."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.entries(), indent=2) + "\n")
            os.replace(tmp, self.path)
        except OSError as error:
            log.warning("metrics_targets_unwritten", path=str(self.path), error=str(error))
