"""deploy/: the compose file, the SLURM script and nats.conf refer to things that exist.

No Docker engine or SLURM runs here, so these check what can be checked without one: the config
files each container starts from are exactly those `rl --dry-run` writes, every command exists,
the NATS config is accepted by the real nats-server, and the sbatch script parses.
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
    for pyproject in [ROOT / "shared/pyproject.toml", *ROOT.glob("services/*/pyproject.toml")]:
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
    result = subprocess.run(
        [server, "-c", tmp_path / "nats.conf", "-t"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_slurm_script_parses_and_uses_dry_run_configs():
    script = DEPLOY / "slurm" / "rl.sbatch"
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    text = script.read_text()
    for config in re.findall(r"\$CONFIGS/([\w-]+\.toml)", text):
        assert config in {"rl.toml", "inference.toml", "orchestrator.toml", "trainer.toml"}
    assert "--dry-run" in text and "nats.conf" in text
