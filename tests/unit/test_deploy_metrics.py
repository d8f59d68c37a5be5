"""deploy/: the observability profile (Prometheus, Grafana) fits the services and the metrics the
code defines, checked statically (no image is pulled; tests/e2e/test_prometheus_run.py runs a
real Prometheus against a real run).

- every rlbus service that serves /metrics does so on 0.0.0.0:9100 of its container, publishes no
  port, and is scraped by deploy/prometheus/prometheus.yml;
- Prometheus and Grafana are opt-in (`--profile observability`) and publish on 127.0.0.1 only;
- every query of deploy/grafana/dashboards/rlbus.json names a metric of rlbus.obs.metrics, and the
  dashboard covers each one the issue asks for.
"""

import json
import re
from pathlib import Path

import yaml

# Each package declares its own series on import: the dashboard may name any of them.
import rlbus_inference.metrics  # noqa: F401
import rlbus_launch.metrics  # noqa: F401
import rlbus_orchestrator.metrics  # noqa: F401
import rlbus_trainer.metrics  # noqa: F401
from rlbus.obs import metrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
METRICS_PORT = "9100"
SCRAPED = {"inference", "orchestrator", "worker", "trainer"}
"""The compose services that serve rlbus /metrics (the monitor and NATS serve none)."""
OBSERVABILITY = {"prometheus", "grafana"}
PROMETHEUS_SERIES = {"up"}
"""Series a query may name that Prometheus makes itself."""
SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def flag(command: list, name: str) -> str | None:
    command = list(map(str, command))
    return command[command.index(name) + 1] if name in command else None


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "dashboards" / "rlbus.json").read_text())


def queries() -> list[str]:
    return [t["expr"] for panel in dashboard()["panels"] for t in panel["targets"]]


def metric_of(series: str) -> str:
    for suffix in SUFFIXES:
        if series.endswith(suffix) and series.removesuffix(suffix) in metrics.metric_names():
            return series.removesuffix(suffix)
    return series


def test_every_rlbus_service_serves_metrics_on_the_compose_network_only():
    services = compose()["services"]
    serving = {n for n, s in services.items() if flag(s.get("command", []), "--metrics.port")}
    assert serving == SCRAPED
    for name in SCRAPED:
        command = services[name]["command"]
        assert flag(command, "--metrics.host") == "0.0.0.0", name
        assert flag(command, "--metrics.port") == METRICS_PORT, name
    for name, service in services.items():
        if not service.get("profiles"):
            assert "ports" not in service, f"{name} publishes a port"


def test_prometheus_and_grafana_are_opt_in_and_on_the_host_s_loopback_only():
    services = compose()["services"]
    assert OBSERVABILITY <= set(services)
    for name in OBSERVABILITY:
        service = services[name]
        assert service["profiles"] == ["observability"], name
        assert service["image"].split("/")[0] in ("prom", "grafana"), service["image"]
        assert ":" in service["image"] and not service["image"].endswith(":latest"), name
        for port in service["ports"]:
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
        for volume in service["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), f"{name} mounts missing {source}"
    assert {"prometheus", "grafana"} <= set(compose()["volumes"])


def test_prometheus_scrapes_every_service_on_its_metrics_port():
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    scraped: set[str] = set()
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            assert str(sd["port"]) == METRICS_PORT and sd["type"] == "A"
            scraped |= set(sd["names"])
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, _, port = target.rpartition(":")
                assert port == METRICS_PORT, target
                scraped.add(host)
    assert scraped == SCRAPED


def test_grafana_provisioning_points_at_prometheus_and_the_dashboard_folder():
    source = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"][0]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/rlbus.yml").read_text())[
        "providers"
    ][0]
    mounts = compose()["services"]["grafana"]["volumes"]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in mounts
    uids = {p["datasource"]["uid"] for p in dashboard()["panels"]}
    uids |= {t["datasource"]["uid"] for p in dashboard()["panels"] for t in p["targets"]}
    assert uids == {source["uid"]}


def test_every_dashboard_query_names_a_metric_the_code_defines():
    defined = metrics.metric_names()
    for expr in queries():
        names = set(re.findall(r"\brlbus_\w+", expr)) | set(re.findall(r"\b(up)\{", expr))
        assert names, f"no metric in {expr!r}"
        for series in names:
            assert metric_of(series) in defined | PROMETHEUS_SERIES, f"{series} in {expr!r}"


def test_the_dashboard_covers_what_a_run_needs():
    used = {metric_of(s) for expr in queries() for s in re.findall(r"rlbus_\w+", expr)}
    wanted = {
        "rlbus_trainer_steps",  # steps/s
        "rlbus_trainer_step_seconds",  # step time p50/p95
        "rlbus_rollouts",  # rollouts/s
        "rlbus_rollout_tokens",  # tokens/s
        "rlbus_stream_messages",  # queue depth
        "rlbus_consumer_pending_messages",  # consumer lag
        "rlbus_off_policy_lag_steps",
        "rlbus_weights_version",  # per replica
        "rlbus_service_restarts",
        "rlbus_dead_letters",  # quarantined
        "rlbus_http_client_request_seconds",  # HTTP latency p95
        "rlbus_orchestrator_reward_mean",  # reward per environment
        "rlbus_eval_reward",  # eval reward per environment
        "rlbus_eval_pass_at_k",
    }
    assert wanted <= used, wanted - used
    panels = dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    assert all(p["targets"] and p["title"] for p in panels)
