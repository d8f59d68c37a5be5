"""Prometheus metrics of every rlbus process: the registry, the `/metrics` server, and the series
every kind of process shares. Each service declares its own series in its own package
(`rlbus_trainer.metrics`, `rlbus_orchestrator.metrics`, `rlbus_inference.metrics`,
`rlbus_launch.metrics`) with `declare`; this module serves them.

    declare(component, *metrics)             a package's series, named by component (at import)
    serve_metrics(service, config.metrics)   rlbus.lifecycle (every service) and the `rl` launcher:
                                             a daemon thread serves REGISTRY on metrics.host and
                                             metrics.port (0: a free port) and logs one
                                             `metrics_serving` line with the URL
    count_dead_letter(...)                   the bus, where a message is quarantined
    timed_transport()                        an httpx transport timing every request (rollout
                                             workers -> vLLM, weight agent -> engine admin)

Names start with `rlbus_`; labels are low-cardinality (stream family, consumer, replica, process,
reason, outcome, endpoint): no run id, step or task id in either. One run is one targets file or
one compose project; Prometheus adds `instance` and the target's labels. docs/metrics.md lists
every metric.

The metrics live in this module's `REGISTRY`, not prometheus_client's global one, so a process
that imports another instrumented library serves only rlbus's series (plus the process
collector's). Each metric belongs to one component and is registered when its process starts
serving (`SERVICE_COMPONENTS` says which components a service has) or on first use, so a trainer
exposes no orchestrator gauges stuck at 0, and the series of a service exist, at 0, before its
first event.
"""

import asyncio
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any

import structlog
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.metrics import MetricWrapperBase

from rlbus.netutil import free_port, hostname_if_wildcard, is_wildcard

log = structlog.get_logger()

# `<name>_created` samples double every counter's series for a timestamp dashboards do not use.
disable_created_metrics()

REGISTRY = CollectorRegistry()
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)

SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
BIND_WAIT_S = 5.0
"""A metrics port still held (a restart in place, the old socket closing) is tried this long."""

# ---- HTTP clients (rollout workers, the weight agent) --------------------------------------------

HTTP_SECONDS = Histogram(
    "rlbus_http_client_request_seconds",
    "HTTP requests to inference, until the response headers: rollout workers to vLLM "
    "(/v1/chat/completions) and the weight agent to the engine's admin endpoints; outcome: ok, "
    "4xx, 5xx, timeout, error (no answer), cancelled.",
    ["endpoint", "outcome"],
    buckets=SECONDS_BUCKETS,
    registry=None,
)

# ---- the bus (any process) ---------------------------------------------------------------------

DEAD_LETTERS = Counter(
    "rlbus_dead_letters",
    "Messages this process moved to the run's dead-letter stream; stream: the stream or KV bucket "
    "they came from; reason: handler_failed, invalid, or the decoding error's type.",
    ["stream", "reason"],
    registry=None,
)


@dataclass(frozen=True)
class Component:
    """A named group of series that one kind of process records."""

    metrics: tuple[MetricWrapperBase, ...]
    zero: Callable[[], None] | None = None
    """Touches the label values known in advance, so their series exist at 0."""


COMPONENTS: dict[str, Component] = {}
"""Every declared component by name (each metric is in exactly one)."""

SERVICE_COMPONENTS: dict[str, tuple[str, ...]] = {
    "rl": ("launcher",),
    "trainer": ("trainer", "bus"),
    "orchestrator": ("coordinator", "workers", "http", "streams", "bus"),
    "orchestrator-worker": ("workers", "http", "bus"),
    "inference": ("inference", "http", "bus"),
}
"""The components of each service (its name as rlbus.lifecycle.main gets it; `inference-<id>` is
an inference replica). A component is declared by the package that records it."""

_wanted: set[str] = set()
_registered: set[str] = set()
_register_lock = threading.Lock()


def declare(name: str, *metrics: MetricWrapperBase, zero: Callable[[], None] | None = None) -> None:
    """Declare component `name` (once, at import of the package that records it); registered at
    once when its process already serves it."""
    assert name not in COMPONENTS, f"metrics component {name!r} declared twice"
    COMPONENTS[name] = Component(metrics, zero)
    if name in _wanted:
        enable(name)


def enable(*components: str) -> None:
    """Register the metrics of `components` in REGISTRY (idempotent; cheap once done), with the
    label values known in advance at 0, so their series exist before the first event. A component
    not declared yet is registered when its package declares it."""
    if _registered.issuperset(components):
        return
    with _register_lock:
        _wanted.update(components)
        for name in components:
            component = COMPONENTS.get(name)
            if component is None or name in _registered:
                continue
            for metric in component.metrics:
                REGISTRY.register(metric)
            _registered.add(name)
            if component.zero is not None:
                component.zero()


declare("http", HTTP_SECONDS)
declare("bus", DEAD_LETTERS)


def service_components(service: str) -> tuple[str, ...]:
    """The components of `service` (`inference-3` is an inference replica); none when unknown."""
    if service.startswith("inference"):
        return SERVICE_COMPONENTS["inference"]
    return SERVICE_COMPONENTS.get(service, ())


# ---- the /metrics server -------------------------------------------------------------------------

_address: tuple[str, int] | None = None
_server_lock = threading.Lock()


def host_port(host: str, port: int) -> str:
    """`host:port` (`[v6]:port` for an IPv6 address), as Prometheus targets and URLs spell it."""
    host = hostname_if_wildcard(host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def serving_address() -> tuple[str, int] | None:
    """(host, port) this process serves /metrics on, or None."""
    return _address


def serve_metrics(service: str, config: Any, *, rank: int | None = None) -> str | None:
    """Serve REGISTRY on `config.host:config.port` (a MetricsConfig; None: off) from a daemon
    thread, once per process; returns the URL (None when off). Only rank 0 of a torchrun job
    serves: the ranks step in lockstep, and rank 0 publishes the step. A port that cannot be bound
    is one `metrics_server_failed` error line, not a failed service: metrics never stop a run."""
    global _address
    if config is None or rank:
        return None
    enable(*service_components(service))
    with _server_lock:
        if _address is None:
            port = bind(config.host, config.port)
            if port is None:
                return None
            _address = (config.host, port)
            log.info(
                "metrics_serving", service=service, url=f"http://{host_port(*_address)}/metrics"
            )
    return f"http://{host_port(*_address)}/metrics"


def bind(host: str, port: int) -> int | None:
    """Start the server thread on host:port (0: a free port); returns the bound port, or None
    after BIND_WAIT_S of failures (logged)."""
    deadline = time.monotonic() + BIND_WAIT_S
    while True:
        try:
            # 0: a port this process has not planned for another (rlbus.netutil.free_port), not
            # the OS's pick, which may be a planned service port not bound yet.
            chosen = port or free_port("127.0.0.1" if is_wildcard(host) else host)
            server, _thread = start_http_server(chosen, addr=host, registry=REGISTRY)
            return server.server_port
        except OSError as error:
            if time.monotonic() >= deadline:
                log.error(
                    "metrics_server_failed",
                    host=host,
                    port=port,
                    error=str(error),
                    hint="this process serves no /metrics; pick another --metrics.port",
                )
                return None
            time.sleep(0.25)


# ---- recording ---------------------------------------------------------------------------------


def stream_family(subjects: Any, name: str) -> str:
    """`tasks` for `RLBUS_<run>_TASKS`, `weights` for bucket `rlbus_<run>_weights`: the name of a
    stream or KV bucket without the run id (`subjects` is the run's RunSubjects)."""
    for prefix in (f"RLBUS_{subjects.run_id}_", f"rlbus_{subjects.run_id}_"):
        if name.startswith(prefix):
            return name[len(prefix) :].lower()
    return "other"


EXCEPTION_PREFIX = re.compile(r"^([A-Za-z_]\w*(?:Error|Exception)):")


def dead_letter_reason(reason: str) -> str:
    """A low-cardinality class of a dead-letter reason (free text): `handler_failed` (the handler
    raised on every delivery), the snake_case type of a decoding error (`decode_error`,
    `validation_error`, `claim_check_error`), else `invalid` (a message that decoded but broke a
    rule: a bad rollout, a batch the trainer rejected)."""
    if reason.startswith("handler failed"):
        return "handler_failed"
    if match := EXCEPTION_PREFIX.match(reason):
        return re.sub(r"(?<!^)(?=[A-Z])", "_", match.group(1)).lower()
    return "invalid"


def count_dead_letter(subjects: Any, stream: str, reason: str) -> None:
    """A message of `stream` (or KV bucket) this process quarantined because of `reason`."""
    enable("bus")
    DEAD_LETTERS.labels(
        stream=stream_family(subjects, stream), reason=dead_letter_reason(reason)
    ).inc()


# ---- HTTP client timing ------------------------------------------------------------------------


def status_outcome(status: int) -> str:
    return "ok" if status < 400 else f"{status // 100}xx"


@cache
def _timed_transport_class() -> type:
    """Built on first use: httpx is a dependency of the services that make requests, not of every
    process that imports this module."""
    import httpx

    class TimedTransport(httpx.AsyncHTTPTransport):
        """An httpx transport that observes HTTP_SECONDS for every request it sends."""

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            started = time.perf_counter()
            outcome = "error"
            try:
                response = await super().handle_async_request(request)
                outcome = status_outcome(response.status_code)
                return response
            except httpx.TimeoutException:
                outcome = "timeout"
                raise
            except asyncio.CancelledError:
                outcome = "cancelled"
                raise
            finally:
                HTTP_SECONDS.labels(endpoint=request.url.path, outcome=outcome).observe(
                    time.perf_counter() - started
                )

    return TimedTransport


def timed_transport(limits: Any = None) -> Any:
    """An `httpx.AsyncHTTPTransport` that times every request into
    `rlbus_http_client_request_seconds{endpoint, outcome}`. Pass the client's `httpx.Limits` here:
    a client given a transport ignores its own `limits`."""
    import httpx

    enable("http")
    transport = _timed_transport_class()
    return transport(
        limits=limits or httpx.Limits(max_connections=100, max_keepalive_connections=20)
    )


def all_metrics() -> tuple[MetricWrapperBase, ...]:
    """Every declared metric (of the packages imported in this process)."""
    return tuple(m for component in COMPONENTS.values() for m in component.metrics)


def metric_names(metrics: Iterable[MetricWrapperBase] | None = None) -> set[str]:
    """The names of `metrics` (default: every declared one) as a query spells them without a
    suffix (`rlbus_trainer_steps`)."""
    return {metric._name for metric in (all_metrics() if metrics is None else metrics)}
