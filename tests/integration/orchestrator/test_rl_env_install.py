"""`rl env install environments/reverse_text_v1` for real: a venv of its own with verifiers 0.4
from PyPI, recorded in the index; then the id `reverse-text-v1` (no `vf:`, no args.python) is
listed by `rl env list`, passes the config load of `rl --print-config`, and the orchestrator's
registry builds the environment, whose tasks are listed through that venv's python.

The venv is the one every verifiers 0.4 test uses (tests/vf_support.py builds it with this same
command, once, under `$RLBUS_TEST_CACHE/envs`); installing again here checks that a second install
reuses it and updates the record.
"""

import os
import re
import subprocess
import sys

import pytest
from vf_support import VF_ENV_ID, make_vf_venv, rl_env_install, vf_env_dir

from rlbus import envindex
from rlbus.configs.orchestrator import OrchestratorConfig
from rlbus_orchestrator.envs import load_environment
from rlbus_orchestrator.envs.vf_server import VfServerEnv

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed():
    """The env venv's python, and the output of installing it again."""
    python = make_vf_venv()
    return python, rl_env_install(vf_env_dir())


def rl(*args: str, cwd, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlbus_launch.rl", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_installing_again_reuses_the_venv_and_names_the_id(installed):
    python, again = installed

    assert again.returncode == 0, again.stderr
    lines = again.stdout.splitlines()
    assert f"rl env install: reusing the venv {python.parent.parent}" in lines
    assert f'{VF_ENV_ID} is installed: set `id = "{VF_ENV_ID}"` in [[orchestrator.env]]' in lines
    entry = envindex.find_installed(VF_ENV_ID, vf_env_dir())
    assert entry is not None and entry.python == str(python) and entry.editable
    assert entry.taskset_id == VF_ENV_ID


def test_rl_env_list_and_the_config_load_know_the_id(installed, tmp_path):
    python, _ = installed
    env = {**os.environ, envindex.ENV_DIR_VAR: str(vf_env_dir())}

    listed = rl("env", "list", cwd=tmp_path, env=env)
    assert listed.returncode == 0, listed.stderr
    # the id column is as wide as the longest installed id (the suite installs other packages)
    assert re.search(
        rf"^{re.escape(VF_ENV_ID)} +verifiers 0\.4, own venv {re.escape(str(python))}",
        listed.stdout,
        re.M,
    ), listed.stdout

    config = tmp_path / "rl.toml"
    config.write_text(f'[[orchestrator.env]]\nid = "{VF_ENV_ID}"\n')
    loaded = rl("@", str(config), "--print-config", cwd=tmp_path, env=env)
    assert loaded.returncode == 0, loaded.stderr
    assert f'id = "{VF_ENV_ID}"' in loaded.stdout

    elsewhere = {**env, envindex.ENV_DIR_VAR: str(tmp_path / "no-envs")}
    unknown = rl("@", str(config), "--print-config", cwd=tmp_path, env=elsewhere)
    assert unknown.returncode == 2 and "rl env install" in unknown.stderr


def test_the_registry_builds_the_installed_env_and_lists_its_tasks(installed, monkeypatch):
    python, _ = installed
    monkeypatch.setenv(envindex.ENV_DIR_VAR, str(vf_env_dir()))
    args = {"env": {"taskset": {"num_tasks": 4}}}
    config = OrchestratorConfig(env=[{"id": VF_ENV_ID, "args": args}])

    env = load_environment(config.env[0].id, config.env[0].args)

    assert isinstance(env, VfServerEnv) and env.python == str(python)
    assert env.num_examples("train") == 4
    problem = env.example("train", 0)
    assert problem.messages[0].content == "Reverse the text character by character."
    assert problem.info["vf_task_data"]
