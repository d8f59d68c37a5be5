"""rlbus.obs.metrics and the series each package declares (rlbus_trainer.metrics,
rlbus_orchestrator.metrics, rlbus_inference.metrics, rlbus_launch.metrics): the /metrics server, what each record_* call adds, the low-cardinality
labels, the HTTP transport's timing and the JetStream gauges (a fake bus: no NATS here)."""

import http.server
import threading
import urllib.request

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlbus.bus.stats import ConsumerStats, StreamStats
from rlbus.configs.common import MetricsConfig
from rlbus.netutil import free_port
from rlbus.obs import metrics
from rlbus.wire.rollouts import Rollout, RolloutSample
from rlbus.wire.subjects import RunSubjects
from rlbus_inference import metrics as inference_metrics
from rlbus_launch import metrics as launch_metrics
from rlbus_orchestrator import metrics as orchestrator_metrics
from rlbus_trainer import metrics as trainer_metrics

FORBIDDEN_LABELS = {"run", "run_id", "step", "task_id", "version"}


def value(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def scrape(url: str) -> dict[str, list]:
    """metric family name -> its samples, from one GET of `url`."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def make_sample(prompt: int, completion: int, version: int = 0) -> RolloutSample:
    return RolloutSample(
        prompt_token_ids=list(range(prompt)),
        completion_token_ids=list(range(completion)),
        completion_logprobs=[-0.5] * completion,
        completion_mask=[1] * completion,
        reward=1.0,
        policy_version=version,
    )


def test_every_metric_is_rlbus_prefixed_with_low_cardinality_labels():
    for metric in metrics.all_metrics():
        assert metric._name.startswith("rlbus_"), metric._name
        assert not FORBIDDEN_LABELS & set(metric._labelnames), (metric._name, metric._labelnames)
        assert metric._documentation, metric._name


def test_serve_metrics_serves_the_service_series_once_per_process_and_only_on_rank_0():
    assert metrics.serve_metrics("trainer", MetricsConfig(), rank=1) is None
    assert metrics.serve_metrics("trainer", None) is None
    url = metrics.serve_metrics("trainer", MetricsConfig())
    assert url is not None and url.startswith("http://127.0.0.1:")
    assert metrics.serve_metrics("trainer", MetricsConfig(port=1)) == url  # once per process
    families = scrape(url)
    # registered at start, at 0, before the first step
    steps = {s.labels["outcome"]: s.value for s in families["rlbus_trainer_steps"]}
    assert set(steps) == {"trained", "skipped"}
    assert "rlbus_trainer_step_seconds" in families and "process_cpu_seconds" in families


def test_a_port_that_stays_taken_is_one_error_not_a_failed_service(monkeypatch):
    monkeypatch.setattr(metrics, "BIND_WAIT_S", 0.3)
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert metrics.bind("127.0.0.1", taken.getsockname()[1]) is None


def test_record_train_step_counts_steps_tokens_and_the_published_version():
    trained = value("rlbus_trainer_steps_total", outcome="trained")
    skipped = value("rlbus_trainer_steps_total", outcome="skipped")
    tokens = value("rlbus_trainer_tokens_total")
    observed = value("rlbus_trainer_step_seconds_count")

    trainer_metrics.record_train_step(7, {"step_s": 1.5, "wait_s": 0.2, "num_tokens": 300.0})
    assert value("rlbus_trainer_step") == 7 and value("rlbus_weights_published_version") == 7
    trainer_metrics.record_train_step(8, {"step_s": 0.1, "wait_s": 0.0, "skipped": 1.0})
    trainer_metrics.record_train_step(9, {"step_s": 0.1, "wait_s": 0.0, "retrained": 1.0})

    assert value("rlbus_trainer_steps_total", outcome="trained") == trained + 2
    assert value("rlbus_trainer_steps_total", outcome="skipped") == skipped + 1
    assert value("rlbus_trainer_tokens_total") == tokens + 300
    assert value("rlbus_trainer_step_seconds_count") == observed + 3
    assert value("rlbus_trainer_step") == 9
    assert value("rlbus_weights_published_version") == 8  # a retrained step publishes nothing


def test_record_batch_observes_each_sample_s_off_policy_lag():
    count = value("rlbus_off_policy_lag_steps_count")
    at_most_0 = value("rlbus_off_policy_lag_steps_bucket", le="0.0")
    batches = value("rlbus_batches_published_total")

    orchestrator_metrics.record_batch(
        4, {"off_policy_lag/0": 3.0, "off_policy_lag/2": 5.0, "reward/mean": 0.5}
    )

    assert value("rlbus_batches_published_total") == batches + 1
    assert value("rlbus_orchestrator_step") == 4
    assert value("rlbus_off_policy_lag_steps_count") == count + 8
    assert value("rlbus_off_policy_lag_steps_bucket", le="0.0") == at_most_0 + 3


def test_record_batch_sets_the_mean_reward_of_each_environment():
    orchestrator_metrics.record_batch(
        5, {"reward/mean": 0.5, "env/a/reward/mean": 0.25, "env/org/b/reward/mean": 0.75}
    )

    assert value("rlbus_orchestrator_reward_mean", env="a") == 0.25
    assert value("rlbus_orchestrator_reward_mean", env="org/b") == 0.75


def test_record_batch_sets_the_skipped_prompts_and_counts_the_skips():
    skips = value("rlbus_prompt_skips_total")
    step = {"difficulty/skipped_easy": 3.0, "difficulty/skipped_hard": 1.0}
    orchestrator_metrics.record_batch(6, step | {"difficulty/skips": 4.0})
    orchestrator_metrics.record_batch(7, step | {"difficulty/skips": 2.0})

    assert value("rlbus_prompts_skipped", kind="easy") == 3
    assert value("rlbus_prompts_skipped", kind="hard") == 1
    assert value("rlbus_prompt_skips_total") == skips + 6


def test_observe_eval_sets_the_last_evaluation_s_reward_and_pass_at_k_of_its_env():
    orchestrator_metrics.observe_eval(
        "rev",
        {
            "eval/rev/reward/mean": 0.41,
            "eval/rev/pass@1": 0.25,
            "eval/rev/pass@4": 0.5,
            "eval/rev/mean@4": 0.3,
            "eval/rev/num_examples": 16.0,
        },
    )
    orchestrator_metrics.observe_eval("rev", {"eval/rev/reward/mean": 0.5, "eval/rev/pass@1": 0.3})

    assert value("rlbus_eval_reward", env="rev") == 0.5
    assert value("rlbus_eval_pass_at_k", env="rev", k="1") == 0.3
    assert value("rlbus_eval_pass_at_k", env="rev", k="4") == 0.5


def test_count_rollout_counts_samples_groups_tokens_and_left_out_episodes_by_env():
    samples = value("rlbus_rollouts_total", env="e")
    ok = value("rlbus_rollout_groups_total", outcome="ok", env="e")
    partial = value("rlbus_rollout_groups_total", outcome="partial", env="e")
    failed = value("rlbus_rollout_groups_total", outcome="error", env="e")
    prompt = value("rlbus_rollout_tokens_total", kind="prompt", env="e")
    completion = value("rlbus_rollout_tokens_total", kind="completion", env="e")
    timeouts = value("rlbus_episodes_dropped_total", reason="timeout", env="e")

    group = [make_sample(10, 4), make_sample(10, 6)]
    orchestrator_metrics.count_rollout(
        Rollout(task_id="train-1", step=1, env_id="e", samples=group)
    )
    orchestrator_metrics.count_rollout(
        Rollout(task_id="train-2", step=1, env_id="e", samples=[], error="x")
    )
    orchestrator_metrics.count_rollout(
        Rollout(task_id="train-3", step=1, env_id="e", samples=group[:1], dropped={"timeout": 1})
    )

    assert value("rlbus_rollouts_total", env="e") == samples + 3
    assert value("rlbus_rollout_groups_total", outcome="ok", env="e") == ok + 1
    assert value("rlbus_rollout_groups_total", outcome="partial", env="e") == partial + 1
    assert value("rlbus_rollout_groups_total", outcome="error", env="e") == failed + 1
    assert value("rlbus_rollout_tokens_total", kind="prompt", env="e") == prompt + 30
    assert value("rlbus_rollout_tokens_total", kind="completion", env="e") == completion + 14
    assert value("rlbus_episodes_dropped_total", reason="timeout", env="e") == timeouts + 1


def test_weights_version_dropped_tasks_and_restarts_are_labelled_by_replica_reason_process():
    inference_metrics.record_weights_version("replica-a", 3)
    orchestrator_metrics.count_dropped_task("stale", "reverse-text")
    before = value("rlbus_service_restarts_total", process="trainer")
    launch_metrics.count_restart("trainer", 0)
    launch_metrics.count_restart("trainer")
    assert value("rlbus_weights_version", replica="replica-a") == 3
    assert value("rlbus_tasks_dropped_total", reason="stale", env="reverse-text") >= 1
    assert value("rlbus_service_restarts_total", process="trainer") == before + 1


@pytest.mark.parametrize(
    ("reason", "label"),
    [
        ("handler failed on 5 deliveries (bus.max_deliver=5): KeyError: 'x'", "handler_failed"),
        ("DecodeError: Expected `object`, got `int`", "decode_error"),
        ("ValidationError: Object missing required field `step`", "validation_error"),
        ("ClaimCheckError: sha256 mismatch", "claim_check_error"),
        ("group of 3 samples, expected group_size=8", "invalid"),
        ("rejected by another rank", "invalid"),
    ],
)
def test_dead_letter_reasons_fall_into_a_few_classes(reason, label):
    assert metrics.dead_letter_reason(reason) == label


def test_dead_letters_name_the_stream_without_the_run_id():
    subjects = RunSubjects("my.run-1")
    assert metrics.stream_family(subjects, subjects.rollouts_stream) == "rollouts"
    assert metrics.stream_family(subjects, subjects.weights_bucket) == "weights"
    assert metrics.stream_family(subjects, "SOMETHING_ELSE") == "other"
    before = value("rlbus_dead_letters_total", stream="batches", reason="decode_error")
    metrics.count_dead_letter(subjects, subjects.batches_stream, "DecodeError: truncated")
    assert value("rlbus_dead_letters_total", stream="batches", reason="decode_error") == before + 1


class StatusHandler(http.server.BaseHTTPRequestHandler):
    """`GET /status/<code>` answers <code>; `/slow` answers after 2 s."""

    def do_GET(self):
        if self.path == "/slow":
            threading.Event().wait(2.0)
        code = int(self.path.rsplit("/", 1)[-1]) if self.path.startswith("/status/") else 200
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def status_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StatusHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


async def test_timed_transport_observes_each_request_by_endpoint_and_outcome(status_server):
    def count(endpoint: str, outcome: str) -> float:
        return value("rlbus_http_client_request_seconds_count", endpoint=endpoint, outcome=outcome)

    before = {
        key: count(*key)
        for key in [("/status/200", "ok"), ("/status/404", "4xx"), ("/status/503", "5xx"),
                    ("/slow", "timeout"), ("/nothing", "error")]
    }  # fmt: skip
    closed = f"http://127.0.0.1:{free_port()}"
    async with httpx.AsyncClient(transport=metrics.timed_transport(), timeout=0.5) as client:
        for code in (200, 404, 503):
            await client.get(f"{status_server}/status/{code}")
        with pytest.raises(httpx.TimeoutException):
            await client.get(f"{status_server}/slow")
        with pytest.raises(httpx.ConnectError):
            await client.get(f"{closed}/nothing")
    for key, old in before.items():
        assert count(*key) == old + 1, key


def consumer(durable: str, pending: int, ack_pending: int) -> ConsumerStats:
    return ConsumerStats(durable=durable, num_pending=pending, num_ack_pending=ack_pending)


class FakeStatsBus:
    """`Bus.stream_stats` of a run, from dicts the test changes between reads."""

    def __init__(self, subjects: RunSubjects):
        self.subjects = subjects
        self.messages = {spec.name: 0 for spec in subjects.streams()}
        self.consumers: dict[str, list[ConsumerStats]] = {}
        self.down = False

    async def stream_stats(self, name: str) -> StreamStats:
        if self.down:
            raise TimeoutError()
        consumers = tuple(self.consumers.get(name, []))
        return StreamStats(name, self.messages[name], 1, self.messages[name], consumers)


async def test_stream_stats_report_queue_depth_and_lag_of_durable_consumers():
    subjects = RunSubjects("stats-run")
    bus = js = FakeStatsBus(subjects)
    js.messages[subjects.tasks_stream] = 12
    js.consumers[subjects.tasks_stream] = [consumer("rollout-workers", 5, 7)]
    js.consumers[subjects.events_stream] = [consumer("monitor", 2, 0)]

    await orchestrator_metrics.refresh_stream_stats(bus)
    assert value("rlbus_stream_messages", stream="tasks") == 12
    labels = {"stream": "tasks", "consumer": "rollout-workers"}
    assert value("rlbus_consumer_pending_messages", **labels) == 5
    assert value("rlbus_consumer_ack_pending_messages", **labels) == 7
    assert value("rlbus_consumer_pending_messages", stream="events", consumer="monitor") == 2
    families = scrape(metrics.serve_metrics("orchestrator", MetricsConfig()))
    consumers = {s.labels["consumer"] for s in families["rlbus_consumer_pending_messages"]}
    assert None not in consumers and "" not in consumers  # ephemeral consumers are left out
    assert all("stats" not in str(s.labels) for s in families["rlbus_stream_messages"])

    js.down = True  # an outage: the last values stay, the error reaches the poller
    with pytest.raises(TimeoutError):
        await orchestrator_metrics.refresh_stream_stats(bus)
    assert value("rlbus_stream_messages", stream="tasks") == 12

    js.down = False
    js.consumers[subjects.events_stream] = []  # the monitor's consumer is gone: so is its series
    await orchestrator_metrics.refresh_stream_stats(bus)
    scraped = metrics.REGISTRY.get_sample_value(
        "rlbus_consumer_pending_messages", {"stream": "events", "consumer": "monitor"}
    )
    assert scraped is None
