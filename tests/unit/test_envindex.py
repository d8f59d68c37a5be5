"""The index of environments `rl env install` put in venvs of their own (rlbus.envindex): one
lookup for the config load and the orchestrator's registry."""

import json

import pytest

from rlbus import envindex


def make_entry(env_id="my-env", **fields):
    values = {
        "id": env_id,
        "kind": envindex.VF_KIND,
        "python": f"/envs/{env_id}/bin/python",
        "taskset_id": env_id,
        "source": f"/src/{env_id}",
        **fields,
    }
    return envindex.InstalledEnv(**values)


def test_an_environment_directory_without_an_index_has_no_environments(tmp_path):
    assert envindex.read_index(tmp_path) == {}
    assert envindex.find_installed("my-env", tmp_path) is None


def test_a_recorded_environment_is_found_by_id(tmp_path):
    path = envindex.record(make_entry(editable=True, version="0.1.0"), tmp_path)

    assert path == tmp_path / "index.json"
    assert envindex.find_installed("my-env", tmp_path) == make_entry(editable=True, version="0.1.0")
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["envs"]["my-env"]["python"] == "/envs/my-env/bin/python"


def test_recording_again_replaces_the_entry_and_keeps_the_others(tmp_path):
    envindex.record(make_entry("a"), tmp_path)
    envindex.record(make_entry("b"), tmp_path)
    envindex.record(make_entry("a", version="2"), tmp_path)

    index = envindex.read_index(tmp_path)
    assert sorted(index) == ["a", "b"] and index["a"].version == "2"
    assert [p.name for p in tmp_path.iterdir()] == ["index.json"]  # no temp file left


def test_forget_drops_only_that_environment(tmp_path):
    envindex.record(make_entry("a"), tmp_path)
    envindex.record(make_entry("b"), tmp_path)

    assert envindex.forget("a", tmp_path) is True
    assert envindex.forget("a", tmp_path) is False
    assert sorted(envindex.read_index(tmp_path)) == ["b"]


def test_the_directory_is_the_flag_then_the_variable_then_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv(envindex.ENV_DIR_VAR, str(tmp_path / "var"))
    assert envindex.env_dir(tmp_path / "flag") == tmp_path / "flag"
    assert envindex.env_dir() == tmp_path / "var"
    monkeypatch.delenv(envindex.ENV_DIR_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert envindex.env_dir() == tmp_path / "cache" / "rlbus" / "envs"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert envindex.env_dir() == tmp_path / "home" / ".cache" / "rlbus" / "envs"


def test_lookups_read_the_directory_of_the_variable(monkeypatch, tmp_path):
    envindex.record(make_entry(), tmp_path)
    monkeypatch.setenv(envindex.ENV_DIR_VAR, str(tmp_path))

    assert envindex.find_installed("my-env") == make_entry()


@pytest.mark.parametrize("text", ["{not json", '{"envs": {"x": {"id": "x"}}}', "[]"])
def test_an_unreadable_index_names_the_file_and_the_fix(tmp_path, text):
    (tmp_path / "index.json").write_text(text)

    with pytest.raises(ValueError, match=r"index.json is unreadable .*`rl env install`"):
        envindex.read_index(tmp_path)


def test_the_install_command_names_a_local_package_of_this_checkout(tmp_path, monkeypatch):
    package = tmp_path / "environments" / "my_env"
    package.mkdir(parents=True)
    (package / "pyproject.toml").write_text("[project]\nname = 'my-env'\n")
    monkeypatch.chdir(tmp_path)

    assert envindex.install_command("my-env") == "`rl env install environments/my_env`"
    assert envindex.install_command("other") == "`rl env install <name or path>`"
