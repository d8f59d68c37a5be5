"""deploy/: the compose file, the SLURM script and nats.conf refer to things that exist.

The fast checks, without an engine or a controller (tests/e2e/test_compose.py and
tests/e2e/test_slurm.py run both for real): the config files each container starts from are
exactly those `rl --dry-run` writes, every command exists, the NATS config is accepted by the real
nats-server, and the sbatch script parses.
"""

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BIN = Path(sys.executable).parent


def console_scripts() -> set[str]:
    names = set()
    for pyproject in [
        ROOT / "shared/pyproject.toml",
        ROOT / "launch/pyproject.toml",
        *ROOT.glob("services/*/pyproject.toml"),
    ]:
        names |= set(tomllib.loads(pyproject.read_text())["project"].get("scripts", {}))
    return names


def compose_services() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]


def test_compose_services_start_from_the_configs_rl_dry_run_writes(tmp_path):
    result = subprocess.run(
        [BIN / "rl", "@", ROOT / "examples/reverse-text/rl.toml", "--dry-run", "--bus.url", "nats://nats:4222",
         "--output-dir", tmp_path, "--run.name", "compose"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    written = {p.name for p in (tmp_path / "compose" / "configs").glob("*.toml")}
    for name, service in compose_services().items():
        command = " ".join(map(str, service.get("command", [])))
        for config in re.findall(r"configs/([\w-]+\.toml)", command):
            assert config in written, (
                f"compose service {name} starts from {config}, which rl --dry-run does not write"
            )


def test_compose_entrypoints_are_real_commands_or_modules():
    scripts = console_scripts()
    dockerfile_entrypoints = set(
        re.findall(r'ENTRYPOINT \["([\w-]+)"\]', (DEPLOY / "Dockerfile").read_text())
    )
    assert dockerfile_entrypoints <= scripts
    for name, service in compose_services().items():
        entrypoint = service.get("entrypoint")
        if entrypoint and entrypoint[:2] == ["python", "-m"]:
            module = entrypoint[2]
            check = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    f"import importlib.util as u; assert u.find_spec({module!r})",
                ]
            )
            assert check.returncode == 0, f"{name}: module {module} not found"


def test_nats_conf_is_accepted_by_nats_server(tmp_path):
    server = shutil.which("nats-server", path=str(BIN)) or shutil.which("nats-server")
    conf = (DEPLOY / "nats.conf").read_text().replace("/data/nats", str(tmp_path / "store"))
    (tmp_path / "nats.conf").write_text(conf)
    # the file it includes (users, permissions, TLS), as its header says to make it
    made = subprocess.run(
        [BIN / "rlbus-nats-config", "--dir", tmp_path / "secrets", "--run-id", "r", "--host", "nats"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    result = subprocess.run(
        [server, "-c", tmp_path / "nats.conf", "-t"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_slurm_script_parses_and_forwards_to_rl_slurm():
    script = DEPLOY / "slurm" / "rl.sbatch"
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    last = script.read_text().strip().splitlines()[-1]
    assert last == 'exec rl @ "$RLBUS_CONFIG" --slurm "$@"'


def test_compose_names_its_images_and_every_service_ends_with_the_run():
    for name, service in compose_services().items():
        if service.get("profiles"):  # opt-in third-party tools (tracing, metrics)
            continue
        assert service["image"].startswith("rlbus-"), f"{name}: no rlbus image name (--no-build)"
        command = list(map(str, service.get("command", [])))
        if name not in {"nats-secrets", "resolve", "trainer"}:  # one-shots, and the run's end
            assert "--exit-when-finished" in command, f"{name} would outlive the run"
    nats = compose_services()["nats"]
    assert "--run-id" in nats["command"] and "ports" not in nats
    assert compose_services()["inference"]["shm_size"]


def test_gpu_override_pins_devices_per_service():
    override = yaml.safe_load((DEPLOY / "docker-compose.gpu.yml").read_text())["services"]
    ids = {}
    for name in ("inference", "trainer"):
        (device,) = override[name]["deploy"]["resources"]["reservations"]["devices"]
        assert "count" not in device
        ids[name] = device["device_ids"]
    assert ids["inference"] != ids["trainer"]


def test_dockerfile_targets_and_build_args():
    text = (DEPLOY / "Dockerfile").read_text()
    targets = set(re.findall(r"^FROM \S+ AS ([\w-]+)$", text, re.M))
    assert {
        "launcher",
        "orchestrator",
        "inference",
        "trainer",
        "inference-cuda",
        "trainer-cuda",
    } <= targets
    for service in compose_services().values():
        if "build" in service:
            assert service["build"]["target"] in targets
    assert "ARG BASE_IMAGE=python:3.11-slim" in text and "HF_HUB_OFFLINE" not in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", "outputs"} <= set(ignored)


def test_podman_setup_script_parses():
    assert subprocess.run(["bash", "-n", DEPLOY / "podman" / "setup.sh"]).returncode == 0


def test_each_compose_service_mounts_only_its_own_password():
    """A container sees ca.pem and its own role's password, never another role's: the per-role
    subject permissions would mean nothing if a worker could log in as the trainer."""
    services = compose_services()
    shared = services["nats-secrets"]["command"]
    for name, service in services.items():
        user = service.get("command", [])
        if "--bus.user" not in user:
            continue
        role = user[user.index("--bus.user") + 1]
        secret_mounts = [v for v in service["volumes"] if v.endswith(":/secrets:ro")]
        assert secret_mounts == [f"secrets-{role}:/secrets:ro"], name
        assert f"{role}=/share/{role}" in shared
        assert f"secrets-{role}:/share/{role}" in services["nats-secrets"]["volumes"]


def test_the_tracing_profile_forwards_every_span_to_jaeger_and_a_file():
    services = compose_services()
    assert services["otel-collector"]["profiles"] == services["jaeger"]["profiles"] == ["tracing"]
    assert services["jaeger"]["ports"] == ["127.0.0.1:16686:16686"]  # the UI, on the host only
    collector = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    assert set(collector["receivers"]["otlp"]["protocols"]) == {"grpc", "http"}
    (pipeline,) = collector["service"]["pipelines"].values()
    assert set(pipeline["exporters"]) == {"otlp/jaeger", "file"}
    assert collector["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"
