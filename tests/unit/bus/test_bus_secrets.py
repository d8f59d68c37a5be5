"""Bus secrets (issue 15, item 4): refused on command lines and in config files, read from 0600
files or the environment, never written into configs, scripts or argv by `rl` and `rl --slurm`."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from rlbus.configs import RLConfig
from rlbus.configs.base import config_to_toml, parse_cli
from rlbus.configs.bus import BusConfig
from rlbus.secrets import SecretError, write_secret_file
from rlbus_launch import natsserver as server
from rlbus_launch.plan import build_rl_launch

ROOT = Path(__file__).resolve().parents[3]
DEBUG_RL = ROOT / "configs" / "debug" / "rl.toml"
SECRET = "tok-3f9a7c1e5b"


@pytest.mark.parametrize(
    ("flag", "hint"),
    [
        (["--bus.token", SECRET], "RLBUS_BUS_TOKEN"),
        ([f"--bus.password={SECRET}"], "RLBUS_BUS_PASSWORD"),
        (["--trainer.bus.token", SECRET], "--bus.token-file"),
    ],
)
def test_a_secret_on_the_command_line_is_refused_without_echoing_it(capsys, flag, hint):
    with pytest.raises(SystemExit) as exited:
        parse_cli(RLConfig, [*flag, "--dry-run"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert hint in err and "0600" in err and SECRET not in err


def test_a_secret_in_a_toml_file_is_refused(tmp_path, capsys):
    path = tmp_path / "rl.toml"
    path.write_text(f'[bus]\ntoken = "{SECRET}"\n')
    path.chmod(0o600)  # even owner-only: secrets have one home, the secret file or the env
    with pytest.raises(SystemExit):
        parse_cli(RLConfig, ["@", str(path)])
    err = capsys.readouterr().err
    assert "bus.token" in err and SECRET not in err


def test_token_comes_from_the_file_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RLBUS_BUS_TOKEN", "from-env")
    assert BusConfig().secret_token() == "from-env"
    path = write_secret_file(tmp_path / "token", "from-file")
    assert BusConfig(token_file=str(path)).secret_token() == "from-file"
    path.chmod(0o644)
    with pytest.raises(SecretError, match=f"bus.token_file: .*chmod 600 {path}"):
        BusConfig(token_file=str(path)).secret_token()


def test_in_memory_secrets_never_reach_a_dump_or_a_repr():
    config = BusConfig(url="nats://h:4222", user="u").with_secrets(token=SECRET, password=SECRET)
    assert config.secret_token() == SECRET and config.secret_password() == SECRET
    copy = config.model_copy(deep=True)
    assert copy.secret_token() == SECRET  # survives the launcher's copies
    assert SECRET not in config_to_toml(config) + repr(config) + str(config.model_dump())


def test_rlbus_nats_refuses_a_token_flag(capsys):
    with pytest.raises(SystemExit) as exited:
        server.main(["--store", "/nonexistent", "--token", SECRET])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--token-file" in err and "RLBUS_BUS_TOKEN" in err


def files_holding(root: Path, text: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and text in p.read_text(errors="replace")]


def owner_only(path: Path) -> bool:
    return stat.S_IMODE(path.stat().st_mode) & 0o077 == 0


def test_rl_writes_the_env_token_only_into_a_0600_file(tmp_path):
    env = os.environ | {"RLBUS_BUS_TOKEN": SECRET}
    result = subprocess.run(
        [Path(sys.executable).parent / "rl", "@", DEBUG_RL, "--dry-run", "--output-dir", tmp_path,
         "--run.name", "r"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "r"
    holders = files_holding(run_dir, SECRET)
    assert holders and all(owner_only(p) for p in holders), holders
    assert {p.name for p in holders} == {"bus.token", "nats.conf"}
    assert stat.S_IMODE((run_dir / "secrets").stat().st_mode) == 0o700
    monitor = (run_dir / "scripts" / "monitor.sh").read_text()
    assert f"--bus.token-file {run_dir.absolute()}/secrets/bus.token" in monitor
    assert "token_file" in (run_dir / "configs" / "trainer.toml").read_text()


def test_build_rl_launch_puts_no_secret_in_any_argv(tmp_path):
    config = RLConfig().with_run_name("r")
    config.bus = config.bus.with_secrets(token=SECRET)
    launch = build_rl_launch(config, tmp_path)
    assert all(SECRET not in " ".join(p.argv) for p in launch.processes)
    assert list(launch.secret_files.values()) == [SECRET]


def test_rl_slurm_secures_the_sidecar_and_passes_only_paths(tmp_path):
    env = os.environ | {"RLBUS_BUS_TOKEN": SECRET}
    result = subprocess.run(
        [Path(sys.executable).parent / "rl", "@", DEBUG_RL, "--slurm", "--dry-run",
         "--output-dir", tmp_path, "--run.name", "r", "--deployment.num-rollout-workers", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "r"
    script = (run_dir / "slurm" / "rl.sbatch").read_text()
    assert SECRET not in script and "--token" not in script and "--bus.token " not in script
    security = run_dir / "secrets" / "nats"
    assert f"--security-dir {security}" in script and '--tls-host "$HEAD_ADDR"' in script
    assert 'BUS_URL="tls://$HEAD_ADDR:' in script
    for step, role in [("monitor", "monitor"), ("inference", "inference"),
                       ("orchestrator", "orchestrator"), ("worker-0", "worker"),
                       ("trainer", "trainer")]:  # fmt: skip
        line = next(x for x in script.splitlines() if x.startswith("start ") and f" {step} " in x)
        assert f"--bus.user {role} --bus.password-file {security}/{role}.password" in line, line
        assert f"--bus.tls-ca {security}/ca.pem" in line
    secrets = [p for p in security.iterdir() if p.suffix in (".password", ".key")]
    assert len(secrets) == 8 and all(owner_only(p) for p in secrets)
    assert stat.S_IMODE(security.stat().st_mode) == 0o700
