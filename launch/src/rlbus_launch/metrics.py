"""The `rl` launcher's Prometheus series, declared here and served by `rlbus.obs.metrics`."""

from prometheus_client import Counter

from rlbus.obs.metrics import declare, enable

RESTARTS = Counter(
    "rlbus_service_restarts",
    "Restarts of each process by the `rl` launcher's supervision (process: trainer, "
    "orchestrator, inference-0, worker-1, ...).",
    ["process"],
    registry=None,
)

declare("launcher", RESTARTS)


def count_restart(process: str, num: int = 1) -> None:
    """The launcher restarted `process` (`num=0`: its series exists at 0 from its first start)."""
    enable("launcher")
    RESTARTS.labels(process=process).inc(num)
