"""Prometheus metrics of every rlbus process, and the `/metrics` server that serves them.

    serve_metrics(service, config.metrics)   rlbus.lifecycle (every service) and the `rl` launcher:
                                             a daemon thread serves REGISTRY on metrics.host and
                                             metrics.port (0: a free port) and logs one
                                             `metrics_serving` line with the URL
    record_* / count_*                       one call where the thing happens: a trainer step, a
                                             published batch, a rollout, a dead letter, a restart
    timed_transport()                        an httpx transport timing every request (rollout
                                             workers -> vLLM, weight agent -> engine admin)
    poll_stream_stats(bus)                   the orchestrator (coordinator role): JetStream
                                             stream and consumer state every
                                             STREAM_STATS_INTERVAL_S, kept in gauges, so a scrape
                                             never waits on NATS

Names start with `rlbus_`; labels are low-cardinality (stream family, consumer, replica, process,
reason, outcome, endpoint): no run id, step or task id in either. One run is one targets file or
one compose project; Prometheus adds `instance` and the target's labels. docs/metrics.md lists
every metric.

The metrics live in this module's `REGISTRY`, not prometheus_client's global one, so a process
that imports another instrumented library serves only rlbus's series (plus the process
collector's). Each metric belongs to one component (`COMPONENTS`) and is registered when its
process starts serving (`serve_metrics` knows which components a service has) or on first use, so
a trainer exposes no orchestrator gauges stuck at 0, and the series of a service exist, at 0,
before its first event.
"""

import asyncio
import re
import threading
import time
from collections.abc import Iterable, Mapping
from functools import cache
from typing import Any

import structlog
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)

from rlbus.netutil import free_port, hostname_if_wildcard, is_wildcard

log = structlog.get_logger()

# `<name>_created` samples double every counter's series for a timestamp dashboards do not use.
disable_created_metrics()

REGISTRY = CollectorRegistry()
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)

SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32)
"""Off-policy lag in steps (an integer: bucket `le="2"` counts lags 0, 1 and 2)."""
STREAM_STATS_INTERVAL_S = 5.0
MAX_CONSUMERS_PER_STREAM = 16
"""Durable consumers reported per stream: their names are fixed in code, this only guards the
label's cardinality against a tool that creates many."""
BIND_WAIT_S = 5.0
"""A metrics port still held (a restart in place, the old socket closing) is tried this long."""

# ---- trainer (rank 0) --------------------------------------------------------------------------

TRAINER_STEPS = Counter(
    "rlbus_trainer_steps",
    "Training steps the trainer finished; outcome: trained, or skipped (its batch was quarantined).",
    ["outcome"],
    registry=None,
)
TRAINER_STEP_SECONDS = Histogram(
    "rlbus_trainer_step_seconds",
    "Wall time of one trainer step after its batch arrived: train, checkpoint, publish weights.",
    buckets=STEP_BUCKETS,
    registry=None,
)
TRAINER_BATCH_WAIT_SECONDS = Histogram(
    "rlbus_trainer_batch_wait_seconds",
    "How long the trainer waited for each step's batch (long: the orchestrator is the bottleneck).",
    buckets=STEP_BUCKETS,
    registry=None,
)
TRAINER_TOKENS = Counter(
    "rlbus_trainer_tokens",
    "Tokens of the batches the trainer trained (padding excluded).",
    registry=None,
)
TRAINER_STEP = Gauge("rlbus_trainer_step", "The last step the trainer finished.", registry=None)
WEIGHTS_PUBLISHED_VERSION = Gauge(
    "rlbus_weights_published_version",
    "The newest weights version the trainer published (version N = the model after step N).",
    registry=None,
)

# ---- orchestrator: coordinator ------------------------------------------------------------------

BATCHES = Counter(
    "rlbus_batches_published",
    "Train batches the coordinator published (one per step).",
    registry=None,
)
ORCHESTRATOR_STEP = Gauge(
    "rlbus_orchestrator_step",
    "The step of the last batch the coordinator published.",
    registry=None,
)
OFF_POLICY_LAG = Histogram(
    "rlbus_off_policy_lag_steps",
    "Per sample of each published batch: (step - 1) - the weights version that generated it.",
    buckets=LAG_BUCKETS,
    registry=None,
)
TASKS_DROPPED = Counter(
    "rlbus_tasks_dropped",
    "Training tasks ended without being trained, by reason (stale, error, zero_advantage, "
    "invalid, timeout).",
    ["reason"],
    registry=None,
)

# ---- orchestrator: rollout workers --------------------------------------------------------------

ROLLOUTS = Counter(
    "rlbus_rollouts",
    "Samples (completions) of the groups rollout workers published.",
    registry=None,
)
ROLLOUT_GROUPS = Counter(
    "rlbus_rollout_groups",
    "Groups (one task each) rollout workers published; outcome: ok, or error (the environment "
    "raised).",
    ["outcome"],
    registry=None,
)
ROLLOUT_TOKENS = Counter(
    "rlbus_rollout_tokens",
    "Tokens of the published samples; kind: prompt (per sample) or completion (generated).",
    ["kind"],
    registry=None,
)
HTTP_SECONDS = Histogram(
    "rlbus_http_client_request_seconds",
    "HTTP requests to inference, until the response headers: rollout workers to vLLM "
    "(/v1/chat/completions) and the weight agent to the engine's admin endpoints; outcome: ok, "
    "4xx, 5xx, timeout, error (no answer), cancelled.",
    ["endpoint", "outcome"],
    buckets=SECONDS_BUCKETS,
    registry=None,
)

# ---- inference ---------------------------------------------------------------------------------

WEIGHTS_VERSION = Gauge(
    "rlbus_weights_version",
    "The weights version each inference replica serves (0: the initial model).",
    ["replica"],
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
STREAM_MESSAGES = Gauge(
    "rlbus_stream_messages",
    "Messages stored in each stream of the run (tasks, rollouts: the queue depth).",
    ["stream"],
    registry=None,
)
CONSUMER_PENDING = Gauge(
    "rlbus_consumer_pending_messages",
    "Messages of the stream not yet delivered to each durable consumer (its lag).",
    ["stream", "consumer"],
    registry=None,
)
CONSUMER_ACK_PENDING = Gauge(
    "rlbus_consumer_ack_pending_messages",
    "Messages delivered to each durable consumer and not acknowledged yet (in flight).",
    ["stream", "consumer"],
    registry=None,
)
STREAM_STATS_UPDATED = Gauge(
    "rlbus_stream_stats_updated_timestamp_seconds",
    "Unix time the stream and consumer gauges were last read from JetStream.",
    registry=None,
)

# ---- launcher ----------------------------------------------------------------------------------

RESTARTS = Counter(
    "rlbus_service_restarts",
    "Restarts of each process by the `rl` launcher's supervision (process: trainer, "
    "orchestrator, inference-0, worker-1, ...).",
    ["process"],
    registry=None,
)

COMPONENTS: dict[str, tuple] = {
    "trainer": (
        TRAINER_STEPS,
        TRAINER_STEP_SECONDS,
        TRAINER_BATCH_WAIT_SECONDS,
        TRAINER_TOKENS,
        TRAINER_STEP,
        WEIGHTS_PUBLISHED_VERSION,
    ),
    "coordinator": (BATCHES, ORCHESTRATOR_STEP, OFF_POLICY_LAG, TASKS_DROPPED),
    "workers": (ROLLOUTS, ROLLOUT_GROUPS, ROLLOUT_TOKENS),
    "http": (HTTP_SECONDS,),
    "inference": (WEIGHTS_VERSION,),
    "bus": (DEAD_LETTERS,),
    "streams": (STREAM_MESSAGES, CONSUMER_PENDING, CONSUMER_ACK_PENDING, STREAM_STATS_UPDATED),
    "launcher": (RESTARTS,),
}
"""Which metrics each part of rlbus records (every metric is in exactly one)."""

SERVICE_COMPONENTS: dict[str, tuple[str, ...]] = {
    "rl": ("launcher",),
    "trainer": ("trainer", "bus"),
    "orchestrator": ("coordinator", "workers", "http", "streams", "bus"),
    "orchestrator-worker": ("workers", "http", "bus"),
    "inference": ("inference", "http", "bus"),
}
"""The components of each service (its name as rlbus.lifecycle.main gets it; `inference-<id>` is an
inference replica)."""

ALL_METRICS = tuple(dict.fromkeys(m for metrics in COMPONENTS.values() for m in metrics))

_enabled: set[str] = set()
_registered: set[int] = set()
_register_lock = threading.Lock()


def enable(*components: str) -> None:
    """Register the metrics of `components` in REGISTRY (idempotent; cheap once done), with the
    label values known in advance at 0, so their series exist before the first event."""
    if _enabled.issuperset(components):
        return
    with _register_lock:
        for component in components:
            for metric in COMPONENTS[component]:
                if id(metric) not in _registered:
                    REGISTRY.register(metric)
                    _registered.add(id(metric))
            _enabled.add(component)
    if "trainer" in components:
        for outcome in ("trained", "skipped"):
            TRAINER_STEPS.labels(outcome=outcome)
    if "workers" in components:
        for outcome in ("ok", "error"):
            ROLLOUT_GROUPS.labels(outcome=outcome)
        for kind in ("prompt", "completion"):
            ROLLOUT_TOKENS.labels(kind=kind)


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


def record_train_step(step: int, metrics: Mapping[str, float]) -> None:
    """A trainer step that finished (rank 0), from the step metrics it publishes: `step_s`,
    `wait_s`, `num_tokens`, and `skipped` / `retrained` when set (a retrained step publishes no
    weights)."""
    enable("trainer")
    skipped = bool(metrics.get("skipped"))
    TRAINER_STEPS.labels(outcome="skipped" if skipped else "trained").inc()
    TRAINER_STEP_SECONDS.observe(metrics.get("step_s", 0.0))
    TRAINER_BATCH_WAIT_SECONDS.observe(metrics.get("wait_s", 0.0))
    TRAINER_TOKENS.inc(metrics.get("num_tokens", 0.0))
    TRAINER_STEP.set(step)
    if not metrics.get("retrained"):
        WEIGHTS_PUBLISHED_VERSION.set(step)


OFF_POLICY_LAG_KEY = re.compile(r"^off_policy_lag/(-?\d+)$")


def record_batch(step: int, metrics: Mapping[str, float]) -> None:
    """A batch the coordinator published, from its step metrics: `off_policy_lag/<lag>` holds
    how many of its samples have that lag (rlbus_orchestrator.coordinator.step_metrics)."""
    enable("coordinator")
    BATCHES.inc()
    ORCHESTRATOR_STEP.set(step)
    for key, count in metrics.items():
        if match := OFF_POLICY_LAG_KEY.match(key):
            lag = int(match.group(1))
            for _ in range(int(count)):
                OFF_POLICY_LAG.observe(lag)


def count_dropped_task(reason: str) -> None:
    """A training task the coordinator dropped (one of its DROP_REASONS)."""
    enable("coordinator")
    TASKS_DROPPED.labels(reason=reason).inc()


def count_rollout(rollout: Any) -> None:
    """A group a rollout worker published (a `rlbus.wire.rollouts.Rollout`)."""
    enable("workers")
    ROLLOUT_GROUPS.labels(outcome="error" if rollout.error else "ok").inc()
    ROLLOUTS.inc(len(rollout.samples))
    ROLLOUT_TOKENS.labels(kind="prompt").inc(sum(len(s.prompt_token_ids) for s in rollout.samples))
    ROLLOUT_TOKENS.labels(kind="completion").inc(
        sum(len(s.completion_token_ids) for s in rollout.samples)
    )


def record_weights_version(replica: str, version: int) -> None:
    """The weights version inference replica `replica` serves now."""
    enable("inference")
    WEIGHTS_VERSION.labels(replica=replica).set(version)


def count_restart(process: str, num: int = 1) -> None:
    """The launcher restarted `process` (`num=0`: its series exists at 0 from its first start)."""
    enable("launcher")
    RESTARTS.labels(process=process).inc(num)


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


# ---- JetStream state ---------------------------------------------------------------------------

_stream_labels: set[tuple[str, ...]] = set()
_consumer_labels: set[tuple[str, ...]] = set()


async def refresh_stream_stats(bus: Any) -> None:
    """Read the message count of every stream of the run and the pending / ack-pending counts of
    its durable consumers into the gauges; series of streams and consumers gone since are removed.
    A stream that cannot be read (deleted by a tool, a bus outage) keeps its last values and does
    not keep the others from being read; the first such error is raised at the end."""
    enable("streams")
    subjects = bus.subjects
    streams, consumers = set(), set()
    failure: Exception | None = None
    for spec in subjects.streams():
        family = stream_family(subjects, spec.name)
        try:
            stats = await bus.stream_stats(spec.name)  # rlbus.bus.stats.StreamStats
        except Exception as error:
            failure = failure or error
            continue
        STREAM_MESSAGES.labels(stream=family).set(stats.num_messages)
        streams.add((family,))
        for consumer in stats.consumers[:MAX_CONSUMERS_PER_STREAM]:  # durable ones only
            labels = (family, consumer.durable)
            CONSUMER_PENDING.labels(*labels).set(consumer.num_pending)
            CONSUMER_ACK_PENDING.labels(*labels).set(consumer.num_ack_pending)
            consumers.add(labels)
    if failure is not None:  # what could not be read keeps its last values
        _stream_labels.update(streams)
        _consumer_labels.update(consumers)
        raise failure
    for labels in _stream_labels - streams:
        STREAM_MESSAGES.remove(*labels)
    for labels in _consumer_labels - consumers:
        CONSUMER_PENDING.remove(*labels)
        CONSUMER_ACK_PENDING.remove(*labels)
    _stream_labels.clear()
    _stream_labels.update(streams)
    _consumer_labels.clear()
    _consumer_labels.update(consumers)
    STREAM_STATS_UPDATED.set_to_current_time()


async def poll_stream_stats(bus: Any, interval_s: float = STREAM_STATS_INTERVAL_S) -> None:
    """`refresh_stream_stats` every `interval_s` until cancelled, in a process that serves
    metrics (returns at once otherwise). A bus outage is one warning line; the gauges keep their
    last values meanwhile (`rlbus_stream_stats_updated_timestamp_seconds` shows their age). Never
    raises: a supervised task that did would end the service."""
    if _address is None:
        return
    failing = False
    while True:
        try:
            await refresh_stream_stats(bus)
            failing = False
        except Exception as error:
            if not failing:
                log.warning("stream_stats_failed", error=repr(error), retry_in_s=interval_s)
            failing = True
        await asyncio.sleep(interval_s)


def metric_names(metrics: Iterable = ALL_METRICS) -> set[str]:
    """The names of `metrics` as a query spells them without a suffix (`rlbus_trainer_steps`)."""
    return {metric._name for metric in metrics}
