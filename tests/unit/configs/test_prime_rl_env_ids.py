"""prime-rl's environments keep their ids here (rlbus.configs.migrate): every layout prime-rl had
(`[orchestrator.environment]`, `[[orchestrator.env]]`, `[[orchestrator.train.env]]`,
`[[orchestrator.train.source]]`) becomes `[[orchestrator.env]]` entries that run once the
environment is installed, and `rl migrate-config` prints the `rl env install` line of each one
that is not."""

import sys
from pathlib import Path

import pytest
import tomli

from rlbus import envindex
from rlbus.configs import orchestrator as orchestrator_config
from rlbus.configs.migrate import migrate, prime_env_sources
from rlbus_launch.migrate_config import main

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def only_built_ins(monkeypatch, tmp_path):
    """rlbus's venv knows the built-ins only (whatever else this venv has installed); the index
    is an empty temp one."""
    monkeypatch.setattr(orchestrator_config, "known_env_ids", lambda: ["reverse-text"])
    monkeypatch.setattr(
        orchestrator_config, "resolves_in_rlbus_venv", lambda env_id, known: env_id in known
    )
    monkeypatch.setenv(envindex.ENV_DIR_VAR, str(tmp_path / "envs"))


def source(taskset, **env):
    return {
        "orchestrator": {"train": {"source": [{"name": "x", "env": {"taskset": taskset, **env}}]}}
    }


def envs_of(data):
    migrated, _ = migrate(data, "rl")
    return migrated["orchestrator"]["env"]


DEFAULT_AGENT = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}


def test_a_source_of_an_env_not_in_rlbus_venv_keeps_its_verifiers_config_under_args_env():
    taskset = {"id": "alphabet-sort", "min_turns": 3, "task": {"power_per_turn": False}}

    assert envs_of(source(taskset, agent=DEFAULT_AGENT)) == [
        {
            "id": "alphabet-sort",
            "args": {"env": {"taskset": {"min_turns": 3, "task": {"power_per_turn": False}}}},
        }
    ]


def test_a_source_keeps_a_harness_other_than_the_default():
    agent = {"harness": {"id": "bash"}, "runtime": {"type": "subprocess"}}

    assert envs_of(source({"id": "wiki-search"}, agent=agent)) == [
        {"id": "wiki-search", "args": {"env": {"agent": {"harness": {"id": "bash"}}}}}
    ]


def test_a_source_with_only_defaults_needs_no_args():
    assert envs_of(source({"id": "wordle"}, player=DEFAULT_AGENT)) == [{"id": "wordle"}]


def test_a_source_of_an_env_in_rlbus_venv_gets_flat_args():
    taskset = {"id": "reverse-text", "min_len": 3}

    assert envs_of(source(taskset, agent=DEFAULT_AGENT)) == [
        {"id": "reverse-text", "args": {"min_len": 3}}
    ]


def test_a_taskset_written_in_the_entry_is_read_like_one_under_env():
    """prime-rl's newest `[[orchestrator.train.env]]` layout: `taskset` and `harness` in the
    entry; an env of rlbus's venv gets the taskset keys and its `task` table as flat args."""
    entry = {
        "name": "r",
        "taskset": {"id": "reverse-text", "min_len": 3, "task": {"power": 2}},
        "harness": {"id": "null", "runtime": {"type": "subprocess"}},
    }
    data = {"orchestrator": {"train": {"env": [entry]}}}
    assert envs_of(data) == [{"id": "reverse-text", "args": {"min_len": 3, "power": 2}}]
    assert prime_env_sources(data) == {"reverse-text": "reverse-text"}

    vf_entry = {**entry, "taskset": {"id": "owner/alphabet-sort", "min_turns": 3}}
    vf_data = {"orchestrator": {"train": {"env": [vf_entry]}}}
    assert envs_of(vf_data) == [
        {"id": "alphabet-sort", "args": {"env": {"taskset": {"min_turns": 3}}}}
    ]
    assert prime_env_sources(vf_data) == {"alphabet-sort": "owner/alphabet-sort"}


def test_an_entry_with_env_taskset_and_a_player():
    entry = {"name": "wordle", "env": {"taskset": {"id": "wordle-v1"}, "player": DEFAULT_AGENT}}
    assert envs_of({"orchestrator": {"train": {"env": [entry]}}}) == [{"id": "wordle-v1"}]


def test_a_source_keeps_its_sampling_group_size_and_limits_and_drops_its_curriculum():
    entry = {
        "name": "wiki",
        "ratio": 2.0,
        "curriculum": {"gates": {"zero_advantage": {"type": "advantage_range"}}},
        "sampling": {"max_completion_tokens": 64, "temperature": 0.7},
        "group_size": 4,
        "max_turns": 3,
        "env": {"taskset": {"id": "reverse-text"}, "agent": DEFAULT_AGENT},
    }
    assert envs_of({"orchestrator": {"train": {"source": [entry]}}}) == [
        {
            "id": "reverse-text",
            "weight": 2.0,
            "sampling": {"max_tokens": 64, "temperature": 0.7},
            "group_size": 4,
            "max_turns": 3,
        }
    ]


def test_rlbus_entries_pass_through_unchanged():
    entry = {"id": "reverse-text", "weight": 1.5, "sampling": {"max_tokens": 8}, "group_size": 2}
    assert envs_of({"orchestrator": {"env": [dict(entry)]}}) == [entry]


@pytest.mark.parametrize(
    "data",
    [
        {"orchestrator": {"environment": {"id": "primeintellect/wordle", "args": {"a": 1}}}},
        {"orchestrator": {"env": [{"id": "primeintellect/wordle", "name": "w", "args": {"a": 1}}]}},
        {
            "orchestrator": {
                "train": {"env": [{"id": "primeintellect/wordle@0.1.4", "args": {"a": 1}}]}
            }
        },
    ],
)
def test_older_layouts_lose_the_owner_and_name_and_keep_their_args(data):
    assert envs_of(data) == [{"id": "wordle", "args": {"a": 1}}]
    assert list(prime_env_sources(data)) == ["wordle"]
    assert prime_env_sources(data)["wordle"].startswith("primeintellect/wordle")


def test_a_hub_id_in_a_source_loses_its_owner():
    data = source({"id": "primeintellect/alphabet-sort"})

    assert envs_of(data) == [{"id": "alphabet-sort"}]
    assert prime_env_sources(data) == {"alphabet-sort": "primeintellect/alphabet-sort"}


def test_rlbus_env_entries_are_left_alone():
    data = {"orchestrator": {"env": [{"id": "reverse-text-v1", "args": {"env": {}}, "weight": 2}]}}

    migrated, changes = migrate(data, "rl")

    assert migrated == data and changes == []


def write(tmp_path, text):
    path = tmp_path / "prime.toml"
    path.write_text(text)
    return str(path)


WORDLE = """
[[orchestrator.env]]
id = "primeintellect/wordle"
name = "wordle"

[[orchestrator.env]]
id = "reverse-text"
"""


REVERSE_TEXT_V1 = """
[[orchestrator.train.source]]
name = "reverse-text-v1"

[orchestrator.train.source.env.taskset]
id = "reverse-text-v1"
num_tasks = 64
"""


def test_migrate_config_prints_the_install_line_of_each_env_not_installed(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # no environments/ folder here
    out = tmp_path / "rl.toml"

    assert main([write(tmp_path, WORDLE), "-o", str(out)]) == 0

    report = capsys.readouterr().err
    assert "install  rl env install primeintellect/wordle   (environment 'wordle')" in report
    assert "rl env install reverse-text" not in report
    assert "invalid" not in report  # the id is kept, not counted as a key for a human
    assert "loads it once the environments above are installed" in report
    assert tomli.loads(out.read_text())["orchestrator"]["env"] == [
        {"id": "wordle"},
        {"id": "reverse-text"},
    ]


def test_migrate_config_names_the_local_package_of_a_repo_env(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    assert main([write(tmp_path, REVERSE_TEXT_V1)]) == 0

    report = capsys.readouterr().err
    assert (
        "install  rl env install environments/reverse_text_v1   (environment 'reverse-text-v1')"
        in report
    )


def test_migrate_config_prints_no_install_line_for_an_installed_env(tmp_path, capsys):
    envindex.record(
        envindex.InstalledEnv("reverse-text-v1", "vf", sys.executable, "reverse-text-v1", "/src")
    )

    assert main([write(tmp_path, REVERSE_TEXT_V1)]) == 0

    captured = capsys.readouterr()
    assert "install  " not in captured.err
    assert tomli.loads(captured.out)["orchestrator"]["env"] == [
        {"id": "reverse-text-v1", "args": {"env": {"taskset": {"num_tasks": 64}}}}
    ]
