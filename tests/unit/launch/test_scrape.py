"""Where `rl` runs each process's Prometheus /metrics (rlbus_launch.plan) and the targets file it
keeps for Prometheus (rlbus_launch.scrape)."""

import json
import tomllib

from rlbus.configs import RLConfig
from rlbus.configs.base import parse_cli
from rlbus.obs import metrics
from rlbus_launch.plan import build_rl_launch
from rlbus_launch.scrape import TARGETS_FILE, ScrapeTargets, service_of
from rlbus_launch.scripts import write_configs


def plan(tmp_path, *flags: str):
    config = parse_cli(RLConfig, ["--deployment.cpu-binding", "off", *flags]).with_run_name("r")
    return build_rl_launch(config, tmp_path)


def test_every_process_gets_its_own_metrics_port_written_where_it_starts_from(tmp_path):
    launch = plan(
        tmp_path, "--deployment.num-infer-replicas", "2", "--deployment.num-rollout-workers", "2"
    )
    names = {"inference-0", "inference-1", "orchestrator", "trainer", "worker-0", "worker-1"}
    assert set(launch.metrics) == names
    ports = [address.rpartition(":")[2] for address in launch.metrics.values()]
    assert len(set(ports)) == len(ports) and all(
        a.startswith("127.0.0.1:") for a in launch.metrics.values()
    )
    write_configs(tmp_path, launch.configs)
    for name in ("inference-0", "inference-1", "orchestrator", "trainer"):
        written = tomllib.loads((tmp_path / "configs" / f"{name}.toml").read_text())["metrics"]
        assert f"{written['host']}:{written['port']}" == launch.metrics[name]
    argvs = {p.name: p.argv for p in launch.processes}
    for worker in ("worker-0", "worker-1"):  # they share the orchestrator's file
        argv = argvs[worker]
        assert argv[argv.index("--metrics.port") + 1] == launch.metrics[worker].rpartition(":")[2]
        assert argv[-2:] == ["--role", "worker"]


def test_a_port_set_on_a_service_is_kept_and_the_launcher_s_own_is_not_pushed_down(tmp_path):
    launch = plan(
        tmp_path,
        "--metrics.port", "9100",
        "--trainer.metrics.port", "9101",
        "--inference.metrics.port", "9200",
        "--deployment.num-infer-replicas", "2",
    )  # fmt: skip
    assert launch.metrics["trainer"] == "127.0.0.1:9101"
    assert launch.metrics["inference-0"] == "127.0.0.1:9200"
    assert launch.metrics["inference-1"] == "127.0.0.1:9201"  # replica i: port + i
    assert "9100" not in launch.metrics["orchestrator"]  # 9100 is the launcher's own
    assert launch.configs["rl"].metrics.port == 9100


def test_no_metrics_means_no_ports_no_flags_and_no_targets_file(tmp_path, monkeypatch):
    launch = plan(tmp_path, "--no-metrics", "--deployment.num-rollout-workers", "1")
    assert launch.metrics == {}
    assert all(getattr(c, "metrics", None) is None for c in launch.configs.values())
    assert not any("--metrics.port" in p.argv for p in launch.processes)
    monkeypatch.setattr(metrics, "_address", None)  # as in a fresh launcher process
    targets = ScrapeTargets.for_launch(launch)
    targets.started("trainer")
    targets.close()
    assert not (tmp_path / TARGETS_FILE).exists()


def test_targets_file_lists_started_processes_in_file_sd_format_and_is_emptied_at_exit(tmp_path):
    launch = plan(tmp_path, "--deployment.num-infer-replicas", "2")
    targets = ScrapeTargets.for_launch(launch)  # serves the launcher's own /metrics
    path = tmp_path / TARGETS_FILE

    def listed() -> dict[str, dict]:
        return {e["labels"]["instance"]: e for e in json.loads(path.read_text())}

    assert set(listed()) == {"rl"}
    for name in ("inference-0", "inference-1", "orchestrator", "monitor", "trainer"):
        targets.started(name)  # the monitor serves no metrics: not listed
    entries = listed()
    assert set(entries) == {"rl", "inference-0", "inference-1", "orchestrator", "trainer"}
    assert entries["inference-1"] == {
        "targets": [launch.metrics["inference-1"]],
        "labels": {"service": "inference", "instance": "inference-1", "run": "r"},
    }
    assert entries["rl"]["targets"] == [metrics.host_port(*metrics.serving_address())]
    assert (
        metrics.REGISTRY.get_sample_value("rlbus_service_restarts_total", {"process": "trainer"})
        is not None
    )  # at 0 from the first start
    targets.close()
    assert json.loads(path.read_text()) == []


def test_service_of_a_numbered_process_is_its_kind():
    assert [service_of(n) for n in ("inference-3", "worker-0", "trainer", "rl", "inference")] == [
        "inference", "worker", "trainer", "rl", "inference"
    ]  # fmt: skip
