"""The inference replica's Prometheus series, declared here and served by `rlbus.obs.metrics`
(the HTTP client timing of the weight agent is the core's `timed_transport`)."""

from prometheus_client import Gauge

from rlbus.obs.metrics import declare, enable

WEIGHTS_VERSION = Gauge(
    "rlbus_weights_version",
    "The weights version each inference replica serves (0: the initial model).",
    ["replica"],
    registry=None,
)

declare("inference", WEIGHTS_VERSION)


def record_weights_version(replica: str, version: int) -> None:
    """The weights version inference replica `replica` serves now."""
    enable("inference")
    WEIGHTS_VERSION.labels(replica=replica).set(version)
