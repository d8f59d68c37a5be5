"""Ids without a prefix: built-in, entry point, module in rlbus's venv, then an environment that
`rl env install` recorded in the index, served like `vf:<taskset-id>` with the recorded python;
the config load resolves the same ids from metadata and the index alone."""

import sys
import textwrap
from importlib.metadata import EntryPoint

import pytest
from pydantic import ValidationError

from rlbus import envindex
from rlbus.configs.orchestrator import OrchestratorConfig, known_env_ids, unknown_env_error
from rlbus_orchestrator.envs import (
    EnvironmentNotFoundError,
    ReverseTextEnv,
    load_environment,
    registry,
)
from rlbus_orchestrator.envs.verifiers_adapter import VerifiersAdapter
from rlbus_orchestrator.envs.vf_server import VfServerEnv


@pytest.fixture
def env_dir(tmp_path, monkeypatch):
    """An empty environment directory that lookups read (RLBUS_ENV_DIR)."""
    directory = tmp_path / "envs"
    monkeypatch.setenv(envindex.ENV_DIR_VAR, str(directory))
    return directory


def install(env_dir, env_id, python=sys.executable, taskset_id=None):
    """What `rl env install` records for a verifiers 0.4 environment."""
    entry = envindex.InstalledEnv(
        id=env_id,
        kind=envindex.VF_KIND,
        python=str(python),
        taskset_id=taskset_id or env_id,
        source=f"/src/{env_id}",
    )
    envindex.record(entry, env_dir)
    return entry


def test_an_installed_id_is_a_vf_env_with_the_recorded_python(env_dir):
    install(env_dir, "reverse-text-v1", taskset_id="reverse-text-v1-module")

    env = load_environment("reverse-text-v1", {"env": {"taskset": {"num_tasks": 4}}})

    assert isinstance(env, VfServerEnv)
    assert env.env_id == "reverse-text-v1"  # tasks name it as the config does
    assert env.python == sys.executable
    # the roles' null harness and subprocess runtime are filled in by the server (it knows them)
    assert env.env_config == {"taskset": {"id": "reverse-text-v1-module", "num_tasks": 4}}


def test_args_python_and_address_win_over_the_index(env_dir, tmp_path):
    install(env_dir, "my-v1-env", python=tmp_path / "gone" / "python")
    other = tmp_path / "python"
    other.write_text("")

    assert load_environment("my-v1-env", {"python": str(other)}).python == str(other)
    remote = load_environment("my-v1-env", {"address": "tcp://127.0.0.1:5555"})
    assert remote.address == "tcp://127.0.0.1:5555"


def test_the_vf_prefix_still_needs_its_own_args(env_dir):
    install(env_dir, "reverse-text-v1")

    with pytest.raises(ValueError, match="args.python"):
        load_environment("vf:reverse-text-v1")


def test_earlier_kinds_win_over_the_index(env_dir, tmp_path, monkeypatch):
    for env_id in ("reverse-text", "my-env", "tiny-module-env", "only-installed"):
        install(env_dir, env_id)
    ep = EntryPoint(
        name="my-env",
        value="rlbus_orchestrator.envs.reverse_text:ReverseTextEnv",
        group=registry.ENTRY_POINT_GROUP,
    )
    monkeypatch.setattr(registry, "entry_points", lambda group: [ep])
    (tmp_path / "tiny_module_env.py").write_text(
        textwrap.dedent("""
        class Rubric:
            funcs = [lambda completion, answer: 1.0]
            weights = [1.0]
        class Env:
            dataset = [{"question": "hi", "answer": "hi"}]
            rubric = Rubric()
        def load_environment(**kwargs):
            return Env()
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    assert type(load_environment("reverse-text")) is ReverseTextEnv  # built-in
    assert type(load_environment("my-env")) is ReverseTextEnv  # entry point
    assert isinstance(load_environment("tiny-module-env"), VerifiersAdapter)  # module
    assert isinstance(load_environment("only-installed"), VfServerEnv)  # index


def test_an_importable_module_without_load_environment_falls_through_to_the_index(
    env_dir, tmp_path, monkeypatch
):
    (tmp_path / "half_env.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    with pytest.raises(EnvironmentNotFoundError, match="has no `load_environment`"):
        load_environment("half-env")
    install(env_dir, "half-env")
    assert isinstance(load_environment("half-env"), VfServerEnv)


def test_an_installed_env_whose_venv_is_gone_says_how_to_install_it_again(env_dir, tmp_path):
    install(env_dir, "my-v1-env", python=tmp_path / "gone" / "bin" / "python")

    with pytest.raises(EnvironmentNotFoundError, match="rl env install /src/my-v1-env"):
        load_environment("my-v1-env")


def test_flat_args_on_an_installed_env_point_to_args_env_taskset(env_dir):
    install(env_dir, "my-sort-v1")

    with pytest.raises(EnvironmentNotFoundError, match=r"args.env.taskset.min_turns"):
        load_environment("my-sort-v1", {"min_turns": 3})


def test_an_unknown_id_names_rl_env_install_and_the_index(env_dir):
    with pytest.raises(EnvironmentNotFoundError) as error:
        load_environment("no-such-env")

    assert "rl env install <name or path>" in str(error.value)
    assert str(env_dir / "index.json") in str(error.value)


def test_the_config_accepts_an_installed_id_without_args_python(env_dir):
    install(env_dir, "reverse-text-v1")

    config = OrchestratorConfig(env=[{"id": "reverse-text-v1"}, {"id": "reverse-text"}])

    assert [env.id for env in config.env] == ["reverse-text-v1", "reverse-text"]


def test_the_unknown_id_error_lists_installed_ids_guesses_them_and_says_how_to_install(env_dir):
    install(env_dir, "reverse-text-v1")

    message = unknown_env_error("reverse-text-v2", ["reverse-text"])

    assert message is not None
    assert "did you mean 'reverse-text-v1'?" in message
    assert "known ids: reverse-text; in their own venvs: reverse-text-v1" in message
    assert "install it with `rl env install <name or path>`" in message
    with pytest.raises(ValidationError, match="rl env install"):
        OrchestratorConfig(env=[{"id": "reverse-text-v2"}])


def test_the_unknown_id_error_says_when_the_index_is_unreadable(env_dir):
    env_dir.mkdir()
    (env_dir / "index.json").write_text("{not json")

    assert unknown_env_error("reverse-text", known_env_ids()) is None  # never read for it
    message = unknown_env_error("my-v1-env", known_env_ids())
    assert message is not None and "index.json is unreadable" in message
